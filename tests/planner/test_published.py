"""Predictions against the published measurements in shared/reference/published.md.

Each test says the tolerance it reaches; they are what the model gives with its default efficiency sets and the
catalog's hardware, not tuned to pass. Where a published number is out of reach of the catalog's hardware numbers,
the test asserts that honest bound instead, and docs/cost-model.md records the miss.
"""

from __future__ import annotations

import pytest

from hivekeeper.planner.costmodel import Placement, Policy, Workload, block_weight_bytes, evaluate, kv_cache_bytes
from hivekeeper.planner.hardware_catalog import get_hardware
from hivekeeper.planner.model_catalog import get_model
from hivekeeper.planner.models import ModelSpec
from hivekeeper.planner.swarm import CACHE_TOKENS_GQA, plan_server

FLEXGEN_WORKLOAD = Workload(prompt_len=512, output_len=32)


def flexgen_machine(**overrides):
    return get_hardware("t4-flexgen", **overrides)  # 1× T4 16 GB, 208 GB DRAM, 1.5 TB SSD


def relative_error(predicted: float, published: float) -> float:
    return abs(predicted - published) / published


def test_flexgen_opt_6_7b_all_on_gpu_within_10_percent():
    # FlexGen 25.26 tokens/s and HF Accelerate 25.12 at batch 2, everything on the T4
    pred = evaluate(get_model("facebook/opt-6.7b"), flexgen_machine(), Policy("fp16", micro_batch_size=2),
                    FLEXGEN_WORKLOAD)
    assert pred.fits
    assert relative_error(pred.throughput_tokens_per_s, 25.26) < 0.10  # reaches 8%
    assert relative_error(pred.throughput_tokens_per_s, 25.12) < 0.10  # reaches 7.5%
    # published.md: bounded by 2 × (13.4 GB / 320 GB/s)^-1 ≈ 48 tokens/s; ours adds the KV reads (1 GB at the
    # mean context), within 5% of that figure and never above it
    assert relative_error(pred.roofline_decode_tokens_per_s, 48.0) < 0.05
    assert pred.decode_tokens_per_s <= pred.roofline_decode_tokens_per_s


def test_flexgen_opt_30b_offloaded_within_25_percent():
    # 7.32 tokens/s at batch 144 (48 × 3): weights 20% GPU / 80% CPU, cache and activations on CPU, attention for
    # the CPU cache on the CPU (FlexGen's --cpu-cache-compute)
    policy = Policy("fp16", weights=Placement(0.2, 0.8, 0.0), kv_cache=Placement(0.0, 1.0, 0.0),
                    activations=Placement(0.0, 1.0, 0.0), micro_batch_size=48, num_micro_batches=3,
                    prefetch_depth=1, attention_on_cpu=True)
    pred = evaluate(get_model("facebook/opt-30b"), flexgen_machine(), policy, FLEXGEN_WORKLOAD)
    assert relative_error(pred.throughput_tokens_per_s, 7.32) < 0.25  # reaches 20% (low)
    assert pred.bottleneck == "cpu attention"  # 105 GB of fp16 cache per step through FlexGen's fp32 copies
    assert pred.roofline_decode_tokens_per_s > pred.decode_tokens_per_s
    # Not asserted: fit. FlexGen assigns whole tensors by their cumulative size, so its "20%" puts q and k
    # (1/6 of a block) on the GPU; with a full 20% our memory model is 0.9 GB over the T4's 16 GiB.


FLEXGEN_175B_POLICY = Policy("fp16", weights=Placement(0.0, 0.5, 0.5), kv_cache=Placement(0.0, 0.0, 1.0),
                             activations=Placement(0.0, 1.0, 0.0), micro_batch_size=32, num_micro_batches=8,
                             prefetch_depth=2, attention_on_cpu=True)


def test_flexgen_opt_175b_is_above_the_bound_of_the_catalogs_disk():
    # 0.69 tokens/s at batch 256 with weights 0/50/50 and the cache on disk (FlexGen's --percent 0 50 0 0 0 100).
    # Every decode step must read 175 GB of weights and ~650 GB of cache from disk; at the catalog's estimate for
    # that machine (0.72 GB/s persistent SSD) even the roofline is 0.23 tokens/s. The honest bound: the published
    # number needs a disk about 3.5× faster than the catalog says (FlexGen's own fitted 0.47 GB/s is slower still).
    pred = evaluate(get_model("facebook/opt-175b"), flexgen_machine(), FLEXGEN_175B_POLICY, FLEXGEN_WORKLOAD)
    assert pred.bottleneck == "disk"
    assert pred.roofline_decode_tokens_per_s < 0.69 / 2.5


def test_flexgen_opt_175b_with_local_nvme_within_10_percent():
    # The same run on GCP's 4-partition local NVMe SSD (1.5 TB; rated 2.65 GB/s read) reaches 7% (low).
    machine = flexgen_machine(disk_read_gbps=2.65)
    pred = evaluate(get_model("facebook/opt-175b"), machine, FLEXGEN_175B_POLICY, FLEXGEN_WORKLOAD)
    assert relative_error(pred.throughput_tokens_per_s, 0.69) < 0.10
    assert pred.bottleneck == "disk"


GPT_J = ModelSpec(name="gpt-j-6b", family="gptj", num_layers=28, hidden_size=4096, intermediate_size=16384,
                  num_heads=16, num_kv_heads=16, head_dim=256, vocab_size=50400, tie_word_embeddings=False,
                  max_position_embeddings=2048, gated_mlp=False, norms_per_block=1, norm_has_bias=True,
                  torch_dtype="fp16")


def test_gpt_j_parameter_count():
    assert GPT_J.total_params() == pytest.approx(6.05e9, rel=0.01)


@pytest.mark.parametrize("gpu, tolerance", [("a100-40gb", 0.15), ("a100-80gb", 0.25)])
def test_helm_gpt_j_per_token_beta(gpu, tolerance):
    # Narayanan et al.: β ≈ 0.021 s per output token for GPT-J 6B on one A100 (fp16, batch 1). published.md does
    # not say which A100; we reach 9% (40 GB) and 20% (80 GB, faster memory), both below the measurement.
    pred = evaluate(GPT_J, get_hardware(gpu), Policy("fp16"), Workload(prompt_len=512, output_len=64))
    assert relative_error(pred.decode_step_s, 0.021) < tolerance
    assert pred.decode_step_s < 0.021
    assert pred.decode_tokens_per_s <= pred.roofline_decode_tokens_per_s


def test_petals_llama_2_70b_server_sizing():
    model = get_model("meta-llama/Llama-2-70b-hf")
    # 2 × 8 KV heads × 128 dims × 16384 tokens × 2 bytes = 64 MiB per block, exactly
    assert kv_cache_bytes(model, CACHE_TOKENS_GQA) / model.num_layers == 64 * 2**20
    # block weights ≈ 0.856 B params × 0.53 bytes (nf4 with statistics, 16-bit norms): we reach 2.7%
    assert model.block_params() == pytest.approx(0.856e9, rel=0.001)
    assert block_weight_bytes(model, "nf4") == pytest.approx(0.856e9 * 0.53, rel=0.03)
    server = plan_server(model, get_hardware("a100-80gb"), quant="nf4")
    assert server.cache_bytes_per_block == 64 * 2**20
    assert server.num_blocks == model.num_layers  # 80 × (442 MB + 67 MB) = 41 GB: the whole model fits
