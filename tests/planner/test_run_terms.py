"""Issue 22: a policy's predicted run written out term by term (costmodel.run_terms, bench/offload_throughput.py's
`terms`), and what-if predictions of what the engine would run (costmodel.evaluate_as_run, the Plan page's knobs)."""

from __future__ import annotations

import dataclasses

import pytest

from hivekeeper.planner.costmodel import (PACKED_KERNEL_ROWS, Placement, Policy, Workload, evaluate, evaluate_as_run,
                                          run_terms)
from hivekeeper.planner.efficiency import Efficiency, MachineEfficiency
from hivekeeper.planner.hardware import ComputeDevice, DiskSpec, HardwareSpec, NetworkSpec
from hivekeeper.planner.models import ModelSpec

MODEL = ModelSpec(name="bench-350mb", family="llama", num_layers=12, hidden_size=768, intermediate_size=2048,
                  num_heads=12, num_kv_heads=4, head_dim=64, vocab_size=8192, tie_word_embeddings=False,
                  max_position_embeddings=2048)
DISK = DiskSpec(capacity_bytes=100 * 10**9, read_bandwidth=1e9, write_bandwidth=0.5e9)
NET = NetworkSpec(upload_bps=1e9, download_bps=1e9, rtt_s=0.01)


def cpu(bf16_flops: float, half_decode_ratio: float | None = None) -> HardwareSpec:
    """A 2-core-like CPU machine with round numbers; bf16 at or above fp32 is native bf16 math."""
    device = ComputeDevice(kind="cpu", name="Test CPU", memory_bytes=8 * 10**9, memory_bandwidth=20e9,
                           flops={"fp32": 100e9, "bf16": bf16_flops}, power_watts=50.0,
                           half_decode_ratio=half_decode_ratio)
    return HardwareSpec(id="test-cpu", gpus=(), cpu=device, disk=DISK, network=NET)


EFF = MachineEfficiency(*(Efficiency(f"test-{kind}", matmul_fraction=1.0, bandwidth_fraction=0.5, link_fraction=1.0,
                                     disk_fraction=1.0, layer_overhead_s=0.2e-3, step_overhead_s=1e-3,
                                     runtime_bytes=10**8) for kind in ("acc", "host")))
# the bench's kind of plan: most blocks and the whole KV cache on disk, two micro-batches, loading the next block
# while computing
STREAMED = Policy("bf16", weights=Placement(0, 1 / 6, 5 / 6), kv_cache=Placement(0, 0, 1),
                  activations=Placement(0, 1, 0), micro_batch_size=128, num_micro_batches=2, prefetch_depth=1)


@pytest.mark.parametrize("prefetch", [0, 1])
def test_a_runs_terms_add_up_to_evaluates_prefill_step_and_runtime(prefetch):
    policy = dataclasses.replace(STREAMED, prefetch_depth=prefetch)
    workload = Workload(prompt_len=16, output_len=8)
    hardware = cpu(200e9)
    terms = run_terms(MODEL, hardware, policy, workload, EFF)
    prediction = evaluate(MODEL, hardware, policy, workload, EFF)
    assert terms["prefill"]["pass_s"] == pytest.approx(prediction.prefill_s, rel=1e-9)
    assert terms["decode_step"]["pass_s"] == pytest.approx(prediction.decode_step_s, rel=1e-9)
    assert terms["decode_steps"] == 7 and terms["runtime_s"] == pytest.approx(prediction.runtime_s, rel=1e-9)
    for phase in ("prefill", "decode_step"):
        t = terms[phase]
        chain = t["blocks_reads_s"] + t["blocks_compute_s"] + t["blocks_fixed_s"] + t["cpu_attention_s"]
        transfers = t["disk_s"] + t["host_link_s"]
        # depth 0 reads, then computes; depth 1 overlaps the next block's reads with this block's compute
        assert t["blocks_s"] == pytest.approx(chain + transfers if prefetch == 0 else max(chain, transfers), rel=1e-9)
        assert t["pass_s"] >= t["blocks_s"] + t["head_reads_s"] + t["head_compute_s"] + t["step_overhead_s"] - 1e-12
        assert t["disk_s"] > 0  # the streamed blocks (and the disk cache) are read every pass


