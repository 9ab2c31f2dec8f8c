"""`hivekeeper measure`'s benchmark of the packed formats (issue 16 item 3, issue 23): one rate per format, timed
through one-row decode steps of a span of random packed blocks (the runtime's own whole-span path, caches cold
between blocks), and a packed block's fixed cost fitted beside it on a narrower span (session 14), saved in the
profile, and the planner's decode prediction follows them. Nothing is timed against a
goal: the tests check what is measured, where it goes and what the planner does with it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from hivekeeper.core.machine import measure
from hivekeeper.core.machine.measure import (PREFILL_REPEATS, STEP_REPEATS, format_bytes, measure_packed_kernels,
                                             median_and_spread, narrow_width, packed_block_overhead,
                                             packed_kernel_seconds, packed_span, random_packed_matrix)
from hivekeeper.core.machine.measurement import (BLOCK_OVERHEAD_KEY, PACKED_BLOCK_KEY, PACKED_CACHED_KEY,
                                                 PACKED_KERNEL_KEY, PACKED_PREFILL_KEY, PACKED_ROWS_KEY, SMALL_ROWS_READS_KEY,
                                                 WEIGHT_STREAM_KEY, WEIGHTS_PER_S, Measurement)
from hivekeeper.core.machine.profiles import (apply_measurements, comparison_rows, packed_block_cost,
                                              packed_kernel_rates)
from hivekeeper.planner.calibration import measured_efficiency
from hivekeeper.planner.costmodel import Placement, Policy, Workload, decode_step_terms, evaluate, model_numbers
from hivekeeper.planner.errors import InputError
from hivekeeper.planner.formats import PACKED_FORMATS
from hivekeeper.planner.hardware import PACKED_ROW_COUNTS, ComputeDevice, DiskSpec, HardwareSpec, NetworkSpec
from hivekeeper.planner.hardware_catalog import get_hardware
from hivekeeper.planner.models import ModelSpec

SMALL = (64, 256)  # a matrix small enough for a test
# a few blocks of the benchmark's spans (the streamed ones narrower, as QUICK's 576 against its cached 768)
TINY_SPAN = dict(hidden=128, total_bytes=64 << 10, cache_bytes=1 << 20, stream_hidden=96)


@pytest.mark.parametrize("fmt", PACKED_FORMATS)
def test_the_benchmarks_random_matrix_is_a_valid_packed_weight(fmt):
    """Its product on the kernels is the dequantized weights' product within the activations' rounding: the
    benchmark multiplies real blocks (finite scales), as a model's decode does; so does a span's one-byte fill."""
    from hivekeeper.core.runtime.kernels.quant_kernels import activation_error_bound

    filled = np.empty(int(SMALL[0] * SMALL[1] * format_bytes(fmt)), dtype=np.uint8)
    for matrix in (random_packed_matrix(fmt, *SMALL), random_packed_matrix(fmt, *SMALL, out=filled)):
        weights = matrix.dequantize()
        assert np.isfinite(weights).all() and np.abs(weights).max() > 0
        x = np.random.default_rng(3).standard_normal(SMALL[1]).astype(np.float32)
        bound = activation_error_bound(weights, x)
        assert np.all(np.abs(matrix.matvec(x) - weights @ x) <= bound + 1e-4 * (1 + np.abs(weights @ x)))


def test_one_rate_per_format_from_whole_packed_decode_steps(monkeypatch):
    """Each format's span is packed blocks in one buffer, its step runs as one native call over the whole span (as
    a loaded GGUF's does), and the formats' steps alternate (a busy spell on a shared machine hits all alike)."""
    from hivekeeper.core.runtime.kernels import cpu_decode

    native, real_blocks = [], cpu_decode.decode_blocks
    monkeypatch.setattr(cpu_decode, "decode_blocks",
                        lambda *a, **k: native.append(real_blocks(*a, **k)) or native[-1])
    order, real_steps = [], measure.decode_steps

    def recorded(config, span, rows):
        step, fmt = real_steps(config, span, rows), span.blocks[0].mlp.down_proj.fmt.name
        return lambda: order.append(fmt) or step()

    monkeypatch.setattr(measure, "decode_steps", recorded)
    spans, real_span = [], measure.packed_span
    monkeypatch.setattr(measure, "packed_span", lambda *a: spans.append(real_span(*a)) or spans[-1])
    results = measure_packed_kernels(repeats=2, **TINY_SPAN)
    assert [m.key for m in results] == [*(f"{key}{name}" for key in (PACKED_CACHED_KEY, PACKED_KERNEL_KEY)
                                          for name in PACKED_FORMATS), PACKED_BLOCK_KEY,
                                        *(f"{PACKED_ROWS_KEY}{name}x{rows}" for name in PACKED_FORMATS
                                          for rows in PACKED_ROW_COUNTS),
                                        *(f"{PACKED_PREFILL_KEY}{name}" for name in PACKED_FORMATS)]
    for m in results:
        if m.key.startswith(PACKED_ROWS_KEY):  # the streamed span's few-row steps over its one-row ones
            assert m.unit == "x" and m.value >= 1 and len(m.samples) == STEP_REPEATS and min(m.samples) >= 1
            assert "blocks of width" not in m.detail and "of the streamed span" in m.detail
            continue
        if m.key == PACKED_BLOCK_KEY:  # seconds: the median of the formats' fits, each from both widths
            assert m.unit == "s" and m.value >= 0 and len(m.samples) == len(PACKED_FORMATS)
            assert m.value == pytest.approx(median_and_spread(m.samples)[0])
            assert "widths 128 and 64" in m.detail and "weights / rate + blocks x cost" in m.detail
            continue
        repeats = PREFILL_REPEATS if m.key.startswith(PACKED_PREFILL_KEY) else STEP_REPEATS
        assert m.unit == WEIGHTS_PER_S and m.value > 0 and m.repeats == len(m.samples) == repeats
        # the median repeat's rate (the machine's typical speed, not its luckiest instant), with the range
        assert (m.value, m.spread) == pytest.approx(median_and_spread(m.samples))
        width = 96 if m.key.startswith(PACKED_KERNEL_KEY) else 128
        assert f"blocks of width {width}" in m.detail and "in turn" in m.detail and "median" in m.detail
    # the cached spans (both widths) a third of the last-level cache, the streamed ones (a thin model's width) at
    # least twice it, in one buffer the three formats share (each from its start: a third of the memory)
    cache = TINY_SPAN["cache_bytes"]
    packed = [weights * format_bytes(fmt) for (_, _, weights), fmt in zip(spans, PACKED_FORMATS * 3)]
    assert all(size < cache / 2 for size in packed[:3] + packed[6:]) and all(size >= 2 * cache for size in packed[3:6])
    assert [config.hidden_size for config, _, _ in spans] == [128] * 3 + [96] * 3 + [64] * 3
    first = [span.blocks[0].self_attn.qkv_proj.packed.data_ptr() for _, span, _ in spans]
    assert len(set(first[3:6])) == 1 and len(set(first[:3] + first[6:] + first[3:4])) == 7
    assert all(narrow[0].num_layers > wide[0].num_layers for wide, narrow in zip(spans[:3], spans[6:]))
    if measure.native_kernels.library() is not None:
        assert native and all(out is not None for out in native)  # the kernels' whole-span step, every time
    switches = sum(1 for a, b in zip(order, order[1:]) if a != b)
    assert set(order) == set(PACKED_FORMATS) and switches >= 2 * len(PACKED_FORMATS) * STEP_REPEATS - 1
    # only the cached spans (streamed=False), fewer timings
    quick = measure_packed_kernels(repeats=2, **TINY_SPAN, streamed=False, step_repeats=3)
    assert [m.key for m in quick] == [*(f"{PACKED_CACHED_KEY}{name}" for name in PACKED_FORMATS), PACKED_BLOCK_KEY,
                                      *(f"{PACKED_PREFILL_KEY}{name}" for name in PACKED_FORMATS)]
    assert all(m.repeats == (PREFILL_REPEATS if m.key.startswith(PACKED_PREFILL_KEY) else 3)
               for m in quick if m.key != PACKED_BLOCK_KEY)


def test_the_rates_and_a_packed_blocks_cost_are_fitted_to_the_packed_spans_alone(monkeypatch):
    """Session 14 (issue 23): steps timed as weights / rate + blocks x cost give back each format's rate (cached and
    streamed) and the median of the formats' costs, whatever the fp32 spans' cost (no longer an input: 0.3 ms a block subtracted from a 768-wide
    packed span of ~0.26 ms a block left the 25% floor, a rate 4x too high)."""
    rate = {"q8_0": 20e9, "q4_0": 30e9, "q4_1": 25e9}
    cost = {"q8_0": 1.5e-6, "q4_0": 2e-6, "q4_1": 2.5e-6}  # the tiny spans: ~7-9 us of products a block
    monkeypatch.setattr(measure, "decode_steps", lambda config, span, rows: (config, span))
    real_timing = measure._alternating_seconds

    def timed(runs, repeats):
        if not all(isinstance(run, tuple) for run in runs):
            return real_timing(runs, 1)  # the prefill passes, really run
        return [[weights_of(span) / rate[fmt_of(span)] + config.num_layers * cost[fmt_of(span)] * (1 + 0.01 * (i % 3))
                 for i in range(repeats)] for config, span in runs]

    monkeypatch.setattr(measure, "_alternating_seconds", timed)
    one_width = {**TINY_SPAN, "stream_hidden": TINY_SPAN["hidden"]}  # the cached spans' blocks' share of the costs
    results = {m.key: m for m in measure_packed_kernels(repeats=2, **one_width, step_repeats=5)}
    block = results[PACKED_BLOCK_KEY]
    assert block.value == pytest.approx(2e-6 * 1.01, rel=1e-6)
    assert sorted(block.samples) == pytest.approx([1.515e-6, 2.02e-6, 2.525e-6], rel=1e-6)
    # each rate less the one cost the planner adds: q4_0's (its own fit) exact, the others' off by their blocks'
    # share of the difference (0.5 us of ~7-9 us a block)
    for name in PACKED_FORMATS:
        for key in (PACKED_CACHED_KEY, PACKED_KERNEL_KEY):
            assert results[f"{key}{name}"].value == pytest.approx(rate[name], rel=0.1 if name != "q4_0" else 0.02)


def weights_of(span) -> int:
    return sum(getattr(getattr(block, parent), child).in_features * getattr(getattr(block, parent), child).out_features
               for block in span.blocks for parent, child in measure.PACKED_LINEARS)


def fmt_of(span) -> str:
    return span.blocks[0].mlp.down_proj.fmt.name


def test_a_packed_blocks_cost_is_the_median_of_the_formats_fits_and_none_below_the_noise():
    """Each format's steps fitted as weights / rate + blocks x cost; one format's fit the noise moved does not move
    the cost; steps the fit cannot split (the narrow span no slower a weight than the wide one) give 0, so the rates
    hold the whole step."""
    def runs(cost: float):
        return ([10e-3] * 3, 20e6, 3), ([10e-3 + 22 * cost] * 3, 20e6, 25)

    m = packed_block_overhead({"q8_0": runs(40e-6), "q4_0": runs(50e-6), "q4_1": runs(200e-6)}, 0.5,
                              "widths 768 and 256")
    assert m.key == PACKED_BLOCK_KEY and m.unit == "s" and m.value == pytest.approx(50e-6)
    assert m.samples == pytest.approx([40e-6, 50e-6, 200e-6]) and "q4_1 3 and 25 blocks" in m.detail
    flat = (([1.0e-3, 1.1e-3, 0.9e-3], 20e6, 3), ([0.95e-3, 1.0e-3, 1.05e-3], 20e6, 25))
    none = packed_block_overhead({"q8_0": flat, "q4_0": flat, "q4_1": runs(50e-6)}, 0.5, "")
    assert none.value == 0 and "does not resolve" in none.detail


def test_the_narrow_span_is_narrower_in_whole_heads():
    assert narrow_width(768) == 256 and narrow_width(2048) == 768 and narrow_width(128) == 64


@pytest.mark.parametrize("fmt", PACKED_FORMATS)
def test_the_span_holds_its_format_in_one_buffer_beyond_the_asked_size(fmt):
    config, span, weights = packed_span(fmt, 64, 256 << 10)
    layers = [getattr(getattr(block, parent), child) for block in span.blocks
              for parent, child in measure.PACKED_LINEARS]
    assert all(layer.fmt.name == fmt for layer in layers) and config.num_layers == len(span.blocks) > 1
    assert weights == sum(layer.in_features * layer.out_features for layer in layers)
    starts = [layer.packed.data_ptr() for layer in layers]
    ends = [start + layer.packed.numel() for start, layer in zip(starts, layers)]
    assert starts[1:] == ends[:-1]  # one buffer, in reading order
    assert abs(ends[-1] - starts[0] - (256 << 10)) <= (ends[-1] - starts[0]) / config.num_layers


def test_the_streamed_spans_of_every_format_fit_one_shared_arena_from_its_start():
    """packed_arena holds any format's span of the asked bytes in whole blocks (the widest, Q8_0, included); each
    span starts at the arena's start and reads at least the asked bytes, so each is as far beyond the cache as
    asked while the three together take one format's memory."""
    arena = measure.packed_arena(96, 300 << 10)
    for fmt in PACKED_FORMATS:
        config, span, weights = packed_span(fmt, 96, 300 << 10, arena)
        layers = [getattr(getattr(block, parent), child) for block in span.blocks
                  for parent, child in measure.PACKED_LINEARS]
        nbytes = sum(layer.packed.numel() for layer in layers)
        assert layers[0].packed.data_ptr() == arena.ctypes.data and config.hidden_size == 96
        assert (300 << 10) <= nbytes <= arena.nbytes and nbytes - (300 << 10) < nbytes / (config.num_layers - 1)
        assert weights * format_bytes(fmt) == pytest.approx(nbytes)


