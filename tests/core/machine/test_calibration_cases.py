"""Issue 23: the calibration procedure picks the right terms on every kind of machine, with the second kind
simulated (pinned CPU flags, the kernels switched off). No timing is asserted: what the real benchmark runs through
is checked by its own description, and measurement records of each kind go through the real fit, profile and cost
model."""

from __future__ import annotations

import pytest

from hivekeeper.core.machine import measure
from hivekeeper.core.machine.measure import fit_bytes_and_blocks, measure_decode_blocks
from hivekeeper.core.machine.measurement import (BLOCK_OVERHEAD_KEY, HALF_DECODE_KEY, Measurement, PACKED_KERNEL_KEY,
                                                 SMALL_ROWS_READS_KEY, WEIGHT_STREAM_KEY)
from hivekeeper.core.machine.profiles import apply_measurements
from hivekeeper.planner.calibration import measured_efficiency
from hivekeeper.planner.costmodel import Placement, Policy, Workload, evaluate, model_numbers
from hivekeeper.planner.hardware_catalog import get_hardware
from hivekeeper.planner.models import ModelSpec

# SmolLM2-135M's shape (30 thin blocks) and a wide, few-layer model of about the same weights
THIN = ModelSpec("thin", "llama", 30, 576, 1536, 9, 3, 64, 49152, True, 2048)
WIDE = ModelSpec("wide", "llama", 3, 2048, 5632, 32, 8, 64, 8192, False, 2048)
RAM = 34e9


def records(stream: float, block_s: float, reads: float) -> list[Measurement]:
    """What `hivekeeper measure` saves on one kind of machine (RAM read, fp32 matmul, decode steps)."""
    return [Measurement("ram_read", "RAM read", RAM, "B/s", 0.0, 3, 0.0),
            Measurement("cpu_matmul_fp32_prefill", "fp32 matmul", 100e9, "FLOP/s", 0.0, 3, 0.0),
            Measurement(WEIGHT_STREAM_KEY, "decode weight streaming", stream, "B/s", 0.0, 3, 0.0),
            Measurement(BLOCK_OVERHEAD_KEY, "fixed cost of a block", block_s, "s", 0.0, 3, 0.0),
            Measurement(SMALL_ROWS_READS_KEY, "4-row reads", reads, "x", 0.0, 3, 0.0)]


# the machine issue 23 came from (AVX512-BF16, the native kernels: a small per-block cost, decode near the RAM
# rate) and the kind the portable/numpy path gives (HIVEKEEPER_NATIVE=0: a larger per-block cost, a lower rate)
KINDS = {"native-avx512": records(30e9, 0.02e-3, 1.8), "numpy": records(20e9, 0.6e-3, 3.0)}


def step_seconds(model: ModelSpec, hardware, batch: int = 1) -> float:
    ram = Placement(gpu=0.0, cpu=1.0, disk=0.0)
    policy = Policy(weight_format="fp32", weights=ram, kv_cache=ram, activations=ram, micro_batch_size=batch)
    prediction = evaluate(model, hardware, policy, Workload(prompt_len=8, output_len=8), measured_efficiency(hardware))
    return 1.0 / prediction.decode_tokens_per_s * batch


def test_the_fit_recovers_bandwidth_and_per_block_cost_and_refuses_noise():
    bandwidth, per_block = 30e9, 0.15e-3
    wide, narrow = (450e6, 5), (440e6, 36)
    runs = [(b / bandwidth + n * per_block, b, n) for b, n in (wide, narrow)]
    got_block, got_bandwidth = fit_bytes_and_blocks(*runs)
    assert got_block == pytest.approx(per_block, rel=1e-9) and got_bandwidth == pytest.approx(bandwidth, rel=1e-9)
    # the many-block span faster per byte than the few-block one (noise): no per-block cost, the faster rate
    noisy = [(0.016, 450e6, 5), (0.012, 440e6, 36)]
    assert fit_bytes_and_blocks(*noisy) == (0.0, pytest.approx(440e6 / 0.012))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_each_kind_of_machine_gets_its_measured_terms(kind):
    by_key = {m.key: m for m in KINDS[kind]}
    hardware = apply_measurements(get_hardware("cpu-generic"), KINDS[kind], when=1.7e9)
    eff = measured_efficiency(hardware).accelerator
    assert eff.bandwidth_fraction == pytest.approx(by_key[WEIGHT_STREAM_KEY].value / RAM)
    assert eff.layer_overhead_s == pytest.approx(by_key[BLOCK_OVERHEAD_KEY].value)  # not the 0.2 ms default
    assert eff.weight_reread_rows == pytest.approx(by_key[SMALL_ROWS_READS_KEY].value)
    # a one-row step: the weights at the measured decode rate plus each block's measured cost; its FLOPs ran
    # inside the measured steps, so they add nothing while the reads outlast them
    for model in (THIN, WIDE):
        numbers = model_numbers(model)
        weights = model.num_layers * (numbers.matrix_params + numbers.vector_params) + numbers.head_params
        reads = weights * 4 / by_key[WEIGHT_STREAM_KEY].value
        blocks = model.num_layers * by_key[BLOCK_OVERHEAD_KEY].value
        assert step_seconds(model, hardware) == pytest.approx(reads + blocks, rel=0.15)


