"""cpu_decode: the numpy decode step is taken only where it computes what Block.forward would, and equals it."""

import torch

from hivekeeper.core.runtime.kernels import cpu_decode
from hivekeeper.core.runtime.kernels.cpu_matmul import torch_threads
from hivekeeper.core.runtime.model import Block, KVCache, ModelConfig

CONFIG = ModelConfig.from_hf_config(dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48,
                                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2))


def test_taken_for_one_token_fp32_cpu_inference_on_one_torch_thread():
    block = Block(CONFIG).eval()
    k, v = KVCache.allocate(CONFIG, 1, batch=2, max_length=8).block(0)
    one_token, two_tokens = torch.randn(2, 1, 32), torch.randn(2, 2, 32)
    with torch_threads(1):
        with torch.inference_mode():
            assert cpu_decode.prepare(block, one_token, k) is not None
            assert cpu_decode.prepare(block, two_tokens, k) is None  # prefill: torch
            assert cpu_decode.prepare(block, one_token, None) is None  # no cache: a plain causal forward
            with torch_threads(2):
                assert cpu_decode.prepare(block, one_token, k) is None  # torch's threads would fight OpenBLAS's
        assert cpu_decode.prepare(block, one_token, k) is None  # autograd on: backward needs torch's ops
        with torch.inference_mode():
            assert cpu_decode.prepare(block.to(torch.bfloat16), one_token.bfloat16(), k.bfloat16()) is None


def decode_both_ways(block, x, config=None):
    """Five 1-token steps through the numpy path and through torch's: (outputs, caches) of each."""
    results = []
    with torch_threads(1), torch.inference_mode():
        for enabled in (True, False):
            cache = KVCache.allocate(config or CONFIG, 1, batch=x.shape[0], max_length=8)
            k, v = cache.block(0)
            cpu_decode.ENABLED = enabled
            try:
                out = torch.cat([block(x[:, i : i + 1], k, v, i) for i in range(x.shape[1])], dim=1)
            finally:
                cpu_decode.ENABLED = True
            results.append((out, cache))
    return results


def assert_same(results):
    (ours, our_cache), (torch_out, torch_cache) = results
    torch.testing.assert_close(ours, torch_out, rtol=1e-5, atol=1e-5)
    for a, b in ((our_cache.k, torch_cache.k), (our_cache.v, torch_cache.v)):
        torch.testing.assert_close(a[:, :, :, :5], b[:, :, :, :5], rtol=1e-5, atol=1e-5)


def test_numpy_step_equals_the_torch_step_and_follows_new_weights():
    torch.manual_seed(0)
    block = Block(CONFIG).eval()
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0.0, 0.3)
    x = torch.randn(2, 5, 32)
    assert_same(decode_both_ways(block, x))
    arrays = block.__dict__["_numpy_arrays"]
    # weights re-stored (as store_by_column does), then replaced by load_state_dict(assign=True): the numpy
    # views made for the old storage must not be used
    gate_up = block.mlp.gate_up_proj.weight
    gate_up.data = (gate_up.data * 2).t().contiguous().t()
    assert_same(decode_both_ways(block, x))
    assert block.__dict__["_numpy_arrays"] is not arrays
    state = {name: torch.randn_like(value) * 0.3 for name, value in block.state_dict().items()}
    block.load_state_dict(state, assign=True)
    assert_same(decode_both_ways(block, x))
    with torch.no_grad():
        block.self_attn.o_proj.weight.mul_(-1)  # filled in place (the engine's streamed slots): the views see it
    assert_same(decode_both_ways(block, x))


def test_biases_and_a_sliding_window_follow_the_torch_step():
    """Llama with attention_bias and mlp_bias (a bias on all four matmuls) and a 3-token window (Mistral-style)."""
    config = ModelConfig.from_hf_config(dict(model_type="mistral", vocab_size=64, hidden_size=32, intermediate_size=48,
                                             num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                             sliding_window=3))
    biased = ModelConfig.from_hf_config(dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48,
                                             num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=1,
                                             attention_bias=True, mlp_bias=True))
    for cfg in (config, biased):
        torch.manual_seed(1)
        block = Block(cfg).eval()
        with torch.no_grad():
            for param in block.parameters():
                param.normal_(0.0, 0.3)
        assert_same(decode_both_ways(block, torch.randn(2, 5, 32), cfg))
        assert block.__dict__["_numpy_arrays"].usable  # the numpy path ran
