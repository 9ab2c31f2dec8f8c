"""Predicted against measured decode speed on this machine, for thin, many-layer models (issue 14 item 12): the
demo "100m" model (12 blocks of 768, ~125M parameters) and the real default model, smollm2-135m-instruct (30 blocks
of 576). The prediction is `hivekeeper plan --hardware auto --json` on a machine never measured (a fresh config
folder per run), so the plan first runs the automatic quick measurement as a new user's first plan does (pass
--no-measure to plan with the estimates instead); the measurement is `hivekeeper generate --json` with the same
prompt and output lengths right after it. Both through the real commands, one after the other, in each run: on a
shared machine the load then slows the measurement and the decode alike (issue 23), and the ratio is per run.

The default model is planned and run as `generate` runs it: its Q4_1 blocks kept packed (the plan's format q4_1).
--dequantized adds a line for it dequantized to fp32 (HIVEKEEPER_GGUF_PACKED=0 for both the plan and the run).

    python bench/predicted_vs_measured.py                 # both models, 64 prompt + 64 new tokens, 3 runs
    python bench/predicted_vs_measured.py --runs 5 --no-measure
    python bench/predicted_vs_measured.py --dequantized   # and SmolLM2 in fp32

Goal: predicted decode tokens/s within 15% of the measured, for both models, uncalibrated (the median of the
runs' ratios). Prints one JSON line per model: predicted and measured tokens/s and their ratio for every run, the
medians, whether the goal is met, the plan's efficiency set and the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from _common import demo_preset  # bench/ is the script's folder, first on sys.path

GOAL = 0.15
CHILD_DEADLINE_S = 600


def hivekeeper(*args: str, env: dict | None = None) -> dict:
    """One command's JSON; on failure or past the deadline, the output so far in the error."""
    command = [sys.executable, "-m", "hivekeeper.core.cli.main", *args]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=CHILD_DEADLINE_S, env=env)
    except subprocess.TimeoutExpired as exc:  # run() killed the child at the deadline
        raise SystemExit(f"{' '.join(args[:3])}: no answer in {CHILD_DEADLINE_S} s; output so far:\n"
                         f"{exc.stdout or ''}{exc.stderr or ''}") from None
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args[:3])} failed ({done.returncode}):\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def one_run(model: str, prompt_len: int, new_tokens: int, no_measure: bool, packed: bool) -> tuple[dict, float]:
    """(the plan, measured decode tokens/s): a first plan on a machine never measured, then the decode; a GGUF's
    blocks packed as the runtime keeps them by default, or (packed=False) dequantized in both."""
    with tempfile.TemporaryDirectory(prefix="hivekeeper-pvm-") as config:
        env = {**os.environ, "HIVEKEEPER_CONFIG_DIR": config, "HIVEKEEPER_GGUF_PACKED": "1" if packed else "0"}
        plan = hivekeeper("plan", "--model", model, "--hardware", "auto", "--prompt-len", str(prompt_len),
                          "--output-len", str(new_tokens), "--json", *(["--no-measure"] if no_measure else []),
                          env=env)
        prompt = " ".join(["the"] * prompt_len)  # about one token per word for both tokenizers
        measured = hivekeeper("generate", "--model", model, "--prompt", prompt, "--max-new-tokens", str(new_tokens),
                              "--ignore-eos", "--json", env=env)["tokens_per_s"]
    return plan, measured


def compare(model: str, name: str, prompt_len: int, new_tokens: int, runs: int, no_measure: bool,
            packed: bool = True) -> dict:
    load_before = os.getloadavg()[0]
    results = [one_run(model, prompt_len, new_tokens, no_measure, packed) for _ in range(runs)]
    plan = results[-1][0]
    predicted = [p["decode_tokens_per_s"] for p, _ in results]
    measured = [m for _, m in results]
    ratios = [p / m for p, m in zip(predicted, measured) if m]
    median = statistics.median(ratios) if ratios else None
    return {"bench": "predicted_vs_measured", "model": name, "predicted_tokens_per_s": predicted,
            "measured_tokens_per_s": measured, "measured_median": statistics.median(measured),
            "ratios": [round(r, 3) for r in ratios], "ratio": round(median, 3) if median else None,
            "within_goal": median is not None and abs(median - 1) <= GOAL, "goal": GOAL,
            "efficiency": plan["efficiency"], "weight_format": plan["policy"]["weight_format"],
            "prompt_len": prompt_len, "new_tokens": new_tokens,
            "loadavg_before": round(load_before, 2), "loadavg_after": round(os.getloadavg()[0], 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--no-measure", action="store_true", help="plan with estimates where there is no profile")
    parser.add_argument("--dequantized", action="store_true", help="also the default model dequantized to fp32")
    args = parser.parse_args()
    models = [(str(demo_preset("100m")), "demo-100m", True), ("smollm2-135m-instruct", "smollm2-135m-instruct", True)]
    if args.dequantized:
        models.append(("smollm2-135m-instruct", "smollm2-135m-instruct (fp32)", False))
    for model, name, packed in models:
        print(json.dumps(compare(model, name, args.prompt_len, args.new_tokens, args.runs, args.no_measure, packed)),
              flush=True)


if __name__ == "__main__":
    main()