def test_quick_times_the_streamed_packed_spans_at_the_thin_models_width():
    """Issue 14 item 12 / 23 (session 15): `measure --quick` (the first plan's) times the packed spans beyond the
    cache too, at the thin decode span's width (a model like SmolLM2, 30 x 576 and 66 MB of Q4_1 blocks, streams
    from RAM through a 32 MiB L3), with the same procedure as the full measurement; three times, early, in the middle
    and last (sessions 17, 19), and the profile keeps one measurement a key, the median of the readings' samples: the
    first reading, at a slow spell, does not set it."""
    recorded = []
    kernel, block = f"{PACKED_KERNEL_KEY}q4_1", PACKED_BLOCK_KEY

    def packed(*args):
        recorded.append(args)
        first = len(recorded) == 1
        return [Measurement(kernel, "", 0.0, WEIGHTS_PER_S, 0.0, 3, 0.0, "",
                            [10e9, 11e9, 12e9] if first else [30e9, 31e9, 32e9]),
                Measurement(block, "", 0.0, "s", 0.0, 3, 0.0, "", [0.0, 0.0, 1e-4] if first else [2e-4, 1e-4, 3e-4])]

    sizes = dataclasses.replace(measure.QUICK, dtypes=(), disk_bytes=0, ram_bytes=1 << 20, cache_bytes=1 << 20)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(measure, "measure_packed_kernels", packed)
        patch.setattr(measure, "measure_memory_read", lambda *args: Measurement("ram_read", "", 1e9, "B/s", 0, 1, 0))
        patch.setattr(measure, "has_half_math", lambda: False)
        results = measure.run_benchmarks(sizes, gpu=False)
    first, middle, args = recorded
    assert first == middle == args
    by_key = {m.key: m for m in results}
    assert [m.key for m in results].count(kernel) == 1 and by_key[kernel].value == pytest.approx(30e9)
    assert by_key[kernel].samples == [10e9, 11e9, 12e9] + [30e9, 31e9, 32e9] * 2
    assert "read 3 times over the measurement" in by_key[kernel].detail
    assert by_key[kernel].spread == pytest.approx(22e9 / 30e9) and by_key[block].value == pytest.approx(1e-4)
    assert args[4] is True and args[6] == measure.STREAM_THIN == sizes.stream_thin and args[1] == sizes.packed_hidden
    assert args[5] >= measure.PACKED_STEP_REPEATS


