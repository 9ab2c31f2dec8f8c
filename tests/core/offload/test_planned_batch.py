"""The batch the planner picks under a RAM budget is the batch the engine runs (issue 22 item 1). On a CPU the planner
counts a step's memory with the engine's placement's own rules (costmodel.cpu_step_activation_bytes, the disk-tier
block's cache mapped in for its turn, a 16-bit plan's transients) and plans a 16-bit format only where the CPU
computes one. Until session 12 it took a block's larger phase where the engine sums them, and planned fp16 (2 bytes a
weight) on CPUs that run 16-bit plans in fp32: at the offload bench's budget it chose batch 512 (or 256 in fp16) and
`generate` refused it, so the bench halved the batch until the engine accepted.

The sweep places plans without loading weights (a config-only folder of the bench's ~350 MB shape); one plan runs
through `hivekeeper generate --batch B --ram-budget-gb X` (its main(), in this process: the `cli` fixture; the
bench runs the same command as a child at the planner's batch).
"""

from __future__ import annotations

import json

import pytest
import torch

from hivekeeper.core.offload.local_plan import PolicyChoice, engine_plan, with_ram_budget
from hivekeeper.core.runtime.demo_model import DemoSpec, model_config
from hivekeeper.core.runtime.model import ModelConfig
from hivekeeper.planner.costmodel import Workload
from hivekeeper.planner.model_catalog import load_model_spec
from hivekeeper.planner.policy import Constraints, search

BENCH_SHAPE = dict(layers=12, hidden=768, intermediate=2048, heads=12, kv_heads=4, vocab=8192)  # offload_throughput


def planners_batch_policy(path, budget: int, prompt_len: int, new_tokens: int):
    """The planner's throughput policy (goal batch, the batch searched) for this machine with this RAM budget, as
    bench/offload_throughput.py asks for it; None where it finds none."""
    from hivekeeper.core.machine.detect import detect_hardware

    plan = search(load_model_spec(str(path)), with_ram_budget(detect_hardware(), budget), "batch",
                  Constraints(quant="none"), Workload(prompt_len=prompt_len, output_len=new_tokens))
    return None if plan.prediction is None else plan.prediction.policy


@pytest.fixture(scope="module")
def bench_shape(tmp_path_factory):
    """A folder holding only the config.json of the bench's ~350 MB demo model (placement reads no weights)."""
    folder = tmp_path_factory.mktemp("bench-shape")
    (folder / "config.json").write_text(json.dumps(model_config(DemoSpec(**BENCH_SHAPE).resolved())))
    return folder


@pytest.mark.parametrize("native_bf16", [True, False])
def test_every_batch_plan_under_a_budget_is_placed_within_it(bench_shape, bf16_measured_cpu, native_bf16):
    bf16_measured_cpu(native_bf16)  # bf16 measured faster; with native bf16 math the engine then computes bf16
    config = ModelConfig.from_folder(bench_shape)
    weights = config.num_layers * config.block_param_count() * 4  # the fp32 blocks
    batches = []
    for prompt_len, new_tokens in ((16, 8), (200, 50)):
        for fraction in (0.25, 0.5, 0.75, 1.0, 1.5):
            budget = int(fraction * weights)
            policy = planners_batch_policy(bench_shape, budget, prompt_len, new_tokens)
            if policy is None:  # the planner says it does not fit (fp32 at a quarter of the weights)
                continue
            plan = engine_plan(config, PolicyChoice(policy, "auto", ""), batch=policy.batch_size,
                               max_length=prompt_len + new_tokens, ram_budget_bytes=budget,
                               prefill_tokens=min(256, prompt_len), device="cpu", model_path=bench_shape)
            assert plan.ram_bytes <= budget, (fraction, prompt_len, policy.as_dict(), plan.ram_breakdown)
            assert plan.dtype == (torch.bfloat16 if native_bf16 else torch.float32)
            assert policy.weight_format == ("bf16" if native_bf16 else "fp32")  # what the engine computes
            batches.append(policy.batch_size)
    assert len(batches) >= 8 and max(batches) >= 256  # the sweep reaches the batches the engine used to refuse


def test_generate_runs_the_planners_batch_within_the_budget(tiny_checkpoint, cpu_flags, tmp_path, monkeypatch, cli):
    """Through the user's command: the planner's batch for a budget under the model's size, given to `generate`
    with that budget, is placed (blocks streamed from disk) and run at that batch, within the budget."""
    cpu_flags("sse2 avx avx2 fma")  # no native 16-bit math: fp32 (a child process inherits the pinned flags)
    monkeypatch.setenv("HIVEKEEPER_CONFIG_DIR", str(tmp_path / "config"))  # no saved profile
    config = ModelConfig.from_folder(tiny_checkpoint)
    # the fp32 embedding, head and blocks: with the activations and KV cache on top, blocks must stream
    budget = (config.num_layers * config.block_param_count() + 2 * config.vocab_size * config.hidden_size) * 4
    policy = planners_batch_policy(tiny_checkpoint, budget, 8, 4)
    assert policy is not None and policy.batch_size > 1
    result = cli("generate", "--model", str(tiny_checkpoint), "--prompt", "Hello there", "--batch",
                 str(policy.batch_size), "--max-new-tokens", "4", "--ignore-eos", "--json",
                 "--ram-budget-gb", f"{budget / 1e9:.9f}", "--no-measure")  # planned as above: from estimates
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    engine = report["plan"]["engine"]
    assert report["batch"] == policy.batch_size
    assert engine["micro_batch_size"] * engine["num_micro_batches"] >= policy.batch_size
    assert engine["blocks"].get("disk", 0) >= 1 and engine["ram_bytes"] <= budget
    # the engine's own timings of its block passes (the offload bench writes the plan's terms beside them): one
    # prefill pass, one pass per later token, each waiting for its streamed blocks; compute is the rest
    stages = report["stage_seconds"]
    assert stages["prefill"]["passes"] == 1 and stages["decode"]["passes"] == report["steps"] - 1
    for phase in stages.values():
        assert phase["waiting_for_reads_s"] > 0 and 0 < phase["compute_s"] < phase["blocks_s"]
        assert phase["compute_s"] == pytest.approx(phase["blocks_s"] - phase["waiting_for_reads_s"]
                                                   - phase["kv_cache_s"], abs=2e-6)
    assert stages["prefill"]["blocks_s"] + stages["decode"]["blocks_s"] < report["total_s"]
