"""cpu_decode.eligible: the numpy decode step is taken only where it computes what Block.forward would."""

import torch

from hivekeeper.core import cpu_decode
from hivekeeper.core.cpu_matmul import torch_threads
from hivekeeper.core.model import Block, KVCache, ModelConfig

CONFIG = ModelConfig.from_hf_config(dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48,
                                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2))


def test_taken_for_one_token_fp32_cpu_inference_on_one_torch_thread():
    block = Block(CONFIG).eval()
    k, v = KVCache.allocate(CONFIG, 1, batch=2, max_length=8).block(0)
    one_token, two_tokens = torch.randn(2, 1, 32), torch.randn(2, 2, 32)
    with torch_threads(1):
        with torch.inference_mode():
            assert cpu_decode.eligible(block, one_token, k)
            assert not cpu_decode.eligible(block, two_tokens, k)  # prefill: torch
            assert not cpu_decode.eligible(block, one_token, None)  # no cache: a plain causal forward
            with torch_threads(2):
                assert not cpu_decode.eligible(block, one_token, k)  # torch's threads would fight OpenBLAS's
        assert not cpu_decode.eligible(block, one_token, k)  # autograd on: backward needs torch's ops
        with torch.inference_mode():
            assert not cpu_decode.eligible(block.to(torch.bfloat16), one_token.bfloat16(), k.bfloat16())


def test_numpy_step_equals_the_torch_step():
    torch.manual_seed(0)
    block = Block(CONFIG).eval()
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0.0, 0.3)
    x = torch.randn(2, 5, 32)
    caches = [KVCache.allocate(CONFIG, 1, batch=2, max_length=8) for _ in range(2)]
    outputs = []
    with torch_threads(1), torch.inference_mode():
        for cache, enabled in zip(caches, (True, False)):
            cpu_decode.ENABLED = enabled
            try:
                k, v = cache.block(0)
                outputs.append(torch.cat([block(x[:, i : i + 1], k, v, i) for i in range(5)], dim=1))
            finally:
                cpu_decode.ENABLED = True
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(caches[0].k[:, :, :, :5], caches[1].k[:, :, :, :5], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(caches[0].v[:, :, :, :5], caches[1].v[:, :, :, :5], rtol=1e-5, atol=1e-5)
