"""The native kernels' decode attention (decode_kernels.c: attention_scores, attention_softmax, attention_values):
a KV head's query group is served from one read of its K and V rows, and a long context decodes as the torch code
does for grouped heads of any group size (the AVX2 path takes up to 4 query heads per pass over the keys, more in
several), head sizes on and off the 32-float path, a sliding window, and the pool's chunks (256 keys a chunk)."""

from __future__ import annotations

import pytest
import torch

from hivekeeper.core.runtime.kernels import native_kernels
from hivekeeper.core.runtime.kernels import cpu_decode
from hivekeeper.core.runtime.model import KVCache, ModelConfig, Span

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOL = 3e-4  # fp32 sums over ~300 keys in another order than torch's (the old per-head loop was as far off)
PROMPT, DECODE = 300, 4  # past a 256-key chunk of the scores pass and the pool's threshold


def config(heads: int, kv_heads: int, head_dim: int, window: int | None = None) -> ModelConfig:
    extra = dict(model_type="qwen2", use_sliding_window=True, sliding_window=window, max_window_layers=0) \
        if window else dict(model_type="llama")
    return ModelConfig.from_hf_config(dict(
        vocab_size=50, hidden_size=heads * head_dim, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=PROMPT + DECODE, **extra))


def random_span(cfg: ModelConfig) -> Span:
    torch.manual_seed(0)
    span = Span(cfg, 0, cfg.num_layers).eval()
    with torch.no_grad():
        for name, param in span.named_parameters():
            param.normal_(1.0, 0.2) if "norm" in name else param.normal_(0.0, 0.1)
    return span


def decode(span: Span, x: torch.Tensor, native: bool, monkeypatch) -> tuple[torch.Tensor, KVCache]:
    """A prefill of PROMPT tokens (torch), then one-token steps to the end of x natively or in torch."""
    monkeypatch.setattr(native_kernels, "ENABLED", native)
    monkeypatch.setattr(cpu_decode, "ENABLED", native)
    cache = KVCache.allocate(span.config, span.config.num_layers, batch=x.shape[0], max_length=x.shape[1])
    with torch.inference_mode():
        outputs = [span(x[:, :PROMPT], cache)]
        outputs += [span(x[:, i : i + 1], cache) for i in range(PROMPT, x.shape[1])]
    return torch.cat(outputs, dim=1), cache


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 1, 64), (10, 2, 64), (4, 2, 128),
                                                     (6, 2, 48), (4, 4, 16)])
def test_long_context_grouped_attention_equals_the_torch_code(native, heads, kv_heads, head_dim, monkeypatch):
    """Groups of 3 (SmolLM2), 8 (multi-query: two passes of 4), 5 (4 + 1), 2 with head_dim 128, a head_dim off the
    32-float path (48: one slice on it, one not) and plain multi-head attention with a tiny head_dim."""
    span = random_span(config(heads, kv_heads, head_dim))
    x = torch.randn(1, PROMPT + DECODE, span.config.hidden_size)
    out, _ = decode(span, x, True, monkeypatch)
    ref_out, _ = decode(span, x, False, monkeypatch)
    torch.testing.assert_close(out, ref_out, rtol=TOL, atol=TOL)


def test_a_sliding_window_over_a_long_context_equals_the_torch_code(native, monkeypatch):
    span = random_span(config(9, 3, 64, window=270))
    x = torch.randn(2, PROMPT + DECODE, span.config.hidden_size)
    out, _ = decode(span, x, True, monkeypatch)
    ref_out, _ = decode(span, x, False, monkeypatch)
    torch.testing.assert_close(out, ref_out, rtol=TOL, atol=TOL)


def test_one_thread_and_the_pool_give_the_same_bits(native, monkeypatch):
    span = random_span(config(9, 3, 64))
    x = torch.randn(1, PROMPT + DECODE, span.config.hidden_size)
    try:
        native.hk_set_threads(1)
        alone, _ = decode(span, x, True, monkeypatch)
        native.hk_set_threads(3)
        pooled, _ = decode(span, x, True, monkeypatch)
    finally:
        native.hk_set_threads(native_kernels.default_threads())
    assert torch.equal(alone, pooled)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 64), (6, 2, 12)])
def test_a_step_reads_each_cached_k_and_v_byte_once(native, heads, kv_heads, head_dim, monkeypatch):
    """Grouped query heads share their KV head's rows: one decode step's attention reads the cache's K and V once
    (layers x 2 x kv_heads x keys x head_dim floats), not once per query head (heads / kv_heads times more)."""
    span = random_span(config(heads, kv_heads, head_dim))
    x = torch.randn(1, PROMPT + 1, span.config.hidden_size)
    monkeypatch.setattr(native_kernels, "ENABLED", True)
    monkeypatch.setattr(cpu_decode, "ENABLED", True)
    cache = KVCache.allocate(span.config, span.config.num_layers, batch=1, max_length=x.shape[1])
    with torch.inference_mode():
        span(x[:, :PROMPT], cache)
        native_kernels.attention_bytes(reset=True)
        span(x[:, PROMPT:], cache)
    keys = PROMPT + 1
    assert native_kernels.attention_bytes() == span.config.num_layers * 2 * kv_heads * keys * head_dim * 4