def machine_measured(block_s: float, rates: dict[str, float], packed_block_s: float | None = None) -> HardwareSpec:
    """cpu-generic with a measured profile: the fp32 spans' fixed cost of a block `block_s`, the packed rates and
    (where given) a packed block's fixed cost for each of them."""
    records = [Measurement("ram_read", "RAM read", 30e9, "B/s", 0.0, 3, 0.0),
               Measurement("cpu_matmul_fp32_prefill", "fp32 matmul", 100e9, "FLOP/s", 0.0, 3, 0.0),
               Measurement(WEIGHT_STREAM_KEY, "decode weight streaming", 30e9, "B/s", 0.0, 3, 0.0),
               Measurement(BLOCK_OVERHEAD_KEY, "fixed cost of a block", block_s, "s", 0.0, 3, 0.0),
               Measurement(SMALL_ROWS_READS_KEY, "4-row reads", 2.0, "x", 0.0, 3, 0.0)]
    records += [Measurement(f"{PACKED_KERNEL_KEY}{name}", name, rate, WEIGHTS_PER_S, 0.0, 3, 0.0)
                for name, rate in rates.items()]
    if packed_block_s is not None:
        records.append(Measurement(PACKED_BLOCK_KEY, "fixed cost of a packed block", packed_block_s, "s", 0.0, 3, 0.0))
    return apply_measurements(get_hardware("cpu-generic"), records, when=1.7e9)


