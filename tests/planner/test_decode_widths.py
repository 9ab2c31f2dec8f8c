"""Issue 23 (session 15): a one-row CPU decode step is priced per block as its bytes at the measured rate plus the
block's fixed cost, both fitted to spans of a thin model's blocks (576 wide) and a wide one's (2048): per byte of
weights that is 1 / rate + cost / block bytes, the spans' own figures at their widths and between them for a model
whose width lies between. Fed-in numbers; no host speed."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from hivekeeper.planner.calibration import efficiency_from_dict, efficiency_to_dict, from_fitted
from hivekeeper.planner.costmodel import Placement, Policy, Workload, decode_step_terms
from hivekeeper.planner.efficiency import default_efficiency
from hivekeeper.planner.errors import InputError
from hivekeeper.planner.hardware_catalog import hardware_from_dict, hardware_to_json
from hivekeeper.planner.hardware import ComputeDevice, DecodeStreaming, DiskSpec, HardwareSpec, NetworkSpec
from hivekeeper.planner.models import ModelSpec

RAM = Placement(gpu=0.0, cpu=1.0, disk=0.0)
RATE, BLOCK_S = 20e9, 0.25e-3  # as a measurement fitted them: bytes/s of the reads, seconds a block


def machine(block_s: float) -> HardwareSpec:
    streaming = DecodeStreaming(bandwidth_fraction=RATE / 25e9, small_row_reads=2.0, matmul_start_s=0.0,
                                block_overhead_s=block_s, prefill_block_overhead_s=1e-3, row_block_overhead_s=0.0)
    cpu = ComputeDevice(kind="cpu", name="Test CPU", memory_bytes=16 * 10**9, memory_bandwidth=25e9,
                        flops={"fp32": 150e9}, power_watts=50.0, cores=2, decode_streaming=streaming,
                        sources={"memory_bandwidth": "measured", "flops": "measured"})
    return HardwareSpec(id="test-cpu", gpus=(), cpu=cpu,
                        disk=DiskSpec(capacity_bytes=10**11, read_bandwidth=1e9, write_bandwidth=1e9),
                        network=NetworkSpec(upload_bps=1e9, download_bps=1e9, rtt_s=0.01))


def model(hidden: int, layers: int) -> ModelSpec:
    """Blocks shaped as the measurement's spans (heads of 64, a quarter as many KV heads, MLP 2.75x wide)."""
    heads = hidden // 64
    return ModelSpec(f"w{hidden}", "llama", layers, hidden, int(hidden * 2.75) // 64 * 64, heads, max(1, heads // 4),
                     64, 8192, False, 1024)


def seconds_per_byte(hardware: HardwareSpec, spec: ModelSpec) -> float:
    """A one-row step's blocks (reads and fixed costs) over their bytes."""
    terms = decode_step_terms(spec, hardware, Policy("fp32", weights=RAM, kv_cache=RAM, activations=RAM),
                              Workload(prompt_len=8, output_len=2), default_efficiency(hardware))
    return (terms["blocks_reads_s"] + terms["blocks_fixed_s"]) / terms["blocks_bytes_min"]


def test_a_model_between_the_measured_widths_is_priced_between_them():
    hardware = machine(BLOCK_S)
    thin, middle, wide = (seconds_per_byte(hardware, model(h, n)) for h, n in ((576, 30), (1024, 10), (2048, 2)))
    assert thin > middle > wide > 1 / RATE
    # each width's figure is the measured terms': 1 / rate + a block's cost over a block's bytes
    for hidden, layers, figure in ((576, 30, thin), (2048, 2, wide)):
        spec = model(hidden, layers)
        terms = decode_step_terms(spec, hardware, Policy("fp32", weights=RAM, kv_cache=RAM, activations=RAM),
                                  Workload(prompt_len=8, output_len=2), default_efficiency(hardware))
        per_block_bytes = terms["blocks_bytes_min"] / layers
        assert figure == pytest.approx(1 / RATE + BLOCK_S / per_block_bytes, rel=1e-6)


def test_without_a_blocks_fixed_cost_every_width_reads_at_the_one_rate():
    hardware = machine(0.0)
    figures = [seconds_per_byte(hardware, model(h, n)) for h, n in ((576, 30), (1024, 10), (2048, 2))]
    assert figures == pytest.approx([1 / RATE] * 3, rel=1e-6)


def four_row_reads(hardware: HardwareSpec, spec: ModelSpec, rows: int = 4) -> float:
    """The blocks' and the head's reads of a step of `rows` rows over the one-row step's."""
    def reads(rows: int) -> float:
        terms = decode_step_terms(spec, hardware, Policy("fp32", weights=RAM, kv_cache=RAM, activations=RAM,
                                                         micro_batch_size=rows),
                                  Workload(prompt_len=8, output_len=2), default_efficiency(hardware))
        return terms["blocks_reads_s"] + terms["head_reads_s"]
    return reads(rows) / reads(1)


