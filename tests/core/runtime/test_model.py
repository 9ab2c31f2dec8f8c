"""Our Llama-family runtime against transformers' reference implementation, on tiny random checkpoints of each family.

Each reference model is built with random weights (norms and biases randomised too, so they matter), saved as a real
HF checkpoint with save_pretrained, loaded back with our loader and compared in fp32 within 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from hivekeeper.core.runtime.kernels import cpu_decode

from hivekeeper.core.runtime.kernels import native_kernels
from hivekeeper.core.runtime.checkpoint import load_embedding, load_head, load_span
from hivekeeper.core.runtime.model import KVCache, ModelConfig, Span, rope_inverse_frequencies
from hivekeeper.planner.errors import InputError

transformers = pytest.importorskip("transformers")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


TOL = 1e-5
VOCAB, LAYERS, MAX_POS = 96, 4, 128
PROMPT, CHUNKED, DECODE = 12, 8, 20  # prefill tokens, then a chunked prefill, then one-token decode steps
SEQ = PROMPT + CHUNKED + DECODE

FAMILIES = {
    "llama": dict(num_attention_heads=4, num_key_value_heads=2),
    # Llama-3.1 rope scaling (low, medium and high frequency bands all present at head_dim 16) and tied embeddings
    "llama3": dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    # a window shorter than the sequence, so windowed attention is exercised in prefill, chunks and decode
    "mistral": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=7),
    "qwen2": dict(num_attention_heads=4, num_key_value_heads=2),
    # Qwen2's optional window applies to layers >= max_window_layers only
    "qwen2-window": dict(num_attention_heads=4, num_key_value_heads=4, use_sliding_window=True, sliding_window=5,
                         max_window_layers=2),
}


def build_reference(family: str, path, **overrides):
    """A random tiny HF model of `family`, saved as a safetensors checkpoint in `path`."""
    kind = family.split("-")[0].replace("llama3", "llama")
    config_class = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
                    "qwen2": transformers.Qwen2Config}[kind]
    model_class = {"llama": transformers.LlamaForCausalLM, "mistral": transformers.MistralForCausalLM,
                   "qwen2": transformers.Qwen2ForCausalLM}[kind]
    kwargs = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
                  max_position_embeddings=MAX_POS, initializer_range=0.1, rms_norm_eps=1e-5)
    kwargs.update(FAMILIES[family])
    kwargs.update(overrides)
    torch.manual_seed(0)
    model = model_class(config_class(**kwargs)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.2)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    return model


def reference_layer_outputs(model, token_ids: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Inputs of layer 0 and outputs of every decoder layer (before the final norm), and the logits."""
    captured = []
    hooks = [layer.register_forward_hook(lambda _m, _i, out: captured.append(out[0] if isinstance(out, tuple) else out))
             for layer in model.model.layers]
    with torch.no_grad():
        result = model(token_ids, output_hidden_states=True)
    for hook in hooks:
        hook.remove()
    return [result.hidden_states[0]] + captured, result.logits


@pytest.fixture(scope="module", params=list(FAMILIES))
def reference(request, tmp_path_factory):
    family = request.param
    path = tmp_path_factory.mktemp(family)
    model = build_reference(family, path)
    torch.manual_seed(1)
    token_ids = torch.randint(0, VOCAB, (2, SEQ))
    hidden, logits = reference_layer_outputs(model, token_ids)
    return family, path, token_ids, hidden, logits, model


@pytest.fixture(params=["native-decode", "numpy-decode", "torch-decode"])
def decode_path(request, monkeypatch):
    """Run 1-token steps through the C kernels (one call per span), cpu_decode's numpy step or Block.forward's torch
    code; yields (path, batch, calls of that path)."""
    path = request.param
    if path == "native-decode" and native_kernels.library() is None:
        pytest.skip(f"native kernels {native_kernels.status()}")
    monkeypatch.setattr(native_kernels, "ENABLED", path == "native-decode")
    monkeypatch.setattr(cpu_decode, "ENABLED", path != "torch-decode")
    calls = []
    name = "decode_blocks" if path == "native-decode" else "decode_step"
    real = getattr(cpu_decode, name)
    monkeypatch.setattr(cpu_decode, name, lambda *args: (lambda out: calls.append(out is not None) or out)(real(*args)))
    return path, 2, calls


