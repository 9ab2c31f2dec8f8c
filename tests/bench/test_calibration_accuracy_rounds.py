"""bench/calibration_accuracy.py's two evaluation rounds (issue 23, session 18): the models evaluated in turn twice
with the streaming rate read around each run (evaluate_rounds: the real engine on small demo checkpoints), each point
the mean of its rounds (pooled_rounds), the host's own repeat error (repeat_errors: fed-in points), and several runs
judged together (--summarize: fed-in result lines). Nothing is timed."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest


def point(prompt_len: int, batch: int, prefill_s: float, step_s: float | None, spread: float = 0.0):
    from hivekeeper.planner.calibration import ProfilePoint

    return ProfilePoint(prompt_len, 1 if step_s is None else 8, batch, prefill_s, step_s,
                        prefill_s + (0 if step_s is None else 7 * step_s), spread=spread, repeats=3, loadavg=1.0)


def test_each_point_is_the_mean_of_its_rounds(calibration_bench):
    first = [point(32, 1, 0.10, 0.020), point(32, 4, 0.30, None, spread=0.05)]
    second = [point(32, 4, 0.50, None, spread=0.01), point(32, 1, 0.14, 0.030)]
    pooled = {(pt.prompt_len, pt.batch_size): pt for pt in calibration_bench.pooled_rounds([first, second])}
    assert set(pooled) == {(32, 1), (32, 4)}
    one = pooled[(32, 1)]
    assert (one.prefill_s, one.step_s, one.repeats, one.output_len) == (pytest.approx(0.12), pytest.approx(0.025), 6, 8)
    assert one.runtime_s == pytest.approx((0.24 + 0.35) / 2)
    assert one.spread == pytest.approx(0.35 / 0.24 - 1)  # the rounds' runtimes apart, wider than either's repeats
    four = pooled[(32, 4)]
    assert four.step_s is None and four.prefill_s == pytest.approx(0.4) and four.spread == pytest.approx(0.5 / 0.3 - 1)


def test_the_hosts_repeat_error_is_the_later_round_predicted_by_the_earlier(calibration_bench):
    first = [point(32, 1, 0.10, 0.020), point(96, 1, 0.20, 0.020), point(32, 64, 1.0, 0.10)]
    second = [point(32, 1, 0.10, 0.025), point(96, 1, 0.25, 0.020), point(32, 64, 1.0, 0.10)]
    table = calibration_bench.repeat_errors(first, second)
    # decode tokens/s 50 "predicted" where 40 ran (25% off) and 50 where 50; prefill 320 where 320, 480 where 384
    assert table["b1"] == {"decode": {"repeat": 12.5}, "prefill": {"repeat": 12.5}}
    assert table["b64"] == {"decode": {"repeat": 0.0}, "prefill": {"repeat": 0.0}}
    both = {"thin": table, "wide": {"b1": {"decode": {"repeat": 30.0}, "prefill": {"repeat": 0.0}}}}
    assert calibration_bench.overall(both, "decode", "repeat") == pytest.approx((12.5 + 0.0 + 30.0) / 3, abs=0.05)
    assert calibration_bench.zip_rounds({"thin": ["t1", "t2"], "wide": ["w1", "w2"]}) == [
        {"thin": "t1", "wide": "w1"}, {"thin": "t2", "wide": "w2"}]


def test_the_models_run_in_turn_each_round_with_the_rate_read_around_every_run(calibration_bench, tmp_path):
    from hivekeeper.core.machine.profiling import ProfileGrid
    from hivekeeper.core.runtime.demo_model import DemoSpec, write_demo_checkpoint

    models = {}
    for name, layers in (("thin", 3), ("wide", 1)):
        models[name] = tmp_path / name
        write_demo_checkpoint(models[name], DemoSpec(layers=layers, hidden=64, intermediate=128, heads=2,
                                                     kv_heads=1, vocab=300, max_position=64))
    readings = iter(range(100))
    packed_calls = []
    grid = ProfileGrid((4, 8), (1, 3), (1, 2), repeats=1)
    done = calibration_bench.evaluate_rounds(models, [grid], lambda: float(next(readings)),
                                             lambda path: packed_calls.append(path) or {"round": len(packed_calls)})
    assert list(done.stages) == ["evaluate thin (1)", "evaluate wide (1)", "evaluate thin (2)", "evaluate wide (2)"]
    assert done.readings == {"thin": [0.0, 1.0, 4.0, 5.0], "wide": [2.0, 3.0, 6.0, 7.0]}
    # the packed row's runs after the thin (first) model's, each round
    assert packed_calls == [models["thin"]] * 2 and done.packed == [{"round": 1}, {"round": 2}]
    for name in models:
        assert len(done.rounds[name]) == 2 and set(done.policies[name]) == {"resident"}
        keys = [sorted(calibration_bench.point_key(pt) for pt in points) for points in done.rounds[name]]
        assert keys[0] == keys[1] and len(keys[0]) == 2 * 2 * 2  # every grid point in both rounds


def result_line(kind: str, thin_b1_decode: float, met: bool, packed: float | None) -> dict:
    """A result line as the bench prints it, cut to what summarize reads."""
    return {"bench": "calibration_accuracy", "machine": {"as": kind},
            "per_shape_time_ratio": {"thin": {"b1": {"decode": {"calibrated": thin_b1_decode, "uncalibrated": 1.0}}}},
            "default_model_packed_decode_tokens_per_s": {"uncalibrated_ratio": packed} if packed else {},
            "goals_met": {"decode_calibrated": met, "default_model": True},
            "host_repeat_mape_pct": {"decode": 10.0 if met else 20.0}}


def test_several_runs_give_each_cells_bias_and_scatter_and_each_goals_count(calibration_bench, tmp_path):
    """Session 18: --summarize judges runs together, each cell's geometric mean ratio (the model's bias) and the
    standard deviation of its log (the runs' scatter), per kind of machine; a file's last result line is the run's."""
    files = []
    for i, line in enumerate([result_line("this", 1.2, False, 1.1), result_line("this", 1.2 ** -1, True, 1.1 ** -1),
                              result_line("this", 1.0, True, None), result_line("avx2", 1.05, True, 1.0)]):
        files.append(tmp_path / f"run{i}.out")
        files[-1].write_text("progress on stderr\n" + json.dumps(line) + "\n")
    summary = calibration_bench.summarize([doc for f in files for doc in calibration_bench.results_of(str(f))])
    assert summary["summarized_runs"] == 4 and summary["runs_by_kind"] == {"avx2": 1, "this": 3}
    cell = summary["per_shape_bias"]["this"]["thin"]["b1"]["decode"]
    assert cell["calibrated"]["mean"] == pytest.approx(1.0) and cell["calibrated"]["runs"] == 3
    assert cell["calibrated"]["scatter_pct"] == pytest.approx(100 * math.log(1.2), abs=0.1)  # logs -a, a, 0: sd a
    assert cell["uncalibrated"] == {"mean": 1.0, "scatter_pct": 0.0, "runs": 3}
    assert summary["per_shape_bias"]["avx2"]["thin"]["b1"]["decode"]["calibrated"] == {
        "mean": 1.05, "scatter_pct": 0.0, "runs": 1}
    assert summary["default_model_bias"]["this"]["mean"] == pytest.approx(1.0) and \
        summary["default_model_bias"]["this"]["runs"] == 2  # the run without a default model row is left out
    assert summary["goals_met_runs"] == {"decode_calibrated": "3 of 4", "default_model": "4 of 4"}
    assert summary["host_repeat_mape_pct_median"] == {"decode": 10.0}


def test_a_file_without_a_result_line_is_named_and_exits_2(tmp_path):
    from ..child_output import run

    bench = Path(__file__).resolve().parents[2] / "bench" / "calibration_accuracy.py"
    empty = tmp_path / "progress.out"
    empty.write_text("evaluate thin [####] 100%\n")
    done = run([sys.executable, str(bench), "--summarize", str(empty)], timeout=120)
    assert done.returncode == 2 and str(empty) in done.stderr and "no calibration_accuracy result line" in done.stderr
    assert "Traceback" not in done.stderr
