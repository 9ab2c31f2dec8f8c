"""The model library's "fits here" plans a GGUF as `generate` runs it (issue 16 item 3): its own Q8_0/Q4_0/Q4_1
weights packed in RAM on a CPU, not dequantized to fp32. The real default model (SmolLM2-135M-Instruct, Q4_1) on a
machine with RAM for its packed plan but not for a dequantized one fits; a small Q8_0 file written with GGUFWriter is
planned in q8_0, an F16 one dequantized; the rows' sizes are the files' bytes."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from hivekeeper.core.runtime import library
from hivekeeper.core.runtime.default_model import default_model_file
from hivekeeper.planner.format_choice import plan_constraints
from hivekeeper.planner.hardware import default_headroom
from hivekeeper.planner.hardware_catalog import resolve_hardware
from hivekeeper.planner.model_catalog import load_model_spec
from hivekeeper.planner.policy import Constraints, search

from ..cli.test_models import write_gguf

GIB = 2**30


def ram_peak(path: str, hardware, constraints: Constraints) -> float:
    plan = search(load_model_spec(path), hardware, "chat", constraints)
    return plan.prediction.peak_memory_bytes["cpu"]


def machine_between(path: str):
    """cpu-generic with RAM (beyond the 2 GiB kept free) 20 MB above the packed plan's peak, and almost no disk
    (nothing streams): a dequantized plan (fp32 or 16-bit blocks, >100 MB more) does not fit there."""
    roomy = resolve_hardware("cpu-generic", ram_gb=16)
    packed = ram_peak(path, roomy, plan_constraints(path, "auto", roomy, "chat")[0])
    dequantized = ram_peak(path, roomy, Constraints(quant="none"))
    assert dequantized - packed > 100e6
    hardware = resolve_hardware("cpu-generic", ram_gb=(2 * GIB + packed + 20e6) / 1e9, disk_gb=0.001)
    assert default_headroom(hardware)["cpu"] == 2 * GIB
    return hardware


def test_the_default_gguf_fits_as_its_packed_weights():
    file = default_model_file()
    if file is None:
        pytest.skip("the built-in model is not installed (make test installs it)")
    path = str(file)
    hardware = machine_between(path)
    words, reason = library.model_fit(path, hardware)
    assert words == "fits here" and "q4_1 weights" in reason, reason
    # as fp32 (what the library planned before) it would not fit there
    before = search(load_model_spec(path), hardware, "chat", Constraints(reserve_bytes=default_headroom(hardware)))
    assert before.fit != "local"
    row = library.bundled_models()[0]
    assert row.quantization == "Q4_1" and row.size_bytes == file.stat().st_size


def test_small_gguf_files_are_planned_in_the_format_they_run_in(tmp_path, monkeypatch):
    folder = tmp_path / "models"
    write_gguf(folder / "small-q8.gguf", gguf.GGMLQuantizationType.Q8_0)
    write_gguf(folder / "small-f16.gguf", gguf.GGMLQuantizationType.F16)
    monkeypatch.setenv(library.MODELS_DIR_ENV, str(folder))
    rows = {row.id: row for row in library.our_models()}
    library.add_fits(list(rows.values()), resolve_hardware("cpu-generic"))
    q8, f16 = rows["small-q8.gguf"], rows["small-f16.gguf"]
    assert (q8.quantization, f16.quantization) == ("Q8_0", "F16")
    assert q8.fit == f16.fit == "fits here"
    assert "q8_0 weights" in q8.fit_reason and "q8_0" not in f16.fit_reason, (q8.fit_reason, f16.fit_reason)
    for row in (q8, f16):
        assert row.size_bytes == Path(row.path).stat().st_size
    monkeypatch.setenv("HIVEKEEPER_GGUF_PACKED", "0")  # the runtime's switch: the file is then run dequantized
    words, reason = library.model_fit(q8.path, resolve_hardware("cpu-generic"))
    assert words == "fits here" and "q8_0" not in reason