def test_thin_many_layer_models_pay_the_per_block_cost_that_the_kind_of_kernels_sets():
    native, numpy_path = (apply_measurements(get_hardware("cpu-generic"), KINDS[k], when=1.7e9)
                          for k in ("native-avx512", "numpy"))
    # same bytes per step, ten times the blocks: the numpy path's per-block cost shows on the thin model
    thin_ratio = step_seconds(THIN, numpy_path) / step_seconds(THIN, native)
    wide_ratio = step_seconds(WIDE, numpy_path) / step_seconds(WIDE, native)
    assert thin_ratio > wide_ratio * 1.2 and wide_ratio == pytest.approx(1.5, rel=0.1)  # 30 / 20 GB/s
    # a four-row step reads the weights as often as the kind measured
    assert step_seconds(WIDE, numpy_path, batch=4) > step_seconds(WIDE, native, batch=4) * 1.5


def test_a_profile_of_before_issue_23_keeps_its_per_matmul_start_up():
    old = [m for m in KINDS["numpy"] if m.key != BLOCK_OVERHEAD_KEY]
    old.append(Measurement("cpu_matmul_start", "start-up", 0.1e-3, "s", 0.0, 3, 0.0))
    hardware = apply_measurements(get_hardware("cpu-generic"), old, when=1.7e9)
    assert hardware.cpu.decode_streaming.block_overhead_s is None
    assert measured_efficiency(hardware).accelerator.layer_overhead_s == pytest.approx(0.2e-3 + 4 * 0.1e-3)


@pytest.mark.parametrize("native", ["0", "portable"])
def test_the_decode_benchmark_runs_the_path_the_runtime_takes(cpu_flags, monkeypatch, native):
    """The second kind of machine simulated: a CPU without AVX2 pinned, or the kernels switched off. The benchmark
    times whatever the runtime's decode step runs there, and says which."""
    from hivekeeper.core.runtime.kernels import native_kernels

    cpu_flags("sse2 sse4_2" if native == "portable" else "sse2 avx avx2 fma avx512f avx512_bf16")
    monkeypatch.setenv("HIVEKEEPER_NATIVE", native)
    native_kernels.forget()
    try:
        results = {m.key: m for m in measure_decode_blocks(256, 2 << 20, repeats=1, cache_bytes=0)}
    finally:
        monkeypatch.delenv("HIVEKEEPER_NATIVE")
        native_kernels.forget()
    detail = results[WEIGHT_STREAM_KEY].detail
    if native == "0":
        assert "through numpy" in detail
    else:
        assert "portable" in detail or "through numpy" in detail  # portable C where a compiler is found
    assert results[WEIGHT_STREAM_KEY].value > 0 and results[BLOCK_OVERHEAD_KEY].value >= 0
    assert results[SMALL_ROWS_READS_KEY].value > 0 and "blocks of width 256" in detail


def test_the_spans_exceed_twice_the_last_level_cache(monkeypatch):
    monkeypatch.setattr(measure, "last_level_cache_bytes", lambda: 1 << 20)
    results = {m.key: m for m in measure_decode_blocks(256, 1 << 19, repeats=1)}
    assert "last-level cache 1 MiB" in results[WEIGHT_STREAM_KEY].detail and "(2 MiB)" in results[WEIGHT_STREAM_KEY].detail
    config, span = measure.decode_span(256, 6 << 20)
    block = config.block_param_count() * 4  # whole blocks: the nearest count to the size asked
    assert abs(sum(p.numel() * 4 for p in span.parameters()) - (6 << 20)) <= block / 2 + 4096
    assert config.num_layers == len(span.blocks) == 2