def expected_calls(decode_path, layers: int) -> list[bool]:
    path, _, calls = decode_path
    if path == "native-decode":
        return [True] * DECODE  # one call per token for all the span's blocks, each taken natively
    return [True] * (layers * DECODE) if path == "numpy-decode" else []


def run_with_cache(span: Span, inputs: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """A prefill of PROMPT tokens, a chunked prefill of CHUNKED tokens (chunks of 3), then DECODE 1-token steps."""
    outputs = [span(inputs[:, :PROMPT], cache)]
    outputs.append(span.prefill(inputs[:, PROMPT : PROMPT + CHUNKED], cache, chunk_tokens=3))
    for position in range(PROMPT + CHUNKED, SEQ):
        outputs.append(span(inputs[:, position : position + 1], cache))
    return torch.cat(outputs, dim=1)


def test_full_model_logits_match(reference):
    family, path, token_ids, _, ref_logits, _ = reference
    embedding = load_embedding(path)
    span = load_span(path, 0, LAYERS)
    head = load_head(path, embedding=embedding)
    with torch.inference_mode():
        logits = head(span(embedding(token_ids)))
    assert logits.shape == ref_logits.shape
    assert (logits - ref_logits).abs().max().item() <= TOL


def test_full_model_logits_match_through_cache(reference, decode_path):
    family, path, token_ids, _, ref_logits, _ = reference
    batch = decode_path[1]
    embedding, span, head = load_embedding(path), load_span(path, 0, LAYERS), load_head(path)
    cache = KVCache.allocate(span.config, LAYERS, batch=batch, max_length=SEQ)
    with torch.inference_mode():
        logits = head(run_with_cache(span, embedding(token_ids[:batch]), cache))
    assert cache.length == SEQ
    assert (logits - ref_logits[:batch]).abs().max().item() <= TOL
    assert decode_path[2] == expected_calls(decode_path, LAYERS)


@pytest.mark.parametrize("start,end", [(1, 3), (3, 4)])
def test_span_hidden_states_match_through_prefill_chunks_and_decode(reference, start, end, decode_path):
    family, path, _, hidden, _, _ = reference
    batch = decode_path[1]
    span = load_span(path, start, end)
    assert (span.start, span.end, len(span.blocks)) == (start, end, end - start)
    cache = KVCache.allocate(span.config, end - start, batch=batch, max_length=SEQ + 4)
    with torch.inference_mode():
        out = run_with_cache(span, hidden[start][:batch], cache)
        plain = span(hidden[start][:batch])  # no cache: one causal forward
    assert (out - hidden[end][:batch]).abs().max().item() <= TOL
    assert (plain - hidden[end][:batch]).abs().max().item() <= TOL
    assert decode_path[2] == expected_calls(decode_path, end - start)


def test_backward_through_the_blocks_matches(reference):
    """Gradients w.r.t. the input hidden states (what a server's rpc_backward returns) match the reference."""
    family, path, _, hidden, _, model = reference
    span, head = load_span(path, 0, LAYERS), load_head(path)
    x = hidden[0].detach().clone().requires_grad_(True)
    torch.manual_seed(3)
    grad_logits = torch.randn(2, SEQ, VOCAB)
    (head(span(x)) * grad_logits).sum().backward()
    x_ref = hidden[0].detach().clone().requires_grad_(True)
    (model(inputs_embeds=x_ref).logits * grad_logits).sum().backward()
    scale = x_ref.grad.abs().max().item()  # gradients here reach ~1e2 (the input rms is ~0.1): compare relatively
    assert scale > 1e-3
    assert (x.grad - x_ref.grad).abs().max().item() <= TOL * scale


def test_sliding_window_changes_the_result(tmp_path):
    """Guards the mistral case above: with a window shorter than the sequence the outputs really differ."""
    windowed = build_reference("mistral", tmp_path / "w")
    full = build_reference("mistral", tmp_path / "f", sliding_window=None)
    token_ids = torch.randint(0, VOCAB, (1, 24))
    with torch.no_grad():
        assert (windowed(token_ids).logits - full(token_ids).logits).abs().max() > 1e-3
    assert load_span(tmp_path / "w", 0, 1).blocks[0].self_attn.window == 7
    assert load_span(tmp_path / "f", 0, 1).blocks[0].self_attn.window is None


def test_reorder_and_truncate(reference):
    family, path, _, hidden, _, _ = reference
    span = load_span(path, 0, 2)
    x = hidden[0]
    with torch.inference_mode():
        cache = KVCache.allocate(span.config, 2, batch=2, max_length=SEQ)
        span(x[:, :10], cache)
        cache.reorder(torch.tensor([1, 1]))  # both rows continue row 1's prefix
        step = span(x[1:2, 10:11].expand(2, -1, -1).contiguous(), cache)  # row 1's next token in both rows
        assert (step - hidden[2][1:2, 10:11]).abs().max().item() <= TOL
        # rewinding to 5 tokens and replaying tokens 5..10 of row 1 reproduces the reference
        cache.truncate(5)
        replay = span(x[1:2, 5:11].expand(2, -1, -1).contiguous(), cache)
        assert (replay - hidden[2][1:2, 5:11]).abs().max().item() <= TOL
        assert cache.length == 11
    with pytest.raises(InputError):
        cache.truncate(12)


def test_bf16_span_is_close_to_fp32(reference):
    family, path, _, hidden, _, _ = reference
    span = load_span(path, 1, 3, dtype="bf16")
    assert span.dtype == torch.bfloat16
    cache = KVCache.allocate(span.config, 2, batch=2, max_length=SEQ, dtype=torch.bfloat16)
    with torch.inference_mode():
        out = run_with_cache(span, hidden[1].bfloat16(), cache).float()
    # bf16 keeps 8 mantissa bits: relative error of a few 1e-3 per op, compounded over two blocks
    relative = (out - hidden[3]).norm() / hidden[3].norm()
    assert relative < 0.03


def test_cache_accounting_and_limits(tmp_path):
    build_reference("llama", tmp_path)
    config = ModelConfig.from_folder(tmp_path)
    cache = KVCache.allocate(config, 3, batch=2, max_length=16, dtype=torch.float16)
    assert cache.k.shape == (3, 2, config.num_kv_heads, 16, config.head_dim)
    assert cache.nbytes == KVCache.nbytes_for(config, 3, 2, 16, torch.float16) == 2 * 3 * 2 * 2 * 16 * 16 * 2
    span = load_span(tmp_path, 0, 3)
    small = KVCache.allocate(config, 3, batch=1, max_length=4)
    with torch.inference_mode():
        span(torch.zeros(1, 0, 64), small)  # a zero-token step is valid and stores nothing
        assert small.length == 0
        span(torch.randn(1, 4, 64), small)
        with pytest.raises(InputError, match="max_length 4"):
            span(torch.randn(1, 1, 64), small)
        with pytest.raises(InputError, match="batch"):
            span(torch.randn(2, 1, 64), KVCache.allocate(config, 3, batch=1, max_length=4))
        with pytest.raises(InputError, match="3 blocks, the span has 2"):
            load_span(tmp_path, 0, 2)(torch.randn(1, 1, 64), small)
        with pytest.raises(InputError, match="max_position_embeddings"):
            span(torch.randn(1, MAX_POS + 1, 64))
    with pytest.raises(InputError, match="max_position_embeddings"):
        KVCache.allocate(config, 1, 1, MAX_POS + 1)


def test_config_parsing_both_rope_layouts():
    base = dict(model_type="llama", vocab_size=10, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=64)
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8}
    v4 = ModelConfig.from_hf_config({**base, "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **scaling}})
    v5 = ModelConfig.from_hf_config({**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0,
                                                                  **scaling}})
    assert v4 == v5 and v4.rope_scaling["factor"] == 8.0 and v4.num_kv_heads == 4 and v4.head_dim == 8
    plain = ModelConfig.from_hf_config({**base, "rope_theta": 500000.0})
    assert not torch.equal(rope_inverse_frequencies(plain), rope_inverse_frequencies(v4))
    qwen = ModelConfig.from_hf_config({**base, "model_type": "qwen2", "eos_token_id": [3, 4]})
    assert qwen.qkv_bias and qwen.eos_token_ids == (3, 4) and qwen.sliding_window is None
    with pytest.raises(InputError, match="yarn"):
        ModelConfig.from_hf_config({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, source="x.json")
    with pytest.raises(InputError, match="x.json.*'hidden_size'"):
        ModelConfig.from_hf_config({k: v for k, v in base.items() if k != "hidden_size"}, source="x.json")
