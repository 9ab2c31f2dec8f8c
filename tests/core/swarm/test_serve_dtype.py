"""`hivekeeper serve --dtype auto` on a CPU computes in the dtype the planner's server rule names
(swarm.choose_server_format: bf16 where the CPU multiplies bf16 natively and a measured bf16 decode step beat fp32's,
else fp32), except a GGUF whose blocks the runtime keeps packed (fp32, as format_choice.plan_model_server plans that
span); its "Serving N blocks" line says the dtype and why. The CPU is simulated: pinned flags and a saved profile
with the measured step (bf16_measured_cpu, tests/core/conftest.py).

The user's path: the real `hivekeeper serve` in a child, on loopback, whose "online" event says what its span holds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess

import gguf
import pytest
import torch

from hivekeeper.core.child_argv import hivekeeper_command
from hivekeeper.core.cli.serve import auto_dtype, planned_span
from hivekeeper.core.machine.cpu_dtype import dtype_name
from hivekeeper.core.runtime.checkpoint import load_config
from hivekeeper.planner.format_choice import PACKED_ENV

from ...child_output import ChildOutput
from ..cli.test_models import write_gguf

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CACHE_TOKENS = 256


@pytest.mark.parametrize("native_bf16, step_ratio, expected", [
    (True, 0.6, torch.bfloat16),  # native bf16 math, a bf16 step measured faster
    (True, 1.4, torch.float32),  # native, measured slower
    (False, 0.6, torch.float32),  # no native bf16 math: 16-bit matmuls would be emulated
])
def test_auto_on_a_cpu_is_the_planners_server_format(tiny_checkpoint, bf16_measured_cpu, native_bf16, step_ratio,
                                                     expected):
    bf16_measured_cpu(native_bf16, step_ratio)
    dtype, why = auto_dtype(load_config(tiny_checkpoint), "cpu", tiny_checkpoint)
    assert dtype == expected, why
    assert (f"{step_ratio:.2f}x" in why) == native_bf16  # the measurement is the reason where it decides
    plan = planned_span(tiny_checkpoint, dtype, "cpu", "none", CACHE_TOKENS)
    assert plan.weight_format == dtype_name(dtype)  # serve's span is sized by the plan of the same format


@pytest.mark.parametrize("kind, packs, expected, planned", [
    (gguf.GGMLQuantizationType.Q8_0, True, torch.float32, "q8_0"),  # kept packed: fp32, planned packed
    (gguf.GGMLQuantizationType.Q8_0, False, torch.bfloat16, "bf16"),  # HIVEKEEPER_GGUF_PACKED=0: dequantized
    (gguf.GGMLQuantizationType.F16, True, torch.bfloat16, "bf16"),  # no packed type: dequantized
])
def test_a_gguf_kept_packed_is_served_in_fp32_as_planned(tmp_path, bf16_measured_cpu, monkeypatch, kind, packs,
                                                         expected, planned):
    bf16_measured_cpu()  # bf16 measured faster
    monkeypatch.setenv(PACKED_ENV, "1" if packs else "0")
    path = write_gguf(tmp_path / "model.gguf", kind)
    dtype, why = auto_dtype(load_config(path), "cpu", path)
    assert dtype == expected, why
    assert ("stay packed" in why) == (expected == torch.float32)
    assert planned_span(path, dtype, "cpu", "none", CACHE_TOKENS).weight_format == planned


def test_auto_keeps_fp32_beside_quantized_weights_and_16_bits_on_a_gpu(tiny_checkpoint, bf16_measured_cpu):
    bf16_measured_cpu()
    config = load_config(tiny_checkpoint)  # stores fp32
    assert auto_dtype(config, "cpu", tiny_checkpoint, "int8")[0] == torch.float32
    assert auto_dtype(config, "cuda", tiny_checkpoint)[0] == torch.bfloat16


@pytest.mark.slow
def test_serve_says_and_serves_the_auto_dtype(tiny_checkpoint, bf16_measured_cpu):
    """The real command in a child (its pinned flags and profile inherited): bf16 planned, said and loaded."""
    bf16_measured_cpu(step_ratio=0.6)
    child = ChildOutput(subprocess.Popen(
        hivekeeper_command("serve", "--model", str(tiny_checkpoint), "--new-swarm", "--host", "127.0.0.1",
                           "--device", "cpu", "--cache-tokens", str(CACHE_TOKENS), "--throughput", "1",
                           "--json-status", "--stats-period", "0"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ)))
    try:
        child.wait_for(r"Serving 2 blocks, bf16 \(planned for this machine's memory; --dtype auto: bf16, [^\n]*bf16 "
                       r"decode step measured 0\.60x the time of fp32", timeout=120, stream="stderr")
        online = json.loads(child.wait_for(r'\{[^\n]*"state": "online"[^\n]*\}', timeout=120).group(0))
        assert online["weights"]["hidden_dtype"] == "bfloat16"  # Petals' name
        assert set(online["weights"]["bytes"]) == {"bfloat16"}  # the span's weights held in bf16, as planned
        child.proc.send_signal(signal.SIGTERM)
        assert child.wait(60) == 0
    finally:
        child.close()