def test_the_bf16_against_fp32_step_reads_beyond_twice_the_cache_too(monkeypatch, cpu_flags):
    """Issue 23: --quick's 64 MiB chain sat in a 105 MiB L3, where torch's bf16 kept up with the fp32 kernels, and
    16-bit plans then ran in bf16 at a fraction of the fp32 speed from RAM."""
    import dataclasses

    cpu_flags("sse2 avx avx2 fma avx512f avx512_bf16")
    asked = []
    monkeypatch.setattr(measure, "measure_half_decode", lambda hidden, nbytes, repeats, wide: asked.append(nbytes) or
                        Measurement(HALF_DECODE_KEY, "bf16 / fp32", 1.5, "x", 0.0, 1, 0.0))
    sizes = dataclasses.replace(measure.TINY, cache_bytes=2 << 20, half_bytes=1 << 20, dtypes=())
    assert HALF_DECODE_KEY in {m.key for m in measure.run_benchmarks(sizes, gpu=False)} and asked == [4 << 20]


def test_decode_steps_faster_than_the_ram_sum_raise_the_ram_bandwidth():
    """A shared machine: the sum() caught a busy moment (0.76 GB/s) and the decode steps did not (7.3 GB/s). The
    RAM delivered what the steps read, so decode is planned at the steps' rate, and the source says why."""
    busy = records(7.3e9, 0.1e-3, 2.0)
    busy[0] = Measurement("ram_read", "RAM read", 0.76e9, "B/s", 0.0, 3, 15.0)
    hardware = apply_measurements(get_hardware("cpu-generic"), busy, when=1.7e9)
    assert hardware.cpu.memory_bandwidth == pytest.approx(7.3e9, rel=1e-6)
    assert "raised to the 7.3 GB/s" in hardware.cpu.sources["memory_bandwidth"]
    assert measured_efficiency(hardware).accelerator.bandwidth_fraction == pytest.approx(1.0)
    # a sum() faster than the steps stays as it is
    calm = apply_measurements(get_hardware("cpu-generic"), KINDS["numpy"], when=1.7e9)
    assert calm.cpu.memory_bandwidth == pytest.approx(RAM) and "raised" not in calm.cpu.sources["memory_bandwidth"]


def test_a_packed_thin_model_pays_each_blocks_measured_cost_beside_its_kernels():
    """The default model as `generate` runs it (Q4_1 packed, 30 thin blocks): a one-row step is the kernels'
    compute (slower than reading the packed bytes at these rates), plus the measured fixed cost of each block, plus
    the packed Q8_0 head. Two machines that differ only in that fixed cost: the thin model pays the difference 10x
    as often as the wide one (30 blocks against 3)."""
    kernel_rate = 10e9
    kernels = Measurement(f"{PACKED_KERNEL_KEY}q4_1", "q4_1 kernel", kernel_rate, "weights/s", 0.0, 3, 0.0)
    ram = Placement(gpu=0.0, cpu=1.0, disk=0.0)
    policy = Policy(weight_format="q4_1", weights=ram, kv_cache=ram, activations=ram, micro_batch_size=1)
    steps = {}
    for block_s in (0.02e-3, 0.6e-3):
        hardware = apply_measurements(get_hardware("cpu-generic"), [*records(30e9, block_s, 2.0), kernels],
                                      when=1.7e9)
        for model in (THIN, WIDE):
            numbers = model_numbers(model)
            compute = model.num_layers * numbers.matrix_params / kernel_rate
            blocks = model.num_layers * block_s
            prediction = evaluate(model, hardware, policy, Workload(prompt_len=8, output_len=8),
                                  measured_efficiency(hardware))
            steps[block_s, model.name] = 1.0 / prediction.decode_tokens_per_s
            head = numbers.head_params / kernel_rate  # the head's q8_0 kernels, at about the same rate
            assert compute + blocks < steps[block_s, model.name] <= compute + blocks + 2 * head
    extra = {model: steps[0.6e-3, model] - steps[0.02e-3, model] for model in ("thin", "wide")}
    assert extra["thin"] == pytest.approx(30 * 0.58e-3, rel=1e-3)
    assert extra["wide"] == pytest.approx(3 * 0.58e-3, rel=1e-3)
