"""How much slower bitsandbytes' int8 / nf4 CPU kernels run one decoder block than dense fp32 (and bf16) here.

Runs one Llama block (TinyLlama-1.1B's shape by default) with random weights: a decode step (1 token after a
128-token context) and a 128-token prefill, for each weight format. Prints ONE JSON line; the planner uses
`slowdown_vs_fp32` (time with the format / time with fp32 weights) for quantized weights on a CPU
(planner/costmodel.py CPU_QUANT_SLOWDOWN, HALF_AS_FP32_ON_CPU: update them from this bench).

    python bench/quant_cpu.py [--hidden 2048 --intermediate 5632 --heads 32 --kv-heads 4 --context 128 --repeats 5]
"""

from __future__ import annotations

import hivekeeper.core  # noqa: F401 - first, before numpy and torch: sets OpenBLAS's idle-thread timeout

import argparse
import json
import platform
import time

import torch

from hivekeeper.core.runtime.kernels.cpu_matmul import blas_active
from hivekeeper.core.runtime.model import Block, KVCache, ModelConfig
from hivekeeper.core.runtime.quant.bnb import quantize_block, weight_bytes


def build_block(config: ModelConfig, dtype: torch.dtype, quant: str) -> Block:
    torch.manual_seed(0)
    block = Block(config, 0)
    with torch.no_grad():
        for name, param in block.named_parameters():
            param.copy_(torch.ones_like(param) if "norm" in name else torch.randn_like(param) * 0.02)
    block = block.to(dtype).requires_grad_(False)
    return quantize_block(block, quant, "cpu") if quant != "none" else block


def measure_all(config: ModelConfig, formats: dict, context: int, rounds: int) -> dict:
    """Best-of-`rounds` times per format, the formats interleaved within each round so that a busy machine's
    slow and fast moments fall on all of them alike."""
    blocks = {name: build_block(config, dtype, quant) for name, (dtype, quant) in formats.items()}
    caches = {name: KVCache.allocate(config, 1, 1, context + 2, dtype=dtype).block(0)
              for name, (dtype, _) in formats.items()}
    best = {name: {"decode_s": float("inf"), "prefill_s": float("inf")} for name in formats}
    torch.manual_seed(1)
    prompt = torch.randn(1, context, config.hidden_size)
    step = torch.randn(1, 1, config.hidden_size)
    with torch.inference_mode():
        for round_index in range(rounds + 1):  # round 0 warms up (lazy init, first touch of the caches)
            for name, (dtype, _) in formats.items():
                block, (k, v) = blocks[name], caches[name]
                x = prompt.to(dtype)
                start = time.perf_counter()
                block(x, k, v, 0)
                prefill = time.perf_counter() - start
                x = step.to(dtype)
                start = time.perf_counter()
                block(x, k, v, context)
                decode = time.perf_counter() - start
                if round_index:
                    best[name]["prefill_s"] = min(best[name]["prefill_s"], prefill)
                    best[name]["decode_s"] = min(best[name]["decode_s"], decode)
    for name, result in best.items():
        result["weight_bytes"] = weight_bytes(blocks[name])
        result["decode_weight_gbps"] = result["weight_bytes"] / result["decode_s"] / 1e9
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5, help="measured rounds (best of)")
    parser.add_argument("--torch-threads", type=int,
                        help="torch threads (default: the runtime's layout, engine.use_physical_cores: torch on one "
                             "thread, fp32 matmuls on numpy's BLAS over every core)")
    args = parser.parse_args()
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    else:
        from hivekeeper.core.offload.offloaded_model import use_physical_cores

        use_physical_cores()
    config = ModelConfig(family="llama", vocab_size=32000, hidden_size=args.hidden,
                         intermediate_size=args.intermediate, num_layers=1, num_heads=args.heads,
                         num_kv_heads=args.kv_heads, head_dim=args.hidden // args.heads, max_position_embeddings=4096)
    import bitsandbytes

    formats = {"fp32": (torch.float32, "none"), "bf16": (torch.bfloat16, "none"),
               "int8": (torch.float32, "int8"), "nf4": (torch.float32, "nf4")}
    results = measure_all(config, formats, args.context, args.repeats)
    base = results["fp32"]
    for result in results.values():
        result["decode_slowdown_vs_fp32"] = result["decode_s"] / base["decode_s"]
        result["prefill_slowdown_vs_fp32"] = result["prefill_s"] / base["prefill_s"]
    print(json.dumps({
        "bench": "quant_cpu",
        "block": {"hidden": args.hidden, "intermediate": args.intermediate, "heads": args.heads,
                  "kv_heads": args.kv_heads, "params": config.block_param_count()},
        "context": args.context,
        "torch_threads": torch.get_num_threads(),
        "fp32_matmul": "numpy-blas" if blas_active() else "torch",
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "bitsandbytes": bitsandbytes.__version__,
        "int8_decode_slowdown_vs_fp32": round(results["int8"]["decode_slowdown_vs_fp32"], 2),
        "nf4_decode_slowdown_vs_fp32": round(results["nf4"]["decode_slowdown_vs_fp32"], 2),
        "formats": {name: {key: round(value, 5) if isinstance(value, float) else value for key, value in r.items()}
                    for name, r in results.items()},
    }))


if __name__ == "__main__":
    main()