def test_a_thin_packed_model_beyond_the_cache_follows_the_streamed_reading_not_the_cached_one():
    """Issue 14 item 12 / 23 (session 15): with the streamed spans in the quick measurement too, SmolLM2's shape in
    Q4_1 (30 x 576, ~66 MB of blocks and a Q8_0 head: three times a 32 MiB L3) is priced at the streamed rate; the
    cached spans' rate (which read 3.4-26.7 G weights/s between quick measurements on this project's host) no
    longer moves it, and without a streamed reading (a profile measured before) it is priced at the cached one."""
    smol = ModelSpec("smol", "llama", 30, 576, 1536, 9, 3, 64, 49152, True, 2048)
    ram = Placement(gpu=0.0, cpu=1.0, disk=0.0)
    policy = Policy(weight_format="q4_1", weights=ram, kv_cache=ram, activations=ram, micro_batch_size=1)

    def step_s(streamed: float | None, cached: float) -> float:
        rates = {} if streamed is None else {"q4_1": streamed, "q8_0": streamed}
        hardware = machine_measured(0.3e-3, rates, 0.04e-3)
        cpu = dataclasses.replace(hardware.cpu, cache_bytes=32 << 20,
                                  packed_kernels_cached={"q4_1": cached, "q8_0": cached})
        hardware = dataclasses.replace(hardware, cpu=cpu)
        return 1.0 / evaluate(smol, hardware, policy, Workload(prompt_len=8, output_len=8),
                              measured_efficiency(hardware)).decode_tokens_per_s

    assert step_s(5e9, 3.4e9) == pytest.approx(step_s(5e9, 26.7e9), rel=1e-9)
    numbers = model_numbers(smol)
    weights = numbers.layers * numbers.matrix_params + numbers.head_params  # the blocks' and the head's kernels
    assert step_s(2.5e9, 26.7e9) - step_s(5e9, 26.7e9) == pytest.approx(weights / 5e9, rel=0.05)
    assert step_s(None, 3.4e9) - step_s(None, 26.7e9) == pytest.approx(weights * (1 / 3.4e9 - 1 / 26.7e9), rel=0.05)


