"""The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF) run with its linears packed, as the local engine and a
swarm server both run it by default: the engine holds packed blocks and decodes the same greedy tokens as a packed
span; every packed layer's product on real activations is within its format's bound of the dequantized-fp32
product; and the perplexity of a fixed English text (tests/core/runtime/data/plain_facts.txt, written here) through
the quantized kernels is within 1% of the dequantized-fp32 perplexity."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from hivekeeper.planner.gguf_metadata import gguf_sizes

from hivekeeper.core.offload.local_plan import fallback_policy
from hivekeeper.core.offload.offloaded_model import OffloadedModel
from hivekeeper.core.offload.placement import place_model
from hivekeeper.core.runtime.checkpoint import load_embedding, load_head, load_span
from hivekeeper.core.runtime.default_model import INSTALL_HINT, default_model_file
from hivekeeper.core.runtime.gguf import PACKED_ENV, GGUFCheckpoint, PackedHead
from hivekeeper.core.runtime.kernels import native_kernels
from hivekeeper.core.runtime.kernels.quant_kernels import QuantizedLinear, activation_error_bound
from hivekeeper.core.runtime.model import KVCache

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(default_model_file() is None,
                                 reason=f"the default model is not installed ({INSTALL_HINT})")]

TEXT = Path(__file__).with_name("data") / "plain_facts.txt"
FP32_SLACK = 1e-5  # fp32 rounding, relative to sum |w x| (as in kernels/test_quant_kernels.py)
HEAD_ROWS_CHECKED = 4096  # the LM head's first outputs (of 49152): its float64 reference is what costs time


@pytest.fixture(scope="module")
def model():
    """(checkpoint, embedding, packed head, packed span, dequantized span, dequantized head) of the default model."""
    path = default_model_file()
    checkpoint = GGUFCheckpoint(path)
    layers = checkpoint.config.num_layers
    embedding = load_embedding(path)
    return (checkpoint, embedding, load_head(path, embedding=embedding, packed=True),
            load_span(path, 0, layers, packed=True), load_span(path, 0, layers, packed=False),
            load_head(path, embedding=embedding, packed=False))


def engine(path, monkeypatch, packed: str) -> OffloadedModel:
    """The local engine on the default model, everything in RAM, with HIVEKEEPER_GGUF_PACKED=`packed`."""
    monkeypatch.setenv(PACKED_ENV, packed)
    config = GGUFCheckpoint(path).config
    plan = place_model(config, fallback_policy("fp32", 1), device="cpu", dtype=torch.float32, batch=1,
                       max_length=64)
    return OffloadedModel(path, plan)


@torch.inference_mode()
def greedy(embedding, span, head, cache, prompt: list[int], new_tokens: int) -> list[int]:
    logits = head(span(embedding(torch.tensor([prompt])), cache)[:, -1:])[0, -1]
    tokens = []
    for _ in range(new_tokens):
        tokens.append(int(logits.argmax()))
        logits = head(span(embedding(torch.tensor([[tokens[-1]]])), cache))[0, -1]
    return tokens


def test_local_engine_runs_packed_blocks_like_a_served_span(model, monkeypatch):
    """The engine's resident blocks keep the file's Q4_1 linears packed (the bytes gguf_sizes' packed_block_bytes predicts, not
    4x more) and decode the same greedy tokens as a packed span (what `hivekeeper serve` loads);
    HIVEKEEPER_GGUF_PACKED=0 dequantizes them."""
    checkpoint, embedding, head, packed, *_ = model
    prompt = checkpoint.tokenizer().encode("The three primary colors are")
    with engine(checkpoint.path, monkeypatch, "1") as local:
        linears = [m for b in local.resident.values() for m in b.modules() if isinstance(m, QuantizedLinear)]
        assert len(linears) == 4 * checkpoint.config.num_layers
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for b in local.resident.values()
                    for t in [*b.buffers(), *b.parameters()]}  # distinct storages (pack_in_order shares one)
        tied = local.head.weight  # None where the engine keeps the head packed (issue 22)
        held = sum(storages.values()) - (0 if tied is None else tied.untyped_storage().nbytes() * (
            tied.untyped_storage().data_ptr() in storages))
        layers = checkpoint.config.num_layers
        assert held <= 1.01 * sum(gguf_sizes(checkpoint.path).packed_block_bytes)
        tokens = greedy(local.embedding, local.span, local.head, local.span.allocate_cache(1, 64), prompt, 8)
    cache = KVCache.allocate(packed.config, layers, 1, 64)
    assert tokens == greedy(embedding, packed, head, cache, prompt, 8)
    with engine(checkpoint.path, monkeypatch, "0") as local:
        assert not any(isinstance(m, QuantizedLinear) for b in local.resident.values() for m in b.modules())


def int8_rounded(x: np.ndarray) -> np.ndarray:
    """x [rows, cols] as the kernels round it, in float64: per block of 32, q = round-half-even(x / (max|x| / 127))
    in int8, times that scale (fp32)."""
    blocks = x.reshape(x.shape[0], -1, 32).astype(np.float32)
    scale = (np.abs(blocks).max(axis=2) / np.float32(127)).astype(np.float32)
    inverse = np.where(scale != 0, np.float32(1) / np.where(scale != 0, scale, 1), 0).astype(np.float32)
    q = np.rint(blocks * inverse[..., None]).astype(np.float64)
    return (q * scale[..., None].astype(np.float64)).reshape(x.shape)


def test_every_packed_layer_within_its_formats_bound(model):
    """Each packed linear of the 30 blocks and the Q8_0 LM head, on the activations a real prompt gives it (a prompt
    of at most MAX_ROWS tokens: each product runs on the multi-row int8 kernels), against its dequantized-fp32
    weights: within the activations' rounding bound (quant_kernels.activation_error_bound) plus fp32 rounding; and
    equal, within fp32 rounding, to the int8-rounded activations times the dequantized weights. That second check is
    why packed decode's logits differ from the dequantized span's (and the batched path's) by ~2-3% of the largest
    logit (issue 16; docs/performance.md): no wrong scale, rounding mode, Q4_1 min or head, only the activations'
    int8 rounding (as llama.cpp's), ~1% of each layer's output, through 30 layers."""
    checkpoint, embedding, head, packed, *_ = model
    if native_kernels.library() is None:
        pytest.skip(f"the native kernels are off: {native_kernels.status()}")
    seen: list[tuple[QuantizedLinear, np.ndarray, np.ndarray]] = []
    def keep(module, args, out):  # copies: the block changes some outputs in place (rotary)
        seen.append((module, args[0].numpy().copy(), out.numpy().copy()))

    layers = [m for m in packed.modules() if isinstance(m, QuantizedLinear)] + [head.lm_head]
    hooks = [m.register_forward_hook(keep) for m in layers]
    prompt = checkpoint.tokenizer().encode("Bees make honey from")
    assert 1 < len(prompt) <= native_kernels.MAX_ROWS
    try:
        with torch.inference_mode():
            head(packed(embedding(torch.tensor([prompt])), KVCache.allocate(packed.config, 30, 1, len(prompt))))
    finally:
        for hook in hooks:
            hook.remove()
    assert len(seen) == 4 * checkpoint.config.num_layers + 1 and seen[-1][0].fmt.name == "q8_0"
    for module, x, y in seen:
        outs = min(module.out_features, HEAD_ROWS_CHECKED)
        weight = module.matrix.dequantize(0, outs).astype(np.float64)
        rows = x.reshape(-1, module.in_features).astype(np.float64)
        bias = 0.0 if module.bias is None else module.bias.numpy()[:outs].astype(np.float64)
        exact = rows @ weight.T + bias
        slack = FP32_SLACK * (np.abs(rows) @ np.abs(weight).T + np.abs(bias))
        bound = activation_error_bound(weight, rows) + slack
        y = y.reshape(len(rows), -1)[:, :outs]
        assert (np.abs(y - exact) <= bound).all(), (module.fmt.name, outs, float((np.abs(y - exact) - bound).max()))
        emulated = int8_rounded(x.reshape(-1, module.in_features)) @ weight.T + bias
        assert (np.abs(y - emulated) <= slack).all(), (module.fmt.name, outs)


@torch.inference_mode()
def perplexity(embedding, span, head, tokens: list[int], chunk: int) -> float:
    """exp(mean negative log-likelihood) of tokens[1:] given the ones before, fed `chunk` tokens at a time."""
    cache = KVCache.allocate(span.config, span.config.num_layers, 1, len(tokens))
    nll, count = 0.0, 0
    for start in range(0, len(tokens) - 1, chunk):
        part = tokens[start:min(start + chunk, len(tokens) - 1)]
        logits = head(span(embedding(torch.tensor([part])), cache))[0].double()
        targets = torch.tensor(tokens[start + 1:start + 1 + len(part)])
        nll -= float(torch.log_softmax(logits, dim=-1)[torch.arange(len(part)), targets].sum())
        count += len(part)
    return math.exp(nll / count)


def test_perplexity_of_plain_text_within_one_percent(model):
    """A few hundred tokens of plain facts: through the packed span and the packed LM head (the file's Q8_0 tied
    embedding) fed MAX_ROWS tokens at a time (every product on the int8 kernels), the perplexity is within 1% of
    the dequantized-fp32 span's and head's, and low (the model reads
    English: an untrained model would score about the vocabulary size)."""
    checkpoint, embedding, head, packed, dequantized, head_fp32 = model
    if native_kernels.library() is None:
        pytest.skip(f"the native kernels are off: {native_kernels.status()}")
    tokens = checkpoint.tokenizer().encode(TEXT.read_text())
    assert 250 <= len(tokens) <= 400
    assert isinstance(head, PackedHead) and not isinstance(head_fp32, PackedHead)
    quantized = perplexity(embedding, packed, head, tokens, native_kernels.MAX_ROWS)
    reference = perplexity(embedding, dequantized, head_fp32, tokens, 64)
    assert reference < 50, reference
    print(f"perplexity: packed {quantized:.4f}, dequantized fp32 {reference:.4f}")
    assert abs(quantized - reference) <= 0.01 * reference, (quantized, reference)
