"""Hivekeeper's version and the versions of the parts it runs on: `hivekeeper --version` and the app's About box.

The version is written once, in pyproject.toml. An installed Hivekeeper (a wheel, the editable install `make` makes, a
frozen bundle, which copies the package metadata) carries it in its metadata, read back here with importlib.metadata,
so no module repeats it. torch's and hivemind's versions are read the same way, from their metadata, without
importing them: the app paints before torch is loaded, and `--version` stays instant.

APP_ID, the desktop's id of the app (its desktop entry packaging/linux/APP_ID.desktop, metainfo, the Qt app's desktop
file name), is defined here too: the CLI's install-desktop and the app both need it, and the app may not import the
CLI.
"""

from __future__ import annotations

import platform
from importlib import metadata

DISTRIBUTION = "hivekeeper"
APP_ID = "io.github.hivekeeper.Hivekeeper"
NOT_INSTALLED = "not installed"


def version_of(distribution: str) -> str:
    """The installed version of a distribution (a PyPI name), or NOT_INSTALLED."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return NOT_INSTALLED


def hivekeeper_version() -> str:
    return version_of(DISTRIBUTION)


def component_versions() -> dict[str, str]:
    """Name -> version of Hivekeeper and what it runs on (the Qt ones are added by the app, which has Qt loaded)."""
    return {"Hivekeeper": hivekeeper_version(), "Python": platform.python_version(), "torch": version_of("torch"),
            "hivemind": version_of("hivemind")}


def version_line() -> str:
    """`hivekeeper --version`: 'hivekeeper 0.1.0 (Python 3.11.2, torch 2.13.0+cpu, hivemind 1.1.12)'."""
    versions = component_versions()
    parts = ", ".join(f"{name} {value}" for name, value in versions.items() if name != "Hivekeeper")
    return f"hivekeeper {versions['Hivekeeper']} ({parts})"
