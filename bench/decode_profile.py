"""Where a packed decode step's time goes, and the pool's solo runs A/B: the real default model (SmolLM2-135M,
Q4_1 blocks, Q8_0 LM head) decoded greedily at batch 1 on the native kernels' profiling build, settings interleaved
run by run in one process (the same load for each).

    python bench/decode_profile.py                       # 2 threads; solo runs of 64 products (the default) vs none
    python bench/decode_profile.py --solo 64 16 0 --busy # the same beside one CPU-bound process
    python bench/decode_profile.py --solo 64 --attention-pool 16384 65536  # attention over the pool from which size
    python bench/decode_profile.py --file ~/.cache/hivekeeper-bench/gguf/demo-1b-q4_0.gguf --tokens 16 --solo 64

Why: issue 16's single-row decode trails llama.cpp's on the same file. The profiling build (HIVEKEEPER_NATIVE_PROFILE=1,
decode_kernels.c's hk_profile) adds up the calling thread's CPU time per part of a step (each packed product, the
activations' quantization, attention, norms, SiLU, the LM head; `wait`: spinning or sleeping for workers' chunks;
`solo`: products run alone after a stall), so the parts are what they cost whatever else runs on the machine; wall
tokens/s depend on the load. After a product stalled on a worker that lost its core, the pool runs the next products
on the caller alone (`--solo`: how many; 0: none): this compares settings. Prints one JSON line: per setting the
median tokens/s, every run's, the stalls per run, the CPU ms per token of each part (median over runs), and the load
average before and after (the machine may be shared: report ratios, not absolutes).
"""

from __future__ import annotations

import argparse
import os
import sys

THREADS_ENV = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens decoded per run")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3, help="runs per setting, interleaved")
    parser.add_argument("--solo", type=int, nargs="+", default=[64, 0], help="solo products after a stall")
    parser.add_argument("--attention-pool", type=int, nargs="+", default=[1 << 16],
                        help="batch x keys x heads x head_dim from which attention runs over the pool (0: always)")
    parser.add_argument("--busy", action="store_true", help="beside one CPU-bound process")
    parser.add_argument("--file", default=None, help="a GGUF file (default: the built-in SmolLM2 Q4_1); e.g. the ~1B "
                        "demo files bench/decode_vs_llamacpp.py writes into ~/.cache/hivekeeper-bench/gguf")
    return parser.parse_args(argv)


args = parse_args()
for name in THREADS_ENV:
    os.environ[name] = str(args.threads)
os.environ["HIVEKEEPER_NATIVE_PROFILE"] = "1"

import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import hivekeeper.core  # noqa: E402,F401 - before numpy and torch: sets OpenBLAS's idle-thread timeout

import torch  # noqa: E402

from hivekeeper.core.runtime.checkpoint import load_config, load_embedding, load_head, load_span  # noqa: E402
from hivekeeper.core.runtime.default_model import resolve_default_model  # noqa: E402
from hivekeeper.core.runtime.kernels import native_kernels  # noqa: E402
from hivekeeper.core.runtime.kernels.cpu_matmul import use_blas_threads  # noqa: E402
from hivekeeper.core.runtime.model import KVCache  # noqa: E402

from _common import busy_core, fixed_prompt  # noqa: E402  (bench/ is the script's folder, first on sys.path)


@torch.inference_mode()
def one_run(model, prompt: list[int], tokens: int) -> tuple[float, int, dict[str, float]]:
    """(decode tokens/s, stalls, CPU ms per token of each part) of one greedy run."""
    embedding, span, head = model
    library = native_kernels.library()
    cache = KVCache.allocate(span.config, span.config.num_layers, 1, len(prompt) + tokens)
    logits = head(span(embedding(torch.tensor([prompt])), cache)[:, -1:])[0, -1]
    native_kernels.step_profile(reset=True)
    stalls = library.hk_pool_stalls()
    start = time.perf_counter()
    for _ in range(tokens):
        logits = head(span(embedding(torch.tensor([[int(logits.argmax())]])), cache))[0, -1]
    rate = tokens / (time.perf_counter() - start)
    parts = {name: seconds * 1e3 / tokens for name, seconds in native_kernels.step_profile(reset=True).items()}
    return rate, library.hk_pool_stalls() - stalls, parts


def summary(runs: list[tuple[float, int, dict[str, float]]]) -> dict:
    parts = {name: round(statistics.median(run[2][name] for run in runs), 2) for name in native_kernels.PROFILE_PARTS}
    return {"decode_tok_s": round(statistics.median(run[0] for run in runs), 1),
            "decode_runs": [round(run[0], 1) for run in runs], "stalls": [run[1] for run in runs],
            "cpu_ms_per_token": parts, "cpu_ms_per_token_total": round(sum(parts.values()), 2)}


def main() -> int:
    use_blas_threads()  # torch on one thread, as `hivekeeper generate` runs
    load_before = os.getloadavg()
    path = Path(args.file).expanduser() if args.file else resolve_default_model()
    embedding = load_embedding(path)
    model = (embedding, load_span(path, 0, load_config(path).num_layers, packed=True),
             load_head(path, embedding=embedding, packed=True))
    prompt = fixed_prompt(load_config(path).vocab_size, args.prompt_tokens)
    if native_kernels.step_profile() is None:
        print(f"the kernels' profiling build did not load: {native_kernels.status()}", file=sys.stderr)
        return 1
    one_run(model, prompt, 4)  # warm-up: first touch of the weights
    runs = {(solo, pool): [] for solo in args.solo for pool in args.attention_pool}
    with busy_core(args.busy):
        for _ in range(args.runs):
            for solo, pool in runs:
                native_kernels.set_solo_products(solo)
                native_kernels.set_attention_pool(pool)
                runs[solo, pool].append(one_run(model, prompt, args.tokens))
    line = {"bench": "decode_profile", "file": path.name, "threads": args.threads, "batch": 1,
            "new_tokens": args.tokens, "prompt_tokens": args.prompt_tokens, "busy": args.busy,
            "native_kernels": native_kernels.status(),
            "settings": {f"solo={solo} attention_pool={pool}": summary(results)
                         for (solo, pool), results in runs.items()},
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()]}
    print(json.dumps(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
