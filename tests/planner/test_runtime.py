"""Idealized runtime α + β(o − 1), energy and cost, and their link to a plan's prediction."""

from __future__ import annotations

import dataclasses

import pytest

from hivekeeper.planner.costmodel import Workload
from hivekeeper.planner.errors import InputError
from hivekeeper.planner.hardware_catalog import get_hardware
from hivekeeper.planner.model_catalog import get_model
from hivekeeper.planner.policy import search
from hivekeeper.planner.runtime import idealized_runtime


def test_runtime_energy_and_cost_by_hand():
    estimate = idealized_runtime(alpha_s=0.5, beta_s=0.02, prompt_len=256, output_len=101, batch_size=4,
                                 power_watts=400.0, price_per_hour=3.6)
    assert estimate.runtime_s == pytest.approx(0.5 + 0.02 * 100)  # 2.5 s for the batch
    assert estimate.energy_j == pytest.approx(400 * 2.5 / 4)  # a quarter of the run's 1000 J
    assert estimate.energy_j_per_1k_tokens == pytest.approx(1000 * 1000 / (4 * 101))
    assert estimate.cost_usd == pytest.approx(3.6 * 2.5 / 3600 / 4)
    assert estimate.cost_usd_per_1k_tokens == pytest.approx(1000 * 3.6 * 2.5 / 3600 / 404)


def test_one_output_token_is_just_the_prefill_and_no_price_no_cost():
    estimate = idealized_runtime(alpha_s=0.084, beta_s=0.081, prompt_len=1, output_len=1)
    assert estimate.runtime_s == pytest.approx(0.084)
    assert estimate.cost_usd is None and estimate.cost_usd_per_1k_tokens is None
    with pytest.raises(InputError):
        idealized_runtime(alpha_s=-1.0, beta_s=0.0, prompt_len=1, output_len=1)
    with pytest.raises(InputError):
        idealized_runtime(alpha_s=1.0, beta_s=0.0, prompt_len=1, output_len=0)


def test_plan_runtime_is_alpha_plus_beta_and_grows_with_the_prompt():
    model = get_model("meta-llama/Meta-Llama-3.1-8B-Instruct")
    hardware = dataclasses.replace(get_hardware("h100-sxm"), price_per_hour=2.0)
    short = search(model, hardware, "chat", workload=Workload(prompt_len=1, output_len=128))
    long = search(model, hardware, "chat", workload=Workload(prompt_len=1920, output_len=128))
    for plan in (short, long):
        r, p = plan.runtime, plan.prediction
        assert r.alpha_s == p.prefill_s and r.beta_s == p.decode_step_s
        assert r.runtime_s == pytest.approx(p.prefill_s + 127 * p.decode_step_s)
        assert r.power_watts == hardware.gpus[0].power_watts + hardware.cpu.power_watts
        assert r.energy_j == pytest.approx(r.power_watts * r.runtime_s)
        assert r.cost_usd == pytest.approx(2.0 * r.runtime_s / 3600)
    # α grows with the prompt (prefill FLOPs), β with the context the decode attends to
    assert long.runtime.alpha_s > 5 * short.runtime.alpha_s
    assert long.runtime.beta_s > short.runtime.beta_s
