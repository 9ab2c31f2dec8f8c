#!/usr/bin/env bash
# macOS: build Hivekeeper.app with packaging/pyinstaller.spec (its BUNDLE step runs on macOS only) and wrap it in
# dist/Hivekeeper-<version>.dmg. UNVERIFIED: no macOS machine was available (packaging/README.md). Needs Xcode's
# command line tools (iconutil, hdiutil) and PyInstaller in the venv. The .icns is made here from the PNG icons.
# Not signed or notarized: Gatekeeper asks the user to allow it (right click > Open) until a Developer ID signs it.
#   packaging/macos/build_dmg.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
version="$(sed -n 's/^version = "\(.*\)"$/\1/p' "$root/pyproject.toml" | head -n 1)"
icons="$root/packaging/linux/icons"
iconset="$(mktemp -d)/hivekeeper.iconset"
trap 'rm -rf "$(dirname "$iconset")"' EXIT
mkdir -p "$iconset"
for size in 16 32 128 256 512; do
    cp "$icons/hivekeeper-$size.png" "$iconset/icon_${size}x${size}.png"
done
for size in 16 32 128 256; do  # @2x: twice the pixels
    cp "$icons/hivekeeper-$((size * 2)).png" "$iconset/icon_${size}x${size}@2x.png"
done
iconutil -c icns "$iconset" -o "$here/hivekeeper.icns"
cd "$root"
pyinstaller --noconfirm --distpath dist --workpath build/pyinstaller packaging/pyinstaller.spec
hdiutil create -volname Hivekeeper -srcfolder dist/Hivekeeper.app -ov -format UDZO "dist/Hivekeeper-$version.dmg"
echo "dist/Hivekeeper-$version.dmg"
