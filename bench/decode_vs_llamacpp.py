"""Our CPU decode and prefill against llama.cpp's on the same GGUF files, side by side in one run: the real default
model (SmolLM2-135M-Instruct, Q4_1) and a ~1B demo model written as Q8_0 and Q4_0 GGUFs (bench/_demo_gguf.py),
batch 1, the same thread count, greedy tokens; each alone and beside one CPU-bound process (quiet vs busy).

    python bench/decode_vs_llamacpp.py                  # 2 threads, 64 tokens, a 64-token prompt, 3 runs
    python bench/decode_vs_llamacpp.py --files smollm2 --tokens 32 --runs 2 --no-busy

Why: issue 16's goal is decode at least as fast as llama.cpp on its own files, and keeping at least the fraction of
its speed llama.cpp keeps when another process takes a core. Ours runs `packed` (the files' Q8_0/Q4_0/Q4_1
linears and LM head kept as block bytes on the native quantized kernels: the default for a GGUF on the CPU) and
`dequantized` (every weight fp32, HIVEKEEPER_GGUF_PACKED=0's path; for the 1B files a 4.3 GB copy, decoded for a
few tokens: issue 16 item 2 compares its prefill with the packed one's; --no-dequantized skips it).
llama-cpp-python is not a project dependency: the bench runs it in a child process with the Python of the venv it
was built into (--llama-python, default ~/.cache/hivekeeper-bench/llama_cpp_venv/bin/python: `python -m venv`
there, then `pip install llama-cpp-python`, ~5 min on 2 quiet cores, far longer on a busy machine; on a CPU that
reports AMX, build with CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON": the
native build crashed in its AMX product in this project's VM), or reports it as skipped with the reason. Prints one
JSON line: tokens/s per file, side and load (median of the runs, and every run), the ratios, and the load average
before and after (the machine may be shared: the numbers are only as quiet as it was).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

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
    parser.add_argument("--files", default=",".join(FILES), help=f"comma-separated, of {', '.join(FILES)}")
    parser.add_argument("--no-busy", dest="busy", action="store_false", help="skip the runs beside a CPU hog")
    parser.add_argument("--no-dequantized", dest="dequantized", action="store_false",
                        help="skip our dequantized-fp32 runs (the 1B files' copy is 4.3 GB of RAM)")
    parser.add_argument("--llama-python", default=str(LLAMA_PYTHON), help="the Python llama-cpp-python is in")
    return parser.parse_args(argv)


FILES = ("smollm2-q4_1", "demo-1b-q8_0", "demo-1b-q4_0")
CACHE = Path.home() / ".cache" / "hivekeeper-bench"
LLAMA_PYTHON = CACHE / "llama_cpp_venv" / "bin" / "python"
args = parse_args()
set_threads(args.threads)

import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

import hivekeeper.core  # noqa: E402,F401 - before numpy and torch: sets OpenBLAS's idle-thread timeout

import torch  # noqa: E402

from hivekeeper.core.runtime.checkpoint import load_config, load_embedding, load_head, load_span  # noqa: E402
from hivekeeper.core.runtime.default_model import resolve_default_model  # noqa: E402
from hivekeeper.core.runtime.demo_model import PRESETS  # noqa: E402
from hivekeeper.core.runtime.kernels import native_kernels  # noqa: E402
from hivekeeper.core.runtime.kernels.cpu_matmul import use_blas_threads  # noqa: E402
from hivekeeper.core.runtime.model import KVCache  # noqa: E402

from _common import busy_core, fixed_prompt  # noqa: E402  (bench/ is the script's folder, first on sys.path)
from _demo_gguf import write_demo_gguf  # noqa: E402

CHILD = Path(__file__).with_name("_llamacpp_child.py")
CHILD_DEADLINE_S = 900


def gguf_file(name: str) -> Path:
    """The file of a FILES entry: the installed default model, or the demo written once into the cache."""
    if name == "smollm2-q4_1":
        return resolve_default_model()
    return write_demo_gguf(CACHE / "gguf" / f"{name}.gguf", name.rsplit("-", 1)[1], PRESETS["1b"],
                           resolve_default_model())


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


def load_ours(path: Path, packed: bool):
    embedding = load_embedding(path)
    head = load_head(path, embedding=embedding, packed=packed)
    return embedding, load_span(path, 0, load_config(path).num_layers, packed=packed), head


def ours(model, prompt: list[int], tokens: int, runs: int, busy: bool) -> dict:
    """Our runtime on a loaded model (embedding, span, head)."""
    ours_once(model, prompt, 4)  # warm-up: the kernels' build and first-touch
    with busy_core(busy):
        return summary([ours_once(model, prompt, tokens) for _ in range(runs)])


def summary(results: list[tuple[float, float]]) -> dict:
    prefill, decode = [r[0] for r in results], [r[1] for r in results]
    return {"decode_tok_s": round(statistics.median(decode), 1), "prefill_tok_s": round(statistics.median(prefill), 1),
            "decode_runs": [round(r, 1) for r in decode], "prefill_runs": [round(r, 1) for r in prefill]}


def llama_cpp(python: Path, path: Path, prompt: list[int], tokens: int, runs: int, busy: bool) -> dict | str:
    """llama-cpp-python on the same file, prompt and threads in a child process, or why it was skipped."""
    if not python.is_file():
        return f"skipped: {python} does not exist (python -m venv {python.parent.parent}; then its pip install " \
               f"llama-cpp-python, ~5 min on 2 cores)"
    library = next(python.parent.parent.glob("lib/python3*/site-packages/llama_cpp/lib"), None)
    env = {**os.environ, "LD_LIBRARY_PATH": str(library or "")}
    command = [str(python), str(CHILD), str(path), str(args.threads), str(tokens), str(runs), json.dumps(prompt)]
    with busy_core(busy):
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=CHILD_DEADLINE_S, env=env)
        except subprocess.TimeoutExpired as exc:  # run() has killed the child
            return f"skipped: llama-cpp-python did not finish in {CHILD_DEADLINE_S} s: {(exc.stderr or '')[-300:]}"
    if done.returncode != 0:
        return f"skipped: llama-cpp-python failed ({done.returncode}): {done.stderr.strip()[-300:]}"
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return {"version": result["version"], **summary([tuple(run) for run in result["runs"]])}


def ratio(a: dict | str, b: dict | str, key: str) -> float | None:
    return round(a[key] / b[key], 2) if isinstance(a, dict) and isinstance(b, dict) else None


DEQUANTIZED_1B_TOKENS = 8  # the 1B files' fp32 decode streams 4.3 GB a token: a few tokens say its rate


def bench_file(name: str, prompt_tokens: int, tokens: int, runs: int, busy: bool, dequantized: bool) -> dict:
    """Every side on one file, quiet then (with busy) beside a CPU hog; with `dequantized`, ours on the file's
    weights dequantized to fp32 too (quiet only; the 1B files with at most DEQUANTIZED_1B_TOKENS new tokens)."""
    path = gguf_file(name)
    prompt = fixed_prompt(load_config(path).vocab_size, prompt_tokens)
    loads = ["quiet", "busy"] if busy else ["quiet"]
    out = {"file": path.name, "file_bytes": path.stat().st_size}
    packed = load_ours(path, True)
    for load in loads:
        out[f"ours_packed_{load}"] = ours(packed, prompt, tokens, runs, load == "busy")
    del packed
    if dequantized:  # issue 16 item 2: packed prefill against the same weights dequantized to fp32, in one run
        fp32 = load_ours(path, False)
        fp32_tokens = tokens if name.startswith("smollm2") else min(tokens, DEQUANTIZED_1B_TOKENS)
        out["ours_dequantized_fp32_quiet"] = {"new_tokens": fp32_tokens, **ours(fp32, prompt, fp32_tokens, runs, False)}
        del fp32
        out["prefill_packed_vs_dequantized_fp32"] = ratio(out["ours_packed_quiet"], out["ours_dequantized_fp32_quiet"],
                                                          "prefill_tok_s")
    for load in loads:
        out[f"llama_cpp_{load}"] = llama_cpp(Path(args.llama_python), path, prompt, tokens, runs, load == "busy")
    for load in loads:
        out[f"decode_ours_vs_llama_cpp_{load}"] = ratio(out[f"ours_packed_{load}"], out[f"llama_cpp_{load}"],
                                                        "decode_tok_s")
        out[f"prefill_ours_vs_llama_cpp_{load}"] = ratio(out[f"ours_packed_{load}"], out[f"llama_cpp_{load}"],
                                                         "prefill_tok_s")
    if busy:
        out["busy_kept_ours"] = ratio(out["ours_packed_busy"], out["ours_packed_quiet"], "decode_tok_s")
        out["busy_kept_llama_cpp"] = ratio(out["llama_cpp_busy"], out["llama_cpp_quiet"], "decode_tok_s")
    return out


def main() -> int:
    use_blas_threads()  # torch on one thread, as `hivekeeper generate` runs (its OpenMP threads would spin)
    load_before = os.getloadavg()
    files = [name for name in args.files.split(",") if name]
    unknown = [name for name in files if name not in FILES]
    if unknown:
        print(f"unknown file {unknown[0]!r}: choose from {', '.join(FILES)}", file=sys.stderr)
        return 2
    results = {name: bench_file(name, args.prompt_tokens, args.tokens, args.runs, args.busy, args.dequantized)
               for name in files}
    line = {"bench": "decode_vs_llamacpp", "threads": args.threads, "batch": 1, "new_tokens": args.tokens,
            "prompt_tokens": args.prompt_tokens, "runs": args.runs, "native_kernels": native_kernels.status(),
            "files": results, "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()]}
    print(json.dumps(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
