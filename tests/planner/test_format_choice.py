"""planner/format_choice.py's menu and constraints (issue 16 item 3): quant_options lists exactly the --quant values
plan_constraints accepts for a GGUF (its own packed type on a CPU where the runtime packs, never bitsandbytes), and
bitsandbytes for a checkpoint only on a CUDA GPU; plan_constraints gives the search a GGUF's own format packed on a
CPU, and a serving goal the same beside the server's packed span. Small GGUF files are written with GGUFWriter (no
torch)."""

from __future__ import annotations

import gguf
import pytest

from hivekeeper.planner.errors import InputError
from hivekeeper.planner.format_choice import PACKED_ENV, packed_by_default, plan_constraints, quant_options
from hivekeeper.planner.hardware_catalog import get_hardware

from ..core.cli.test_models import write_gguf

CPU, CUDA, APPLE = (get_hardware(name) for name in ("cpu-generic", "rtx-4090", "apple-m2-ultra"))
CHECKPOINT = "Qwen/Qwen2.5-0.5B"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("format-choice")
    kinds = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0,
             "f16": gguf.GGMLQuantizationType.F16}
    return {name: str(write_gguf(folder / f"{name}.gguf", kind)) for name, kind in kinds.items()}


@pytest.mark.parametrize("name, hardware, packs, expected", [
    ("q8_0", CPU, True, ("auto", "q8_0", "none")),
    ("q4_0", CPU, True, ("auto", "q4_0", "none")),
    ("q4_0", CPU, False, ("auto", "none")),  # HIVEKEEPER_GGUF_PACKED=0: the runtime dequantizes
    ("q8_0", CUDA, True, ("auto", "none")),  # a GPU runs a GGUF dequantized
    ("f16", CPU, True, ("auto", "none")),  # no packed type to keep
])
def test_a_gguf_menu_is_what_plan_constraints_accepts(files, name, hardware, packs, expected):
    path = files[name]
    options = quant_options(path, hardware, runtime_packs=packs)
    assert options == expected
    packed = len(options) == 3  # its own type is offered: auto plans it too
    for quant in options:
        constraints, choice = plan_constraints(path, quant, hardware, "chat", runtime_packs=packs)
        runs = name if packed and quant != "none" else "none"
        assert (constraints.quant, constraints.packed_formats) == (runs, (runs,) if runs != "none" else ())
        assert choice.why
    for quant in ("int8", "nf4", *(other for other in ("q8_0", "q4_0", "q4_1") if other != name)):
        with pytest.raises(InputError):  # bitsandbytes and another packed type: the runtime does not re-quantize
            plan_constraints(path, quant, hardware, "chat", runtime_packs=packs)


def test_bitsandbytes_is_offered_for_a_checkpoint_on_a_cuda_gpu_only():
    assert quant_options(CHECKPOINT, CUDA) == ("auto", "none", "int8", "nf4")
    assert quant_options(CHECKPOINT, CPU) == ("auto", "none")
    assert quant_options(CHECKPOINT, APPLE) == ("auto", "none")  # unified memory: no CUDA
    with pytest.raises(InputError, match="not a GGUF"):
        plan_constraints(CHECKPOINT, "q4_0", CPU, "chat")


def test_constraints_carry_the_knobs_and_serve_plans_the_local_run_packed(files):
    reserve = {"cpu": 3e9}
    constraints, choice = plan_constraints(files["q8_0"], "auto", CPU, "batch", batch_size=8, reserve_bytes=reserve,
                                           runtime_packs=True)
    assert (constraints.quant, constraints.file_format, constraints.batch_size) == ("q8_0", "q8_0", 8)
    assert constraints.reserve_bytes == reserve and "kept packed" in choice.why
    served, why = plan_constraints(files["q8_0"], "auto", CPU, "serve", runtime_packs=True)
    assert (served.quant, served.packed_formats) == ("q8_0", ("q8_0",)) and why.why.startswith("serve:")
    assert served.packed_span is not None and served.packed_span.weight_format == "q8_0"


@pytest.mark.parametrize("value, packs", [(None, True), ("1", True), ("0", False), (" off ", False), ("no", False)])
def test_the_runtime_switch_is_read_here(monkeypatch, files, value, packs):
    if value is None:
        monkeypatch.delenv(PACKED_ENV, raising=False)
    else:
        monkeypatch.setenv(PACKED_ENV, value)
    assert packed_by_default() is packs
    assert ("q8_0" in quant_options(files["q8_0"], CPU)) is packs  # runtime_packs=None reads the switch
