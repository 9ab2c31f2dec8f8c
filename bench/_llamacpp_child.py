"""llama-cpp-python's side of bench/decode_vs_llamacpp.py (not a benchmark itself): run by the Python of the
venv llama-cpp-python was built into, it loads one GGUF file and prints one JSON line with the prefill and decode
tokens/s of each run (greedy, batch 1, the same prompt and token count as ours). Imports nothing of Hivekeeper.

    python _llamacpp_child.py FILE THREADS TOKENS RUNS PROMPT_JSON
"""

import json
import sys
import time

import llama_cpp
import numpy as np


def last_logits(llm) -> np.ndarray:
    """The logits of the last token evaluated (kept by llama.cpp; Llama.scores holds them only with logits_all)."""
    return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))


def main(path: str, threads: int, tokens: int, runs: int, prompt: list[int]) -> None:
    llm = llama_cpp.Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_batch=len(prompt),
                          n_ctx=len(prompt) + tokens + 8, verbose=False)
    results = []
    for run in range(runs + 1):
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt)
        prefilled = time.perf_counter()
        for _ in range(tokens):
            llm.eval([int(last_logits(llm).argmax())])  # greedy, as ours
        done = time.perf_counter()
        if run:  # the first is a warm-up
            results.append((len(prompt) / (prefilled - start), tokens / (done - prefilled)))
    print(json.dumps({"version": llama_cpp.__version__, "runs": results}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5]))