def test_the_blocks_compute_follows_the_cpus_bf16_rate():
    workload = Workload(prompt_len=16, output_len=8)
    slow, fast = (run_terms(MODEL, cpu(rate), STREAMED, workload, EFF) for rate in (100e9, 200e9))
    for phase in ("prefill", "decode_step"):
        assert slow[phase]["blocks_compute_s"] == pytest.approx(2 * fast[phase]["blocks_compute_s"], rel=1e-9)
        assert slow[phase]["disk_s"] == pytest.approx(fast[phase]["disk_s"], rel=1e-9)


@pytest.mark.parametrize("ratio", [None, 1.7])
def test_a_batch_plan_run_in_few_rows_is_predicted_in_the_fp32_the_engine_runs_and_says_so(ratio):
    """The bf16 batch plan (128 rows a micro-batch) run on 3 prompts: the engine computes those 3-row steps in fp32."""
    hardware, workload = cpu(200e9, ratio), Workload(prompt_len=16, output_len=8)
    few = dataclasses.replace(STREAMED, micro_batch_size=3, num_micro_batches=1)
    shown = evaluate_as_run(MODEL, hardware, few, workload, EFF, planned_rows=STREAMED.micro_batch_size)
    fp32 = evaluate(MODEL, hardware, dataclasses.replace(few, weight_format="fp32"), workload, EFF)
    assert shown.policy.weight_format == "fp32" and shown.throughput_tokens_per_s == fp32.throughput_tokens_per_s
    assert shown.peak_memory_bytes == fp32.peak_memory_bytes  # fp32's bytes in every tier
    assert shown.throughput_tokens_per_s != pytest.approx(evaluate(MODEL, hardware, few, workload, EFF)
                                                          .throughput_tokens_per_s, rel=1e-3)
    assert shown.engine_note.startswith("Computed in fp32, as the engine runs this bf16 plan: its micro-batches "
                                        f"multiply 3 rows, at most the native decode kernels' {PACKED_KERNEL_ROWS}")
    assert shown.engine_note.endswith("(the plan was made for 128 rows)")
    assert shown.bottleneck_detail.startswith(shown.engine_note)


@pytest.mark.parametrize("ratio", [None, 1.7])
def test_a_few_row_bf16_what_if_is_its_own_plan_and_runs_in_bf16(ratio):
    """The Plan page's knobs set to bf16 at 3 rows: a plan made for 3 rows, which the engine computes in bf16 (the
    planner names it where fp32 would be slower, e.g. streamed from disk), priced at the bf16 step."""
    hardware, workload = cpu(200e9, ratio), Workload(prompt_len=16, output_len=8)
    few = dataclasses.replace(STREAMED, micro_batch_size=3, num_micro_batches=1)
    shown = evaluate_as_run(MODEL, hardware, few, workload, EFF)
    assert shown == evaluate(MODEL, hardware, few, workload, EFF) and shown.engine_note == ""


def test_what_the_engine_runs_as_named_is_evaluated_as_named():
    workload = Workload(prompt_len=16, output_len=8)
    many = evaluate_as_run(MODEL, cpu(200e9, 1.7), STREAMED, workload, EFF)  # 128 rows: bf16 on native bf16 math
    assert many == evaluate(MODEL, cpu(200e9, 1.7), STREAMED, workload, EFF) and many.engine_note == ""
    few = dataclasses.replace(STREAMED, micro_batch_size=3, num_micro_batches=1)
    faster = evaluate_as_run(MODEL, cpu(200e9, 0.6), few, workload, EFF)  # a bf16 step measured faster: bf16
    assert faster.policy.weight_format == "bf16" and faster.engine_note == ""
    converting = evaluate_as_run(MODEL, cpu(50e9), STREAMED, workload, EFF)  # no native bf16 math: fp32 at any rows
    assert converting.policy.weight_format == "fp32"
    assert converting.engine_note.endswith("this CPU multiplies no bf16 natively")

