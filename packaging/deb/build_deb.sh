#!/usr/bin/env bash
# Build dist/hivekeeper_<version>_<arch>.deb from a frozen bundle folder (PyInstaller's dist/hivekeeper/, made by
# packaging/pyinstaller.spec): the bundle goes to /opt/hivekeeper, /usr/bin/hivekeeper links to its executable, and
# the desktop files of packaging/linux go to /usr/share (menu entry, icons, AppStream metainfo) and
# /usr/lib/systemd/user (the node service). The autostart entry is not installed system-wide: starting a node at
# login is each user's choice (`hivekeeper install-desktop --autostart`).
#   packaging/deb/build_deb.sh BUNDLE_DIR [OUT_DIR]      (OUT_DIR: dist)
# DEB_COMPRESSION=gzip (or zstd, none) trades size for speed: xz, the default, takes minutes on a GB-sized bundle.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
bundle="${1:?usage: build_deb.sh BUNDLE_DIR [OUT_DIR]}"
out="${2:-$root/dist}"
if [ ! -x "$bundle/hivekeeper" ]; then
    echo "build_deb.sh: $bundle/hivekeeper: no executable there (build the bundle first: packaging/README.md)" >&2
    exit 2
fi
version="$(sed -n 's/^version = "\(.*\)"$/\1/p' "$root/pyproject.toml" | head -n 1)"
arch="$(dpkg --print-architecture)"
linux="$root/packaging/linux"
app_id="io.github.hivekeeper.Hivekeeper"
stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT
chmod 755 "$stage"

install -d "$stage/DEBIAN" "$stage/opt/hivekeeper" "$stage/usr/bin"
cp -a "$bundle/." "$stage/opt/hivekeeper/"
ln -s /opt/hivekeeper/hivekeeper "$stage/usr/bin/hivekeeper"
install -D -m 644 "$linux/$app_id.desktop" "$stage/usr/share/applications/$app_id.desktop"
install -D -m 644 "$linux/$app_id.metainfo.xml" "$stage/usr/share/metainfo/$app_id.metainfo.xml"
install -D -m 644 "$linux/icons/hivekeeper.svg" "$stage/usr/share/icons/hicolor/scalable/apps/hivekeeper.svg"
for png in "$linux"/icons/hivekeeper-*.png; do
    size="$(basename "$png" .png)"; size="${size##*-}"
    install -D -m 644 "$png" "$stage/usr/share/icons/hicolor/${size}x${size}/apps/hivekeeper.png"
done
install -D -m 644 "$linux/hivekeeper-node.service" "$stage/usr/lib/systemd/user/hivekeeper-node.service"
install -m 755 "$here/postinst" "$here/postrm" "$stage/DEBIAN/"
size_kb="$(du -sk --exclude=DEBIAN "$stage" | cut -f1)"
sed -e "s/@VERSION@/$version/" -e "s/@ARCH@/$arch/" -e "s/@SIZE_KB@/$size_kb/" "$here/control" > "$stage/DEBIAN/control"
mkdir -p "$out"
deb="$out/hivekeeper_${version}_${arch}.deb"
dpkg-deb --build --root-owner-group -Z"${DEB_COMPRESSION:-xz}" "$stage" "$deb" >/dev/null
echo "$deb"
