"""Our CPU decode and prefill against llama.cpp's on the same GGUF file: the real default model (SmolLM2-135M-Instruct,
Q4_1), batch 1, the same thread count, greedy tokens.

    python bench/decode_vs_llamacpp.py                  # 2 threads, 64 tokens, a 64-token prompt
    python bench/decode_vs_llamacpp.py --threads 2 --tokens 64 --prompt-tokens 64 --runs 3

Why: issue 16's goal is decode at least as fast as llama.cpp on its own files. Ours runs two ways: `packed` (the
file's Q8_0/Q4_0/Q4_1 linears kept as block bytes, multiplied by the native quantized kernels: checkpoint.load_span's
default for a GGUF on the CPU) and `dequantized` (every weight fp32, packed=False). llama-cpp-python is not a project
dependency: it is used when `import llama_cpp` works, else reported as skipped with how to build it. Prints one JSON
line: tokens/s per side (median of the runs, and every run), and the load average before and after (the machine may be
shared: the numbers are only as quiet as it was).
"""

from __future__ import annotations

import argparse
import os
import sys

THREADS_ENV = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def set_threads(threads: int) -> None:
    """Thread count for BLAS, torch and our kernels' pool: set before they are imported."""
    for name in THREADS_ENV:
        os.environ[name] = str(threads)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens decoded per run")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="prompt length (prefill)")
    parser.add_argument("--runs", type=int, default=3)
    return parser.parse_args(argv)


args = parse_args()
set_threads(args.threads)

import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import hivekeeper.core  # noqa: E402,F401 - before numpy and torch: sets OpenBLAS's idle-thread timeout

import torch  # noqa: E402

from hivekeeper.core.runtime.checkpoint import load_config, load_embedding, load_head, load_span  # noqa: E402
from hivekeeper.core.runtime.default_model import FILE_NAME, resolve_default_model  # noqa: E402
from hivekeeper.core.runtime.kernels import native_kernels  # noqa: E402
from hivekeeper.core.runtime.model import KVCache  # noqa: E402

from _common import fixed_prompt  # noqa: E402  (bench/ is the script's folder, first on sys.path)

LLAMA_CPP_MISSING = "skipped: llama-cpp-python is not installed (build it with pip install llama-cpp-python, ~5 min on 2 cores)"


@torch.inference_mode()
def ours_once(model, prompt: list[int], tokens: int) -> tuple[float, float]:
    """(prefill tokens/s, decode tokens/s) of one greedy run on our runtime."""
    embedding, span, head = model
    cache = KVCache.allocate(span.config, span.config.num_layers, 1, len(prompt) + tokens)
    start = time.perf_counter()
    logits = head(span(embedding(torch.tensor([prompt])), cache)[:, -1:])[0, -1]
    prefilled = time.perf_counter()
    for _ in range(tokens):
        token = int(logits.argmax())
        logits = head(span(embedding(torch.tensor([[token]])), cache))[0, -1]
    done = time.perf_counter()
    return len(prompt) / (prefilled - start), tokens / (done - prefilled)


def ours(path, packed: bool, prompt: list[int], tokens: int, runs: int) -> dict:
    """Our runtime on the file: packed block-quantized linears, or every weight dequantized to fp32."""
    embedding = load_embedding(path)
    head = load_head(path, embedding=embedding)
    span = load_span(path, 0, load_config(path).num_layers, packed=packed)
    model = (embedding, span, head)
    ours_once(model, prompt, 4)  # warm-up: the kernels' build and first-touch
    return summary([ours_once(model, prompt, tokens) for _ in range(runs)])


def summary(results: list[tuple[float, float]]) -> dict:
    prefill, decode = [r[0] for r in results], [r[1] for r in results]
    return {"decode_tok_s": round(statistics.median(decode), 1), "prefill_tok_s": round(statistics.median(prefill), 1),
            "decode_runs": [round(r, 1) for r in decode], "prefill_runs": [round(r, 1) for r in prefill]}


def llama_cpp(path, threads: int, prompt: list[int], tokens: int, runs: int) -> dict | str:
    """llama-cpp-python on the same file and threads, or why it was skipped."""
    try:
        import llama_cpp
    except ImportError:
        return LLAMA_CPP_MISSING
    llm = llama_cpp.Llama(model_path=str(path), n_threads=threads, n_threads_batch=threads, n_batch=len(prompt),
                          n_ctx=len(prompt) + tokens + 8, verbose=False)
    results = []
    for run in range(runs + 1):
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt)
        prefilled = time.perf_counter()
        for _ in range(tokens):
            llm.eval([int(llm.scores[llm.n_tokens - 1].argmax())])  # greedy, as ours
        done = time.perf_counter()
        if run:  # the first is a warm-up
            results.append((len(prompt) / (prefilled - start), tokens / (done - prefilled)))
    return {"version": getattr(llama_cpp, "__version__", "?"), **summary(results)}


def main() -> int:
    path = resolve_default_model()
    prompt = fixed_prompt(load_config(path).vocab_size, args.prompt_tokens)
    load_before = os.getloadavg()
    packed = ours(path, True, prompt, args.tokens, args.runs)
    dequantized = ours(path, False, prompt, args.tokens, args.runs)
    other = llama_cpp(path, args.threads, prompt, args.tokens, args.runs)
    line = {"bench": "decode_vs_llamacpp", "file": FILE_NAME, "threads": args.threads, "batch": 1,
            "new_tokens": args.tokens, "prompt_tokens": args.prompt_tokens, "runs": args.runs,
            "native_kernels": native_kernels.status(), "ours_packed": packed, "ours_dequantized_fp32": dequantized,
            "llama_cpp": other,
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()]}
    if isinstance(other, dict):
        line["packed_vs_llama_cpp_decode"] = round(packed["decode_tok_s"] / other["decode_tok_s"], 2)
    print(json.dumps(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