@pytest.mark.parametrize("packed_block_s", [0.0, 0.05e-3])
def test_a_model_shaped_as_the_measured_span_is_planned_at_its_step(packed_block_s):
    """The mechanism of issue 23's packed fix: the rate is the span's step less the packed block's fixed cost that
    the planner adds to each packed block, both fitted on packed spans, so a model of the span's shape (thin, many
    blocks) is planned at the step the span took, whatever the fitted cost and whatever the fp32 spans' cost (0.3 ms
    here: session 14's VNNI host, where adding it to each packed block put SmolLM2's step at twice its time)."""
    span = ModelSpec("span", "llama", 40, 768, 2112, 12, 3, 64, 256, True, 2048)
    weights = span.num_layers * model_numbers(span).matrix_params
    step_s = 0.040  # the span's step, as measured
    rate = weights / packed_kernel_seconds(step_s, span.num_layers, packed_block_s)
    hardware = machine_measured(0.3e-3, {"q4_1": rate, "q8_0": rate}, packed_block_s)
    ram = Placement(gpu=0.0, cpu=1.0, disk=0.0)
    policy = Policy(weight_format="q4_1", weights=ram, kv_cache=ram, activations=ram, micro_batch_size=1)
    efficiency = measured_efficiency(hardware)
    predicted = 1.0 / evaluate(span, hardware, policy, Workload(prompt_len=8, output_len=8),
                               efficiency).decode_tokens_per_s
    # beside the head and the step's own overhead (sampling), which no span pays, within 1% (attention's reads of
    # the short KV cache): the fp32 cost added to each block would add 30% (40 x 0.3 ms)
    head = model_numbers(span).head_params / rate
    assert step_s <= predicted <= (step_s + efficiency.accelerator.step_overhead_s) * 1.01 + 2 * head


