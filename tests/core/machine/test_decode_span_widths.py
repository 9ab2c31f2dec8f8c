"""Issue 23 (session 15): the decode steps' spans bracket the models a CPU runs, a thin model's blocks (576 wide) and
a wide one's (2048), both beyond the last-level cache, in the quick measurement as in the full one; steps timed as
a known model give its terms back to the planner for thin and wide models alike. Nothing is timed: the spans are
built on the meta device (their shapes only) and their seconds fed in."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hivekeeper.core.machine import measure
from hivekeeper.core.machine.measure import (QUICK, STREAM_THIN, TINY, BenchmarkSizes, StreamSpans,
                                             grouped_kv_heads, stream_span_configs, thin_width)
from hivekeeper.core.machine.measurement import BLOCK_OVERHEAD_KEY, WEIGHT_STREAM_KEY, Measurement
from hivekeeper.core.machine.profiles import apply_measurements
from hivekeeper.core.runtime.model import Span
from hivekeeper.planner.calibration import measured_efficiency
from hivekeeper.planner.costmodel import Placement, Policy, Workload, decode_step_terms
from hivekeeper.planner.hardware_catalog import get_hardware
from hivekeeper.planner.models import ModelSpec

MIB = 1 << 20
THIN = ModelSpec("thin", "llama", 30, 576, 1536, 9, 3, 64, 49152, True, 8192)  # SmolLM2-135M's shape
WIDE = ModelSpec("wide", "llama", 2, 2048, 5632, 16, 4, 128, 8192, False, 1024)  # the calibration bench's wide one
RAM = Placement(gpu=0.0, cpu=1.0, disk=0.0)


@pytest.mark.parametrize("cache_mib", [32, 105])
@pytest.mark.parametrize("sizes", [QUICK, BenchmarkSizes()], ids=["quick", "full"])
def test_the_spans_are_a_thin_models_blocks_and_a_wide_ones_both_beyond_the_cache(sizes, cache_mib):
    """Widths 2048 and 576 in both measurements (QUICK's were 1024 and 384, its 1024-wide span one block of 43 MiB:
    1.4x a 32 MiB cache, partly read from it), each span at least twice the cache and as large as a small model's
    step reads (session 17: a native step call's fixed start weighed 6-11% in QUICK's 95-172 MiB spans, ~3% in a
    model's 400-540 MB), QUICK's packed streamed spans a packed small model's 96 MiB."""
    cache = cache_mib * MIB
    wide, thin = stream_span_configs(sizes.stream_hidden, sizes.stream_bytes, cache, sizes.stream_thin)
    assert (wide.hidden_size, thin.hidden_size) == (2048, 576)
    span_bytes = [c.block_param_count() * 4 * c.num_layers for c in (wide, thin)]
    assert all(b >= 2 * cache for b in span_bytes)
    assert thin.num_layers > 5 * wide.num_layers  # many thin blocks, few wide ones: the fit separates the terms
    assert all(b >= 340 * MIB for b in span_bytes) and max(span_bytes) < 600 * MIB
    assert (QUICK.packed_bytes, BenchmarkSizes().packed_bytes) == (96 * MIB, None)


def test_a_small_machine_measures_on_spans_within_its_memory():
    """Each decode span takes at most an eighth of the memory available (a 2 GiB machine: 256 MiB spans), never
    less than twice the cache, which stream_span_configs keeps; a large machine keeps the sizes asked for."""
    small = measure.within_memory(QUICK, available=2 << 30)
    assert small.stream_bytes == 256 * MIB and small.packed_bytes == QUICK.packed_bytes
    assert measure.within_memory(QUICK, available=64 << 30) == QUICK
    wide, thin = stream_span_configs(small.stream_hidden, measure.within_memory(QUICK, available=1 << 20).stream_bytes,
                                     32 * MIB, small.stream_thin)
    assert all(c.block_param_count() * 4 * c.num_layers >= 64 * MIB for c in (wide, thin))


def test_test_sized_spans_keep_a_narrower_thin_span_and_every_span_has_whole_kv_groups():
    assert thin_width(2048) == STREAM_THIN == 576 and thin_width(1024) == 384 and thin_width(256) == 64
    assert thin_width(TINY.stream_hidden, TINY.stream_thin) < TINY.stream_hidden
    for heads in range(1, 65):
        kv = grouped_kv_heads(heads)
        assert heads % kv == 0 and 1 <= kv <= max(1, heads // 3)
    assert (grouped_kv_heads(9), grouped_kv_heads(32)) == (3, 8)  # SmolLM2's 576 wide: 9 heads, 3 KV heads


def meta_spans(cache: int) -> StreamSpans:
    """QUICK's two spans as StreamSpans.make builds them for a `cache`-byte last-level cache, on the meta device."""
    built = []
    for config in stream_span_configs(QUICK.stream_hidden, QUICK.stream_bytes, cache, QUICK.stream_thin):
        with torch.device("meta"):
            built += [config, Span(config, 0, config.num_layers)]
    return StreamSpans(*built)


def test_steps_timed_as_a_known_model_give_its_terms_back_for_thin_and_wide_models(monkeypatch):
    """QUICK's spans stepped as a machine that reads weights at 20 GB/s and pays 0.25 ms a block: the profile gives
    the planner that rate and cost, and it prices SmolLM2's 30 thin blocks and the wide model's 2 by them (reads at
    the rate, the fixed cost per block), where a wrong split would move one model and not the other."""
    rate, per_block = 20e9, 0.25e-3
    spans = meta_spans(32 * MIB)
    shapes = spans.shapes()
    one_row = [[nbytes / rate + blocks * per_block] * 5 for nbytes, blocks in shapes]
    four_rows, eight_rows = ([[reads * nbytes / rate + blocks * per_block] * 5
                              for reads, (nbytes, blocks) in zip(pair, shapes)] for pair in ((2.0, 1.5), (2.8, 2.6)))

    def alternating(runs, repeats):
        if repeats == measure.PREFILL_REPEATS:
            return [[0.05] * repeats, [0.08] * repeats]
        return one_row + four_rows + eight_rows

    monkeypatch.setattr(measure, "_alternating_seconds", alternating)
    results = measure.measure_decode_blocks(QUICK.stream_hidden, QUICK.stream_bytes, repeats=2, cache_bytes=32 * MIB,
                                            spans=spans)
    by_key = {m.key: m for m in results}
    assert by_key[WEIGHT_STREAM_KEY].value == pytest.approx(rate)
    assert by_key[BLOCK_OVERHEAD_KEY].value == pytest.approx(per_block)
    ram = Measurement("ram_read", "RAM read bandwidth", 25e9, "B/s", 0.0, 2, 0.0, "fed in")
    hardware = apply_measurements(get_hardware("cpu-generic"), [ram, *results])
    policy = Policy(weight_format="fp32", weights=RAM, kv_cache=RAM, activations=RAM)
    for model in (THIN, WIDE):
        terms = decode_step_terms(model, hardware, policy, Workload(prompt_len=8, output_len=2),
                                  measured_efficiency(hardware))
        assert terms["blocks_reads_s"] == pytest.approx(terms["blocks_bytes_min"] / rate, rel=1e-6)
        assert terms["blocks_fixed_s"] == pytest.approx(model.num_layers * per_block, rel=1e-6)
        # 4- and 8-row steps read the weights as often as the span of the model's width did
        for rows, reads in ((4, 1.5 if model is THIN else 2.0), (8, 2.6 if model is THIN else 2.8)):
            few = decode_step_terms(model, hardware, dataclasses.replace(policy, micro_batch_size=rows),
                                    Workload(prompt_len=8, output_len=2), measured_efficiency(hardware))
            assert few["blocks_reads_s"] == pytest.approx(reads * terms["blocks_reads_s"], rel=0.01)