def with_reads_by_width(hardware: HardwareSpec, table: tuple[tuple[int, int, float], ...]) -> HardwareSpec:
    streaming = dataclasses.replace(hardware.cpu.decode_streaming, row_reads_by_width=table)
    return dataclasses.replace(hardware, cpu=dataclasses.replace(hardware.cpu, decode_streaming=streaming))


def test_a_few_row_step_reads_a_models_weights_as_often_as_the_span_of_its_width_did():
    """Session 16: a 4-row step read 576-wide blocks ~1.4 times and 2048-wide ones ~1.9 times (one figure, the wide
    span's, had priced SmolLM2's 4-row step 1.3-1.6x slow). Each width's measured reads hold for a model of that
    width, head included; a width between them between, on log(width); beyond them, the nearest one's. Without the
    table, the one figure (small_row_reads) for every width."""
    hardware = with_reads_by_width(machine(BLOCK_S), ((576, 4, 1.4), (2048, 4, 1.9)))
    thin, middle, wide = (four_row_reads(hardware, model(h, n)) for h, n in ((576, 30), (1024, 10), (2048, 2)))
    # (the norms' vectors are read once whatever the rows: within 1%)
    assert (thin, wide) == (pytest.approx(1.4, rel=0.01), pytest.approx(1.9, rel=0.01))
    assert middle == pytest.approx(1.4 + 0.5 * math.log(1024 / 576) / math.log(2048 / 576), rel=0.01)
    assert four_row_reads(hardware, model(256, 30)) == pytest.approx(1.4, rel=0.01)
    assert four_row_reads(hardware, model(4096, 2)) == pytest.approx(1.9, rel=0.01)
    one_figure = machine(BLOCK_S)
    assert [four_row_reads(one_figure, model(h, n)) for h, n in ((576, 30), (2048, 2))] == pytest.approx([2.0, 2.0],
                                                                                                         rel=0.01)
    # a hardware file keeps the table
    again = hardware_from_dict(hardware_to_json(hardware))
    assert again.cpu.decode_streaming.row_reads_by_width == ((576, 4, 1.4), (2048, 4, 1.9))
    assert four_row_reads(again, model(576, 30)) == pytest.approx(thin)


def test_a_fit_of_the_reads_holds_for_every_width():
    """calibration.from_fitted: where a calibration fits the reads (profiles without measured steps), its figure
    replaces the measured table, which it was not fitted against."""
    eff = default_efficiency(with_reads_by_width(machine(BLOCK_S), ((576, 4, 1.4), (2048, 4, 1.9)))).accelerator
    fitted = from_fitted(eff, ("weight_reread_rows",), np.array([2.5]), "fitted")
    assert fitted.reread_rows_by_width == () and fitted.reread_rows_at(576) == fitted.reread_rows_at(2048) == 2.5
    assert eff.reread_rows_at(576) == pytest.approx(1.4)


def test_a_table_read_back_from_json_is_the_same_efficiency():
    """Efficiency.reread_rows_by_width comes back from JSON (calibration files, the app) as lists: the same pairs,
    and a width or reads out of range is refused by name."""
    eff = default_efficiency(with_reads_by_width(machine(BLOCK_S), ((576, 4, 1.4), (2048, 4, 1.9)))).accelerator
    again = efficiency_from_dict(json.loads(json.dumps(efficiency_to_dict(eff))))
    assert again == eff
    with pytest.raises(InputError, match="reread_rows_by_width"):
        dataclasses.replace(eff, reread_rows_by_width=((576, 4, 0.5),))
    with pytest.raises(InputError, match="small_row_reads_by_width"):
        doc = hardware_to_json(with_reads_by_width(machine(BLOCK_S), ((576, 4, 1.4),)))
        doc["cpu"]["decode_streaming"]["small_row_reads_by_width"] = {"576": 1.4}  # no rows
        hardware_from_dict(doc)


def test_an_eight_row_step_reads_as_measured_and_rows_between_in_proportion():
    """Session 16: an 8-row step read 576-wide blocks 2.4-3.0 times (the 4-row one 1.4-1.7): priced at the 4-row
    figure, as every row count beyond 4 was, a batch of 8 looked nearly free. With 8 rows measured, 8 rows read as
    measured at the model's width and 6 rows halfway between the 4- and 8-row figures."""
    hardware = with_reads_by_width(machine(BLOCK_S), ((576, 4, 1.4), (576, 8, 2.6), (2048, 4, 1.9), (2048, 8, 2.4)))
    thin, wide = model(576, 30), model(2048, 2)
    assert four_row_reads(hardware, thin, 8) == pytest.approx(2.6, rel=0.01)
    assert four_row_reads(hardware, wide, 8) == pytest.approx(2.4, rel=0.01)
    assert four_row_reads(hardware, thin, 6) == pytest.approx(2.0, rel=0.01)
    assert four_row_reads(hardware, thin, 2) == pytest.approx(1 + 0.4 / 3, rel=0.01)
    only_four = with_reads_by_width(machine(BLOCK_S), ((576, 4, 1.4), (2048, 4, 1.9)))
    assert four_row_reads(only_four, thin, 8) == pytest.approx(1.4, rel=0.01)  # the last measured figure beyond it
