"""The bench modules the tests under tests/bench import as their scripts run: from bench/, which is first on
sys.path when a bench runs (they import its _common)."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def calibration_bench():
    """bench/calibration_accuracy.py as a module; HIVEKEEPER_GGUF_PACKED, which it sets on import (its fp32 runs),
    as it was after."""
    sys.path.insert(0, str(BENCH))
    packed = os.environ.get("HIVEKEEPER_GGUF_PACKED")
    try:
        yield importlib.import_module("calibration_accuracy")
    finally:
        sys.path.remove(str(BENCH))
        if packed is None:
            os.environ.pop("HIVEKEEPER_GGUF_PACKED", None)
        else:
            os.environ["HIVEKEEPER_GGUF_PACKED"] = packed


@pytest.fixture(scope="module")
def bench_common():
    """bench/_common.py as a module (what the bench scripts share)."""
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("_common")
    finally:
        sys.path.remove(str(BENCH))
