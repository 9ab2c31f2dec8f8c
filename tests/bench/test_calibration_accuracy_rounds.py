"""bench/calibration_accuracy.py's two evaluation rounds (issue 23, session 18): the models evaluated in turn twice
with the streaming rate read around each run (evaluate_rounds: the real engine on small demo checkpoints), each point
the mean of its rounds (pooled_rounds), and the host's own repeat error (repeat_errors: fed-in points). Nothing is
timed."""

from __future__ import annotations

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
