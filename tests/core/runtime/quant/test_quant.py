"""int8 / nf4 spans through bitsandbytes, on CPU (the CUDA path is the same code; it is not exercised here).

Two checks per format: the quantized span computes exactly what an fp32 span with bitsandbytes' dequantized weights
computes (so the wiring is right), and it stays within a stated distance of the original fp32 span (so the
quantization itself is sane). Measured on this config: relative error ~0.016 (int8) and ~0.2 (nf4) after two
blocks; the bounds below leave about 2x room.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hivekeeper.core.runtime.checkpoint import load_span
from hivekeeper.core.runtime.model import KVCache
from hivekeeper.core.runtime.quant.bnb import check_quant, quantize_block, weight_bytes
from hivekeeper.planner.errors import InputError
from hivekeeper.planner.formats import get_format

transformers = pytest.importorskip("transformers")


pytestmark = pytest.mark.usefixtures("one_torch_thread", "bnb")  # bnb: conftest.py, skips without it


RELATIVE_BOUND = {"int8": 0.04, "nf4": 0.4}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("quant")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1)
    transformers.LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return path


def dequantized(linear: nn.Module, bnb) -> torch.Tensor:
    """The fp32 weight a bitsandbytes linear actually multiplies by."""
    weight = linear.weight
    if isinstance(linear, bnb.nn.Linear4bit):
        return bnb.functional.dequantize_4bit(weight.data, weight.quant_state).float()
    scales = weight.SCB if getattr(weight, "SCB", None) is not None else linear.state.SCB
    return weight.data.float() * scales.float()[:, None] / 127.0


def run(span, hidden):
    """A prefill of 6 tokens and 4 decode steps through a cache, concatenated."""
    cache = KVCache.allocate(span.config, len(span.blocks), batch=hidden.shape[0], max_length=16, dtype=span.dtype)
    with torch.inference_mode():
        outputs = [span(hidden[:, :6], cache)] + [span(hidden[:, i : i + 1], cache) for i in range(6, 10)]
    return torch.cat(outputs, dim=1).float()


@pytest.mark.parametrize("quant", ["int8", "nf4"])
def test_quantized_span_matches_its_dequantized_weights_and_is_close_to_fp32(checkpoint, quant, bnb):
    fp32 = load_span(checkpoint, 1, 3)
    quantized = load_span(checkpoint, 1, 3, quant=quant)
    linears = {name: m for name, m in quantized.named_modules() if isinstance(m, (bnb.nn.Linear8bitLt, bnb.nn.Linear4bit))}
    assert len(linears) == 2 * 4  # qkv, o, gate_up, down in each block
    stored = {linear.weight.dtype for linear in linears.values()}
    assert stored == ({torch.int8} if quant == "int8" else {torch.uint8})

    reference = load_span(checkpoint, 1, 3)  # fp32 with the weights bitsandbytes really uses
    with torch.no_grad():
        for name, module in reference.named_modules():
            if name in linears:
                module.weight.copy_(dequantized(linears[name], bnb))
    torch.manual_seed(2)
    hidden = torch.randn(2, 10, 128)
    out, exact, original = run(quantized, hidden), run(reference, hidden), run(fp32, hidden)
    assert (out - exact).abs().max().item() <= 1e-4 * max(1.0, exact.abs().max().item())
    relative = ((out - original).norm() / original.norm()).item()
    assert 1e-4 < relative < RELATIVE_BOUND[quant]  # really quantized, and close


@pytest.mark.parametrize("quant", ["int8", "nf4"])
def test_quantized_storage_matches_the_planners_format(checkpoint, quant):
    span = load_span(checkpoint, 0, 1, quant=quant)
    block = span.blocks[0]
    linear_params = sum(m.in_features * m.out_features for m in block.modules() if hasattr(m, "in_features"))
    stored = weight_bytes(block) - 2 * 128 * 4  # minus the two fp32 norms
    assert stored == pytest.approx(linear_params * get_format(quant).bytes_per_param, rel=0.05)


def test_nf4_with_bf16_compute(checkpoint):
    span = load_span(checkpoint, 0, 2, dtype="bf16", quant="nf4")
    assert span.dtype == torch.bfloat16
    fp32 = load_span(checkpoint, 0, 2)
    hidden = torch.randn(1, 10, 128)
    relative = ((run(span, hidden.bfloat16()) - run(fp32, hidden)).norm() / run(fp32, hidden).norm()).item()
    assert relative < RELATIVE_BOUND["nf4"]


def test_bad_quant_names():
    assert check_quant("NF4") == "nf4" and check_quant(None) == "none"
    with pytest.raises(InputError, match="fp8"):
        check_quant("fp8")
    with pytest.raises(InputError, match="int4"):
        quantize_block(nn.Linear(4, 4), "int4", "cpu")