def test_a_packed_models_fixed_cost_is_the_packed_measurement_else_the_fp32_one():
    """The planner's rule: a packed model's blocks pay the packed block's measured cost, an fp32 model's the fp32
    spans' cost; a profile measured before the packed cost was (its packed rates measured less the fp32 cost)
    keeps the fp32 cost for packed blocks too, so its rate and cost stay one fit."""
    span = ModelSpec("span", "llama", 30, 576, 1536, 9, 3, 64, 49152, True, 2048)
    ram = Placement(gpu=0.0, cpu=1.0, disk=0.0)
    one_row = lambda fmt: Policy(weight_format=fmt, weights=ram, kv_cache=ram, activations=ram,  # noqa: E731
                                 micro_batch_size=1)
    rates = {"q4_1": 25e9, "q8_0": 20e9}

    def fixed(hardware, fmt):
        terms = decode_step_terms(span, hardware, one_row(fmt), Workload(prompt_len=8, output_len=8),
                                  measured_efficiency(hardware))
        return terms["blocks_fixed_s"] / span.num_layers

    measured, older = machine_measured(0.3e-3, rates, 0.02e-3), machine_measured(0.3e-3, rates)
    assert measured.cpu.packed_block_overhead_s == 0.02e-3
    assert fixed(measured, "q4_1") == pytest.approx(0.02e-3) and fixed(measured, "fp32") == pytest.approx(0.3e-3)
    assert older.cpu.packed_block_overhead_s is None and fixed(older, "q4_1") == pytest.approx(0.3e-3)
    # measured as none (below the noise): none added, not the fp32 cost
    assert fixed(machine_measured(0.3e-3, rates, 0.0), "q4_1") == 0.0


def test_the_packed_block_cost_goes_through_a_hardware_file_and_back():
    from hivekeeper.planner.hardware_catalog import hardware_from_dict, hardware_to_json

    hardware = machine_measured(0.3e-3, {"q4_1": 25e9}, 0.0425e-3)
    doc = hardware_to_json(hardware)
    assert doc["cpu"]["packed_block_overhead_ms"] == 0.0425
    assert hardware_from_dict(doc).cpu.packed_block_overhead_s == pytest.approx(0.0425e-3)
    doc["cpu"]["packed_block_overhead_ms"] = 500
    with pytest.raises(InputError, match="packed_block_overhead_ms"):
        hardware_from_dict(doc)
    # a negative fit is read as none, a cost beyond any block's as the 0.1 s the fp32 one is held to
    measured = lambda value: [Measurement(PACKED_BLOCK_KEY, "", value, "s", 0, 3, 0)]  # noqa: E731
    assert packed_block_cost(measured(-1e-4)) == 0.0 and packed_block_cost(measured(5.0)) == 0.1
    assert packed_block_cost([rate("q4_1", 5e9)]) is None


def test_fixed_costs_that_would_explain_the_whole_step_leave_a_quarter():
    assert packed_kernel_seconds(0.040, 40, 0.25e-3) == pytest.approx(0.030)
    assert packed_kernel_seconds(0.040, 40, 2e-3) == pytest.approx(0.010)


def rate(name: str, value: float) -> Measurement:
    return Measurement(f"{PACKED_KERNEL_KEY}{name}", f"CPU {name} kernel", value, WEIGHTS_PER_S, 0.1, 3, 0.5)


CPU = ComputeDevice(kind="cpu", name="Test CPU", memory_bytes=64 * 10**9, memory_bandwidth=20e9,
                    flops={"fp32": 200e9}, power_watts=65.0, cores=4)
MACHINE = HardwareSpec(id="test", gpus=(), cpu=CPU, disk=DiskSpec(10**12, 1e9, 1e9), network=NetworkSpec(1e9, 1e9, 0.01))
MODEL = ModelSpec(name="m", family="llama", num_layers=16, hidden_size=2048, intermediate_size=5632, num_heads=16,
                  num_kv_heads=16, head_dim=128, vocab_size=32000, tie_word_embeddings=False,
                  max_position_embeddings=2048)


def test_measured_rates_reach_the_planner_and_set_the_packed_decode():
    ram = Measurement("ram_read", "RAM", 20e9, "B/s", 0.0, 3, 0.5)
    measured = [rate("q4_0", 1e9), rate("q8_0", 3e9), ram]
    assert packed_kernel_rates(measured) == {"q4_0": 1e9, "q8_0": 3e9}
    spec = apply_measurements(MACHINE, measured)
    assert spec.cpu.packed_kernels == {"q4_0": 1e9, "q8_0": 3e9}
    policy = Policy(weight_format="q4_0", weights=Placement(0, 1, 0), kv_cache=Placement(0, 1, 0),
                    activations=Placement(0, 1, 0))
    slow = evaluate(MODEL, spec, policy, Workload(32, 32))
    faster = evaluate(MODEL, apply_measurements(MACHINE, [rate("q4_0", 2e9), rate("q8_0", 3e9), ram]), policy, Workload(32, 32))
    assert slow.bottleneck == "packed kernel compute" and "1 G weights/s (measured)" in slow.bottleneck_detail
    assert 1.5 < faster.decode_tokens_per_s / slow.decode_tokens_per_s <= 2.0
    # an unknown format's key (a newer profile) is left out rather than failing
    assert packed_kernel_rates([rate("q5_k", 1e9)]) == {}


