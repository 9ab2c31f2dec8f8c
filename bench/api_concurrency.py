"""`hivekeeper api` under concurrent clients: aggregate tokens/s and each client's time to first token with 1, 4 and 8
streaming clients at once, on the real default model (or --model).

    python bench/api_concurrency.py                  # smollm2-135m-instruct, 1/4/8 clients, 64 tokens each
    python bench/api_concurrency.py --clients 1 2 4 8 16 --tokens 128 --max-batch 16

The server is the real command (`hivekeeper api --port 0`, a child process); each client is a thread with the
official `openai` client streaming a chat completion of a different question, greedy, exactly --tokens tokens
(the API has no ignore-eos, so each question asks for a long answer and max_tokens caps it; a reply that ends
earlier counts its own tokens). Why: concurrent requests are decoded together (continuous batching, see
core/runtime/continuous.py), so on a machine whose decode is bound by memory bandwidth 8 clients should get several
times the aggregate tokens/s of one. Goal: 8 clients >= 4x the aggregate of 1. Prints one JSON line: per client
count, the aggregate tokens/s, the tokens, each client's time to first token and its tokens/s, and the load average
before and after (the machine may be shared).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time

QUESTIONS = [
    "Describe the water cycle in detail.", "Explain how a bicycle works.", "Tell the history of the printing press.",
    "Describe how bread is made.", "Explain photosynthesis step by step.", "Describe the planets of the solar system.",
    "Explain how a computer stores data.", "Describe a walk through a forest in autumn.",
    "Explain how airplanes fly.", "Describe the life of honey bees.", "Explain how the heart pumps blood.",
    "Describe how a river shapes a valley.", "Explain how vaccines work.", "Describe a busy city market.",
    "Explain the rules of chess.", "Describe how glass is made.",
]
START_TIMEOUT_S = 600


def start_server(model: str | None, max_batch: int) -> tuple[subprocess.Popen, str]:
    """`hivekeeper api --port 0` as a child; (process, base URL) once it says where it listens."""
    argv = [sys.executable, "-m", "hivekeeper.core.cli.main", "api", "--port", "0", "--max-batch", str(max_batch)]
    if model:
        argv += ["--model", model]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    found: dict = {}

    def read() -> None:
        for line in proc.stdout:
            match = re.search(r"serving \S+ at (http://\S+/v1)", line)
            if match:
                found["url"] = match.group(1)
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(START_TIMEOUT_S)
    if "url" not in found:
        proc.kill()
        raise SystemExit(f"api_concurrency: the server did not start within {START_TIMEOUT_S} s")
    return proc, found["url"]


def one_client(client, model: str, question: str, tokens: int, out: dict) -> None:
    """Stream one reply; record the time to first token, the tokens and the end time."""
    started = time.perf_counter()
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                            max_tokens=tokens, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content and "ttft_s" not in out:
            out["ttft_s"] = time.perf_counter() - started
        if chunk.usage is not None:
            out["tokens"] = chunk.usage.completion_tokens
    out["end"] = time.perf_counter()
    out["start"] = started


def run_round(client, model: str, clients: int, tokens: int) -> dict:
    """`clients` streams at once: aggregate tokens/s over the round, and each client's figures."""
    outs = [{} for _ in range(clients)]
    threads = [threading.Thread(target=one_client, args=(client, model, QUESTIONS[i % len(QUESTIONS)], tokens,
                                                         outs[i])) for i in range(clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    total = sum(o.get("tokens", 0) for o in outs)
    return {"clients": clients, "aggregate_tokens_per_s": round(total / wall, 1), "tokens": total,
            "wall_s": round(wall, 2),
            "ttft_s": [round(o.get("ttft_s", float("nan")), 3) for o in outs],
            "client_tokens_per_s": [round(o.get("tokens", 0) / (o["end"] - o["start"]), 1) for o in outs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model id or path (default: the built-in model)")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--tokens", type=int, default=64, help="max_tokens per reply")
    parser.add_argument("--max-batch", type=int, default=8)
    args = parser.parse_args()
    import openai

    load_before = os.getloadavg()
    proc, url = start_server(args.model, args.max_batch)
    try:
        client = openai.OpenAI(base_url=url, api_key="unused", timeout=600, max_retries=0)
        model = client.models.list().data[0].id
        run_round(client, model, 1, 8)  # warm: first allocations of each path
        rounds = [run_round(client, model, n, args.tokens) for n in args.clients]
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    one = next((r["aggregate_tokens_per_s"] for r in rounds if r["clients"] == 1), None)
    most = max(rounds, key=lambda r: r["clients"])
    speedup = round(most["aggregate_tokens_per_s"] / one, 2) if one else None
    print(json.dumps({"bench": "api_concurrency", "model": model, "tokens_per_reply": args.tokens,
                      "max_batch": args.max_batch, "rounds": rounds,
                      f"speedup_{most['clients']}_vs_1": speedup,
                      "goal_met": speedup is not None and most["clients"] >= 8 and speedup >= 4,
                      "load_before": [round(x, 2) for x in load_before],
                      "load_after": [round(x, 2) for x in os.getloadavg()]}))


if __name__ == "__main__":
    main()
