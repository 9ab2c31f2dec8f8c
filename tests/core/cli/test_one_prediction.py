"""Issue 14 item 12, through the user's commands: one machine profile gives one prediction and one 16-bit choice,
whichever command prints it. `hivekeeper plan --hardware auto` and `hivekeeper generate` (in this process, the
`cli` fixture) read the same saved profile: the same weight format and the same predicted decode tokens/s (the app
had shown plan's 13.2 beside generate's 41.8: generate planned with the detected estimates, not the profile); and a
profile whose whole bf16 decode steps measured slower than fp32 makes both pick fp32 on a CPU with native bf16
math (session 11: plans picked bf16, which then decoded at 14-16 tokens/s against fp32's 23.5)."""

from __future__ import annotations

import json

import pytest

from hivekeeper.core.machine import cpu_dtype
from hivekeeper.core.machine.detect import detect_hardware
from hivekeeper.core.machine.measurement import (BLOCK_OVERHEAD_KEY, HALF_DECODE_KEY, SMALL_ROWS_READS_KEY,
                                                 WEIGHT_STREAM_KEY, Measurement)
from hivekeeper.core.machine.profiles import new_profile, save_profile
from hivekeeper.core.runtime.demo_model import make_demo_checkpoint

BF16 = "sse2 avx avx2 fma avx512f avx512_bf16"  # native bf16 math (AVX512-BF16), as this project's VM has
NEW_TOKENS = 4


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    return make_demo_checkpoint(tmp_path_factory.mktemp("one-prediction") / "tiny-bf16", dtype="bf16", layers=3)


@pytest.fixture
def config_dir(tmp_path, monkeypatch):
    """A config folder of its own, read again by the 16-bit decision."""
    monkeypatch.setenv("HIVEKEEPER_CONFIG_DIR", str(tmp_path / "config"))
    cpu_dtype.forget()
    yield tmp_path / "config"
    cpu_dtype.forget()


def save_measured_profile(half_ratio: float | None, ram_gbps: float = 20.0, block_s: float = 40e-6) -> None:
    """A saved profile of this machine as `hivekeeper measure` leaves one (fed-in values, nothing timed): RAM and
    decode streaming at `ram_gbps`, a block's fixed cost `block_s`, and a whole bf16 decode step `half_ratio` x the
    fp32 one."""
    measurements = [Measurement("ram_read", "RAM read bandwidth", ram_gbps * 1e9, "B/s", 0.0, 3, 0.0),
                    Measurement(WEIGHT_STREAM_KEY, "decode weight streaming", ram_gbps * 1e9, "B/s", 0.0, 7, 0.0),
                    Measurement(BLOCK_OVERHEAD_KEY, "fixed cost of a block", block_s, "s", 0.0, 7, 0.0),
                    Measurement(SMALL_ROWS_READS_KEY, "weight reads of a 4-row step", 1.5, "x", 0.0, 7, 0.0)]
    if half_ratio is not None:
        measurements.append(Measurement(HALF_DECODE_KEY, "bf16 decode step / fp32 one", half_ratio, "x", 0.0, 7,
                                        0.0, "simulated"))
    profile = new_profile(detect_hardware())
    profile.measured_at = 1.7e9
    profile.measurements = measurements
    save_profile(profile)
    cpu_dtype.forget()


def generate_and_plan(cli, checkpoint) -> tuple[dict, dict]:
    """(`generate --json`, `plan --hardware auto --json` for the same prompt length and new tokens)."""
    made = cli("generate", "--model", str(checkpoint), "--prompt", "hello there", "--max-new-tokens",
               str(NEW_TOKENS), "--ignore-eos", "--json")
    assert made.returncode == 0, made.stderr
    generated = json.loads(made.stdout)
    planned = cli("plan", "--model", str(checkpoint), "--hardware", "auto", "--json", "--prompt-len",
                  str(generated["prompt_tokens"]), "--output-len", str(NEW_TOKENS))
    assert planned.returncode == 0, planned.stderr
    assert "measured it quickly" not in planned.stderr  # the saved profile was used, nothing was timed
    return generated, json.loads(planned.stdout)


@pytest.mark.parametrize("half_ratio, chosen", [(1.5, "fp32"), (0.6, "bf16")])
def test_plan_and_generate_pick_one_format_and_predict_one_speed(bf16_checkpoint, config_dir, cpu_flags, cli,
                                                                 half_ratio, chosen):
    cpu_flags(BF16)
    save_measured_profile(half_ratio)
    generated, planned = generate_and_plan(cli, bf16_checkpoint)
    assert planned["policy"]["weight_format"] == chosen
    assert generated["plan"]["policy"]["weight_format"] == chosen
    assert generated["plan"]["engine"]["dtype"] == {"fp32": "float32", "bf16": "bfloat16"}[chosen]
    predicted = generated["predicted_vs_measured"]["decode_tokens_per_s"]["predicted"]
    assert predicted == pytest.approx(planned["decode_tokens_per_s"], rel=1e-3)


def test_generate_predicts_from_the_profile_not_the_estimates(bf16_checkpoint, config_dir, cpu_flags, cli):
    """The same machine measured with a block's fixed cost 25x larger (what a tiny model's step is made of):
    generate's prediction follows the profile, as plan's does (before, generate's stayed at the detected estimate
    whatever was measured)."""
    cpu_flags(BF16)
    save_measured_profile(1.5)
    fast = generate_and_plan(cli, bf16_checkpoint)
    save_measured_profile(1.5, block_s=1e-3)
    slow = generate_and_plan(cli, bf16_checkpoint)
    speeds = [(generated["predicted_vs_measured"]["decode_tokens_per_s"]["predicted"],
               planned["decode_tokens_per_s"]) for generated, planned in (fast, slow)]
    assert speeds[1][0] == pytest.approx(speeds[1][1], rel=1e-3)
    assert speeds[1][0] < 0.5 * speeds[0][0]