def test_the_measure_table_shows_each_kernels_default_beside_its_measurement():
    from hivekeeper.core.machine.profiles import new_profile

    profile = new_profile(MACHINE)
    profile.measurements = [rate("q4_1", 5e9)]
    rows = {row.quantity: row for row in comparison_rows(MACHINE, profile)}
    assert rows["q4_1 kernel, one row"].measured == 5e9
    assert rows["q8_0 kernel, one row"].measured is None and rows["q8_0 kernel, one row"].catalog > 0
    assert rows["q4_1 kernel, one row"].unit == WEIGHTS_PER_S
    # every saved measurement has a row, those without a catalog value too (session 22: a prefill block cost and the
    # few-row ratios were saved and used, and shown nowhere)
    profile.measurements += [rows_step("q4_1", 4, 1.8), Measurement(PACKED_PREFILL_KEY + "q4_1", "CPU q4_1 prefill",
                                                                    4e10, WEIGHTS_PER_S, 0.1, 5, 0.5)]
    keys = {row.key: row for row in comparison_rows(MACHINE, profile)}
    assert {m.key for m in profile.measurements} <= set(keys)
    assert keys[f"{PACKED_ROWS_KEY}q4_1x4"].measured == 1.8 and keys[f"{PACKED_ROWS_KEY}q4_1x4"].part == "CPU"
    assert keys[f"{PACKED_ROWS_KEY}q4_1x4"].catalog is None and keys[f"{PACKED_ROWS_KEY}q4_1x4"].unit == "x"


def test_the_measure_table_names_each_row_once_and_says_what_the_cached_rate_times():
    """A newcomer's `measure --quick` table read "CPU   CPU q8_0 decode step of 4 rows over one row" (the part twice)
    and showed the "weights in cache" rates below the streamed ones with nothing saying why. The table as `measure`
    prints it (core/cli/measure.render) of real measurements of tiny spans and of the decode loop."""
    from hivekeeper.core.cli.measure import render
    from hivekeeper.core.machine.measure import measure_decode_attention, measure_step_overhead
    from hivekeeper.core.machine.profiles import new_profile

    profile = new_profile(MACHINE)
    profile.measurements = [*measure_packed_kernels(repeats=2, **TINY_SPAN),
                            measure_step_overhead(runs=1, steps=3, cache_bytes=1 << 20),
                            measure_decode_attention(total_bytes=1, cache_bytes=0, pairs=2)]
    table, note = render(comparison_rows(MACHINE, profile)).split("\n* ")
    rows = {" ".join(line.split()[:2]) for line in table.splitlines()}
    assert "CPU CPU" not in rows, table
    for quantity in ("q8_0 4-row decode step / one-row step", "q4_1 prefill (96 rows)",
                     "decode step overhead (embedding, sampling, loop)", "decode attention (KV cache read)"):
        assert f"CPU   {quantity}" in table, table
    cached = [line for line in table.splitlines() if "weights in cache *" in line]
    assert len(cached) == len(PACKED_FORMATS) and all("G weights/s" in line for line in cached), table
    said = " ".join(note.split())
    assert said.startswith("weights in cache: one-row decode steps of a span a third of the last-level cache")
    assert "stays in this rate" in said and "below the streamed one" in said, said
    by_key = {m.key: m for m in profile.measurements}
    assert "stays in this rate" in by_key[f"{PACKED_CACHED_KEY}q8_0"].detail
    assert "stays in this rate" not in by_key[f"{PACKED_KERNEL_KEY}q8_0"].detail


