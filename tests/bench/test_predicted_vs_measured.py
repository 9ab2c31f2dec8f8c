"""bench/predicted_vs_measured.py's verdict (issue 14 item 12, session 11): the median prediction against the
median measurement per model, beside the host's own spread during the runs. Fed-in figures; nothing is timed."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))  # the bench imports its folder's _common, as when run as a script
    try:
        yield importlib.import_module("predicted_vs_measured")
    finally:
        sys.path.remove(str(BENCH))


def test_the_verdict_is_the_median_prediction_over_the_median_measurement(bench):
    # the lead's session-10 demo runs: one decode caught a slow phase (19.1 tok/s where the next ran at 31.9)
    got = bench.summary([23.5, 27.1, 46.1, 30.7], [25.4, 24.6, 19.1, 31.9], [9.8, 11.4, 14.1, 19.8])
    assert got["ratios"] == [0.925, 1.102, 2.414, 0.962]
    assert got["predicted_median"] == pytest.approx(28.9) and got["measured_median"] == pytest.approx(25.0)
    assert got["ratio"] == pytest.approx(28.9 / 25.0, abs=1e-3) and not got["within_goal"]  # 1.156: 15.6% off
    assert got["host_stream_gbps"] == {"min": 9.8, "median": 12.75, "max": 19.8, "spread": pytest.approx(0.784, 1e-3)}


def test_a_ratio_beyond_the_goal_fails_and_no_host_figures_says_so(bench):
    far = bench.summary([100.0, 110.0], [80.0, 82.0], [])
    assert far["ratio"] == pytest.approx(105.0 / 81.0, abs=1e-3) and not far["within_goal"]
    assert far["host_stream_gbps"] == {}
    near = bench.summary([90.0], [100.0], [12.0])
    assert near["ratio"] == 0.9 and near["within_goal"] and near["host_stream_gbps"]["spread"] == 0.0


def run(predicted: float, stream: float, now: float | None, now_stream: float = 0.0) -> dict:
    plan = {"decode_tokens_per_s": predicted, "measured": {"decode_stream_gbps": stream}, "efficiency": "measured",
            "policy": {"weight_format": "fp32"}, "parts_ms": {}}
    if now is not None:
        plan["now"] = {"decode_tokens_per_s": now, "stream_gbps": now_stream}
    return plan


def test_each_run_is_also_judged_from_a_reading_right_before_its_decode(bench):
    """The profile's prediction missed (a quick measurement at 17.4 GB/s, the decodes at ~11); the one from a reading
    beside each decode is the model's own error, judged the same way (median against median)."""
    results = [(run(30.0, 17.4, 21.0, 11.2), 20.0), (run(31.0, 17.0, 19.5, 10.4), 21.0), (run(29.0, 16.8, 22.5, 12.1),
                                                                                         22.0)]
    line = bench.model_line("demo-100m", results, 64, 64, load_before=1.0)
    assert line["ratio"] == pytest.approx(30.0 / 21.0, abs=1e-3) and not line["within_goal"]
    assert line["now_predicted_tokens_per_s"] == [21.0, 19.5, 22.5]
    assert line["now"]["ratio"] == pytest.approx(21.0 / 21.0) and line["now"]["within_goal"]
    assert line["now"]["ratios"] == [1.05, 0.929, 1.023]
    assert line["now"]["host_stream_gbps"]["median"] == 11.2
    # a run without its reading (--no-measure): no judgement from readings at all rather than one from some runs
    partial = bench.model_line("demo-100m", [results[0], (run(31.0, 17.0, None), 21.0)], 64, 64, load_before=1.0)
    assert "now" not in partial and "now_predicted_tokens_per_s" not in partial