def test_the_few_row_steps_are_the_streamed_spans_kernel_time_over_its_one_row_steps(monkeypatch):
    """Session 22 (issue 23): each format's 4- and 8-row steps through the streamed span, timed in turn with its
    one-row steps, each less its blocks' fixed cost: the ratio of the kernels' times (never below 1)."""
    rate, cost = 25e9, 2e-6
    factor = {1: 1.0, 4: 1.8, 8: 4.5}
    monkeypatch.setattr(measure, "decode_steps", lambda config, span, rows: (config, span, rows))
    real_timing = measure._alternating_seconds

    def timed(runs, repeats):
        if not all(isinstance(run, tuple) for run in runs):
            return real_timing(runs, 1)  # the prefill passes, really run
        return [[weights_of(span) / rate * factor[rows] + config.num_layers * cost for _ in range(repeats)]
                for config, span, rows in runs]

    monkeypatch.setattr(measure, "_alternating_seconds", timed)
    one_width = {**TINY_SPAN, "stream_hidden": TINY_SPAN["hidden"]}
    results = {m.key: m for m in measure_packed_kernels(repeats=2, **one_width, step_repeats=5)}
    for name in PACKED_FORMATS:
        for rows in PACKED_ROW_COUNTS:
            assert results[f"{PACKED_ROWS_KEY}{name}x{rows}"].value == pytest.approx(factor[rows], rel=1e-6)
    # a few-row step timed faster than the one-row one (noise) is read as 1: more rows never take less
    from hivekeeper.core.machine.measure import packed_rows_measurement

    assert packed_rows_measurement("q4_1", 4, [1.0, 1.0, 1.0], [0.9, 1.2, 0.8], 10, 0.0, 0.5).value == 1.0


def rows_step(name: str, rows: int, value: float) -> Measurement:
    return Measurement(f"{PACKED_ROWS_KEY}{name}x{rows}", f"CPU {name} {rows} rows", value, "x", 0.1, 9, 0.5)


def test_few_row_steps_reach_the_planner_through_a_profile_and_a_hardware_file():
    from hivekeeper.core.machine.profiles import packed_row_steps
    from hivekeeper.planner.hardware_catalog import hardware_from_dict, hardware_to_json

    measured = [rows_step("q4_0", 4, 1.8), rows_step("q4_0", 8, 4.5), rows_step("q8_0", 4, 2.0)]
    assert packed_row_steps(measured) == {"q4_0": (1.8, 4.5)}  # q8_0 lacks its 8-row step: left out
    spec = apply_measurements(MACHINE, [rate("q4_0", 1e9), *measured])
    assert spec.cpu.packed_row_steps == {"q4_0": (1.8, 4.5)}
    doc = hardware_to_json(spec)
    assert doc["cpu"]["packed_row_steps"] == {"q4_0": [1.8, 4.5]}
    assert hardware_from_dict(doc).cpu.packed_row_steps == {"q4_0": (1.8, 4.5)}
    doc["cpu"]["packed_row_steps"] = {"q4_0": [1.8]}
    with pytest.raises(InputError, match=r"cpu\.packed_row_steps\.q4_0.*2 step ratios \(at 4, 8 rows\)"):
        hardware_from_dict(doc)
    doc["cpu"]["packed_row_steps"] = {"q4_0": [1.8, 500]}
    with pytest.raises(InputError, match=r"packed_row_steps\.q4_0\[1\].*at most 64"):
        hardware_from_dict(doc)


@pytest.mark.parametrize("steps, two, four", [(None, 2.0, 4.0), ((1.8, 4.5), 1 + 0.8 / 3, 1.8)])
def test_a_packed_few_row_decode_step_takes_the_measured_share_of_one_row_steps(steps, two, four):
    """Kernel-bound packed decode (a kernel rate far below what RAM feeds): a step of r rows takes r one-row steps'
    kernel time where the few-row steps were not measured, and the measured ratio (linear between 1 and its row
    counts) where they were: 2 rows at 1.8 measured at 4 rows take 1.27 one-row steps; 4 rows 1.8."""
    measured = [rate("q4_0", 1e9), rate("q8_0", 1e9), Measurement(PACKED_BLOCK_KEY, "", 0.0, "s", 0, 3, 0)]
    if steps is not None:
        measured += [rows_step(name, rows, value) for name in ("q4_0", "q8_0")
                     for rows, value in zip(PACKED_ROW_COUNTS, steps)]
    spec = apply_measurements(MACHINE, measured)

    def step_s(rows: int) -> float:
        policy = Policy(weight_format="q4_0", weights=Placement(0, 1, 0), kv_cache=Placement(0, 1, 0),
                        activations=Placement(0, 1, 0), micro_batch_size=rows)
        return rows / evaluate(MODEL, spec, policy, Workload(8, 8)).decode_tokens_per_s

    one = step_s(1)
    assert step_s(2) / one == pytest.approx(two, rel=0.03)
    assert step_s(4) / one == pytest.approx(four, rel=0.03)
