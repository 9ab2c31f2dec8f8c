"""`hivekeeper generate`: generate text once from a prompt, for scripts and benchmarks.

It is raw completion: the prompt goes to the model as written, with no chat template, and the model continues it.
`hivekeeper chat` wraps each message in the model's chat template; `--help` says both (RAW_COMPLETION, after the
one-line help).

Runs the model locally through the offloading engine (with the planner's policy, or one from a plan file, under an
optional RAM budget) or through a swarm (--swarm). Prints the text and a summary — tokens/s, time to first token,
peak RSS, the plan used — or all of it as one JSON object with --json.

With --prompts-file the file's prompts (one a line, the same number of tokens each) are generated together as one
batch, run as the plan's micro-batches; the plan's predicted tokens/s (the planner's, or those a plan file carries)
are printed beside the measured ones ("predicted_vs_measured" with --json), with a note where the prediction is not
this run's (another batch; other prompt and output tokens; another placement: no GPU here, a --ram-budget-gb), where a
plan file's prediction was made again for this run's tokens, and where streamed weights came faster than the disk
reads (the OS page cache).

The text is printed as it is generated (one sequence). Through a swarm, a failed server is replaced and its work
replayed (each failover is listed in the summary and under "failovers" with --json); when the swarm cannot go on
(some blocks have no server left) the text generated so far stays on stdout (with --json: an object with "error",
the text so far and the failovers) and the error names the blocks, exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys

# what `generate --help` says of the prompt after the one-line help (main.COMMANDS: "... (raw completion: no chat
# template)")
RAW_COMPLETION = ("The prompt goes to the model as written, with no chat template, and the model continues it; "
                  "`hivekeeper chat` applies the model's chat template (a chat model answers questions there).")
# said when every sequence ended before its first word (a chat model given a bare question often does)
ENDED_AT_ONCE = ("note: the model ended the text at once (end of sequence): generate continues the prompt as written; "
                 "a chat model answers a question in `hivekeeper chat`, which wraps it in the model's chat template")


# ---- arguments shared with `hivekeeper chat` -----------------------------------------------------------------------
def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    from hivekeeper.core.runtime.default_model import DEFAULT_MODEL_ID

    parser.add_argument("--model", default=DEFAULT_MODEL_ID,
                        help=f"checkpoint folder, GGUF file (or a folder holding one), hub id (org/name), or "
                             f"{DEFAULT_MODEL_ID} (the default: a small real chat model, installed by `make run`)")
    parser.add_argument("--plan", default="auto", metavar="auto|FILE",
                        help="auto: the planner's best policy for this machine (default); FILE: a plan from "
                             "`hivekeeper plan --json` (its policy is used)")
    parser.add_argument("--quant", choices=("none", "int8", "nf4"), default="none",
                        help="with --plan auto: plan for int8 or nf4 weights (bitsandbytes; slow on CPUs)")
    parser.add_argument("--no-measure", action="store_true",
                        help="with --plan auto on a machine never measured: plan with estimates instead of measuring "
                             "it quickly first (as `hivekeeper plan` does)")
    parser.add_argument("--ram-budget-gb", type=float, metavar="X",
                        help="RAM the model may hold (weights, KV cache, buffers; the Python+torch runtime not "
                             "counted); the blocks that do not fit are streamed from disk")
    parser.add_argument("--prompts", metavar="FILE", help="trained prompts from `hivekeeper finetune --out FILE`, "
                                                          "run before every conversation")
    swarm = parser.add_argument_group("swarm")
    swarm.add_argument("--swarm", action="store_true", help="run the blocks in a swarm; embeddings and head run here")
    swarm.add_argument("--initial-peers", nargs="+", default=[], metavar="MADDR", help="multiaddrs to join the swarm")
    swarm.add_argument("--dht-prefix", help="the model's name in the swarm (default: derived from --model)")


def add_sampling_arguments(parser: argparse.ArgumentParser, temperature: float, top_p: float) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--temperature", type=float, default=temperature,
                       help=f"0 = greedy (default {temperature:g})")
    group.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    group.add_argument("--top-p", type=float, default=top_p, help=f"nucleus sampling mass (1 = off; default {top_p:g})")
    group.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages repeats (1 = off)")
    group.add_argument("--seed", type=int, help="random seed, for reproducible sampling")


def sampling_params(args: argparse.Namespace):
    from hivekeeper.core.runtime.sampling import SamplingParams
    from hivekeeper.planner.errors import InputError

    try:
        return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              repetition_penalty=args.repetition_penalty, seed=args.seed)
    except InputError as exc:  # "top_p must be ...": named as the flag the user typed
        field, rest = str(exc).split(" ", 1)
        raise InputError(f"--{field.replace('_', '-')} {rest}") from None


def check_budget(args: argparse.Namespace) -> float | None:
    from hivekeeper.planner.errors import InputError

    if args.ram_budget_gb is None:
        return None
    if not 0 < args.ram_budget_gb < 1e6:
        raise InputError(f"--ram-budget-gb must be a positive number of GB, got {args.ram_budget_gb}")
    if args.swarm:
        raise InputError("--ram-budget-gb applies to local runs; with --swarm the blocks run on the servers")
    return args.ram_budget_gb * 1e9


def set_threads() -> None:
    from hivekeeper.core.offload.local_plan import use_runtime_threads

    use_runtime_threads()


class Runner:
    """An opened model (local engine or swarm client) with its tokenizer and a description of the plan used."""

    def __init__(self, model, tokenizer, plan_info: dict, description: str, is_demo: bool,
                 failovers: list[dict] | None = None):
        self.model, self.tokenizer, self.plan_info, self.description = model, tokenizer, plan_info, description
        self.is_demo = is_demo
        self.failovers = failovers  # a swarm client's failovers so far (None for a local run)

    def close(self) -> None:
        self.model.close()


def resolve_model(args: argparse.Namespace):
    """(checkpoint folder, tokenizer, ModelConfig) of --model; for --swarm only the client's files are fetched."""
    from hivekeeper.core.runtime.checkpoint import load_config, resolve_checkpoint
    from hivekeeper.core.runtime.tokenizer import load_tokenizer

    if args.swarm:
        path = resolve_checkpoint(args.model, blocks=(0, 0), embeddings=True)
    else:
        path = resolve_checkpoint(args.model)
    return path, load_tokenizer(path), load_config(path)


def prepare_kernels() -> None:
    """Load the CPU decode kernels now, saying so on stderr first when they have to be compiled (the first run
    after an install waits seconds for the compiler, before any token)."""
    from hivekeeper.core.runtime.kernels import native_kernels

    seconds = native_kernels.load_saying(lambda words: print(words, file=sys.stderr, flush=True))
    if seconds is not None:
        print(f"kernels {native_kernels.status()} after {seconds:.0f} s", file=sys.stderr, flush=True)


def check_run_options(args: argparse.Namespace) -> None:
    """Where the blocks run and with which plan, as given, checked before the kernels compile or a model loads (bad
    input is one line at once): a swarm run takes no --quant and needs --initial-peers; a local one a valid --plan
    and --quant."""
    from hivekeeper.planner.errors import InputError

    if args.swarm:
        if getattr(args, "quant", "none") != "none":
            raise InputError("--quant applies to local runs: in a swarm each server chooses its weight format")
        if not args.initial_peers:
            raise InputError("--swarm needs --initial-peers (the multiaddrs a `hivekeeper serve` printed)")
    else:
        from hivekeeper.core.offload.local_plan import check_plan_options

        check_plan_options(args.plan, getattr(args, "quant", "none"))


def check_plan_for(args: argparse.Namespace, path) -> None:
    """A --plan FILE for this model, checked before the kernels compile (one line, exit 2): a plan made for another
    model, or a file that is no plan, is refused at once."""
    if not args.swarm and args.plan != "auto":
        from hivekeeper.core.offload.local_plan import check_plan_file

        check_plan_file(args.plan, path)


def open_runner(args: argparse.Namespace, path, tokenizer, config, *, batch: int, prompt_len: int,
                max_length: int, ram_budget: float | None, drop_page_cache: bool = False) -> Runner:
    """Load the model for this run: the engine with a plan, or a swarm client."""
    from hivekeeper.core.offload.local_plan import plan_local_run

    check_run_options(args)
    check_plan_for(args, path)
    prepare_kernels()
    is_demo = _is_demo(path)
    if args.swarm:
        from hivekeeper.core.swarm.client.inference import SwarmModel

        model = SwarmModel(args.model, initial_peers=args.initial_peers, dht_prefix=args.dht_prefix)
        info = {"source": "swarm", "initial_peers": list(args.initial_peers)}
        if getattr(args, "prompts", None):  # trained prompts first in every session (core/finetune/prompted.py)
            from hivekeeper.core.finetune.prompted import swarm_prompted_model

            prompted, description = swarm_prompted_model(model, args.prompts)
            return Runner(prompted, tokenizer, {**info, "prompts": args.prompts}, description, is_demo,
                          failovers=model.client.failovers)
        return Runner(model, tokenizer, info, "blocks in the swarm, embeddings and head here", is_demo,
                      failovers=model.client.failovers)
    from hivekeeper.core.offload.offloaded_model import OffloadedModel

    prompts = getattr(args, "prompts", None)
    if prompts:  # trained prompts take the first positions of every cache: the plan counts them
        from hivekeeper.core.finetune.prompted import prompt_tokens

        extra = prompt_tokens(prompts, config)
        max_length = min(max_length + extra, config.max_position_embeddings)
        prompt_len = min(prompt_len + extra, max_length)  # (one that leaves no room is refused when generating)
    choice, plan = plan_local_run(args.plan, path, config, batch=batch, prompt_len=prompt_len,
                                  max_new_tokens=max(1, max_length - prompt_len), max_length=max_length,
                                  ram_budget_bytes=ram_budget, quant=getattr(args, "quant", "none"),
                                  measure=not getattr(args, "no_measure", False))
    check_plan_quant(args, choice, plan, path)
    say_gpu_replaced(choice, plan)
    model = OffloadedModel(path, plan, drop_page_cache=drop_page_cache)
    info = {"source": choice.source, "reason": choice.reason, "policy": choice.policy.as_dict(),
            "engine": plan.summary(), "warnings": list(choice.warnings), "predicted": choice.predicted,
            "planned_placement": planned_placement(choice.policy, len(plan.weight_tiers)),
            "run_tokens": {"prompt_len": prompt_len, "output_len": max(1, max_length - prompt_len)}}
    for warning in choice.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if prompts:  # the prompts run first in each cache, through the plan's placement (core/finetune/prompted.py)
        from hivekeeper.core.finetune.prompted import local_prompted_model

        prompted, description = local_prompted_model(model, prompts, plan.describe())
        return Runner(prompted, tokenizer, {**info, "prompts": prompts}, description, is_demo)
    return Runner(model, tokenizer, info, plan.describe(), is_demo)


def from_plan_file(choice) -> bool:
    """Whether the policy was read from a --plan FILE (not the planner's, nor the fallback)."""
    return choice.source not in ("auto", "fallback")


def check_plan_quant(args: argparse.Namespace, choice, plan, path) -> None:
    """A plan file whose weight_format is int8/nf4 for a GGUF, refused naming the file and its field (the engine's own
    refusal names --quant, which the user of a plan file never typed). The engine's condition: on a CPU every block
    comes from the quantized store, on a GPU the streamed ones."""
    from hivekeeper.planner.errors import InputError
    from hivekeeper.planner.gguf_metadata import find_gguf

    stored = plan.compute_tier == "cpu" or plan.streamed_blocks
    if from_plan_file(choice) and plan.quant != "none" and stored and find_gguf(path) is not None:
        raise InputError(f"{choice.source}: the plan's policy field weight_format is {plan.quant!r}, but {args.model} "
                         f"is a GGUF whose weights are already quantized (int8/nf4 re-quantize safetensors "
                         f"checkpoints); make a plan for it with `hivekeeper plan --model {args.model} --json`")


def gpu_share(policy: dict) -> bool:
    """Whether a policy (Policy.as_dict) puts any weights or KV cache on a GPU."""
    return any((policy.get(name) or {}).get("gpu", 0) > 0 for name in ("weights", "kv_cache"))


def say_gpu_replaced(choice, plan) -> None:
    """One line on stderr, before the run, when the policy's GPU share runs from RAM because there is no GPU."""
    if gpu_share(choice.policy.as_dict()) and plan.compute_tier != "gpu":
        where = choice.source if from_plan_file(choice) else "the plan"
        print(f"note: {where} puts weights or KV cache on a GPU, but this machine has none: they run from RAM "
              f"instead ({placement_words(plan.summary())}), so the plan's prediction is not this run's",
              file=sys.stderr)


def _is_demo(path) -> bool:
    from pathlib import Path

    try:
        return json.loads((Path(path) / "config.json").read_text()).get("hivekeeper_demo") is True
    except (OSError, ValueError, AttributeError):
        return False


def peak_rss_bytes() -> int:
    """The process's peak resident set size so far. On Linux its memory's high-water mark (/proc/self/status VmHWM),
    which starts again at exec: getrusage's ru_maxrss keeps the parent's peak across fork and exec, so a run started
    by a large process (the app, a test worker: 2.3 GB) reported that process's memory as its own."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


def current_rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def warm_up_torch_runtime() -> None:
    """Run the engine's matmul and attention paths once so torch's thread pool and the matmul/attention libraries
    allocate their own memory now: that is runtime, counted in the baseline, not in the engine's RAM budget."""
    import torch

    from hivekeeper.core.offload.offloaded_model import warm_up_runtime

    x = torch.ones(1, 4, 8, 64)
    torch.nn.functional.linear(x, torch.ones(64, 64)).sum()
    warm_up_runtime()


class TextSoFar:
    """The text generate() has made final, per sequence; with `stream` also written to stdout as it comes."""

    def __init__(self, batch: int, stream: bool):
        self.texts, self.stream = [""] * batch, stream

    def add(self, row: int, text: str) -> None:
        self.texts[row] += text
        if self.stream:
            sys.stdout.write(text)
            sys.stdout.flush()


def describe_failover(failover: dict) -> str:
    """One failover in words: which server, which blocks, what was replayed, how long it took."""
    name = f" ({failover['public_name']})" if failover.get("public_name") else ""
    start, end = failover["blocks"]
    return (f"server ...{failover['peer_id'][-8:]}{name} failed on blocks {start}:{end}; replaced, "
            f"{failover['replayed_tokens']} tokens replayed in {failover['seconds']:.2f} s")


def swarm_gave_up(args: argparse.Namespace, error: Exception) -> bool:
    """Whether `error` is the swarm being unable to go on (not bad input)."""
    if not args.swarm:
        return False
    from hivekeeper.core.swarm.client.inference import SwarmError

    return isinstance(error, SwarmError)


def report_interrupted(args: argparse.Namespace, runner: Runner, so_far: TextSoFar, error: Exception) -> None:
    """The swarm could not go on: keep what was generated on stdout (the error itself goes to stderr)."""
    if args.json:
        text = {"text": so_far.texts[0]} if args.batch == 1 else {"texts": so_far.texts}
        print(json.dumps({"error": str(error), **text, "failovers": runner.failovers or [],
                          "model": str(args.model), "plan": runner.plan_info}))
    elif so_far.stream:
        if so_far.texts[0]:
            print()  # the text so far is on stdout already
    else:
        for row, text in enumerate(so_far.texts):
            print(f"[{row}] {text}")
    for failover in runner.failovers or []:
        print(f"failover: {describe_failover(failover)}", file=sys.stderr)


# ---- prompts, and predicted against measured -----------------------------------------------------------------------
def read_prompts(args: argparse.Namespace) -> list[str]:
    """--prompt, or the non-empty lines of --prompts-file (one prompt each); errors name the file."""
    from hivekeeper.planner.errors import InputError

    if not args.prompts_file:
        if not args.prompt.strip():
            raise InputError("--prompt is empty: give the text to continue (an empty prompt would generate from the "
                             "start-of-text token alone)")
        return [args.prompt]
    if args.batch != 1:
        raise InputError("--batch goes with --prompt; with --prompts-file the batch is the file's prompts")
    from hivekeeper.core.offload.batch_run import read_prompts_file

    return read_prompts_file(args.prompts_file)  # the one reader of prompts files (the app's batch runs use it)


def tokenize_prompts(args: argparse.Namespace, tokenizer, prompts: list[str]):
    """The token ids of --prompt, or a list of equally long lists for --prompts-file (one batch, no padding)."""
    if not args.prompts_file:
        return tokenizer.encode(prompts[0])
    from hivekeeper.core.offload.batch_run import tokenize_batch

    return tokenize_batch(tokenizer, prompts, args.prompts_file)


TIER_WORDS = {"gpu": "GPU", "cpu": "RAM", "disk": "disk"}
# a run that streamed from disk this much faster than the disk reads came (at least partly) from the page cache
PAGE_CACHE_FACTOR = 1.2


def placement_words(placed: dict) -> str:
    """"blocks: 14 RAM, 16 disk; KV cache blocks: 30 disk" of {"blocks": {tier: n}, "kv_cache_blocks": {tier: n}}."""
    def tiers(counts: dict) -> str:
        return ", ".join(f"{n} {TIER_WORDS[t]}" for t, n in counts.items() if n) or "none"

    return f"blocks: {tiers(placed['blocks'])}; KV cache blocks: {tiers(placed['kv_cache_blocks'])}"


def planned_placement(policy, layers: int) -> dict:
    """Blocks per tier that a Policy's fractions name for `layers` blocks, rounded as the engine rounds them where
    it follows the policy (placement.tier_counts)."""
    from hivekeeper.planner.costmodel import TIERS

    from hivekeeper.core.offload.placement import tier_counts

    def count(tiers) -> dict:
        fractions = {"gpu": tiers.gpu, "cpu": tiers.cpu, "disk": tiers.disk}
        return {t: n for t, n in tier_counts(fractions, layers, TIERS).items() if n}

    return {"blocks": count(policy.weights), "kv_cache_blocks": count(policy.kv_cache)}


def placement_change(plan_info: dict) -> dict | None:
    """The plan's placement and the one that ran, with why they differ where known; None when they are the same."""
    policy, engine, planned = plan_info.get("policy"), plan_info.get("engine"), plan_info.get("planned_placement")
    if not policy or not engine or not planned:
        return None
    ran = {"blocks": dict(engine["blocks"]), "kv_cache_blocks": dict(engine["kv_cache_blocks"])}
    if planned == ran:
        return None
    why = []
    if gpu_share(policy) and not str(engine.get("device", "")).startswith("cuda"):
        why.append("this machine has no GPU")
    budget = engine.get("ram_budget_bytes")
    if budget is not None:
        why.append(f"--ram-budget-gb {budget / 1e9:g} puts in RAM the blocks that fit in it, the rest on disk")
    return {"planned": planned, "ran": ran, "why": why}


def placement_note(change: dict) -> str:
    why = f" ({'; '.join(change['why'])})" if change["why"] else ""
    return (f"this run placed {placement_words(change['ran'])}, not the plan's {placement_words(change['planned'])}"
            f"{why}: the predicted figures are the plan's placement, not this run's")


def tokens_words(tokens: dict) -> str:
    """"512 + 128" of {"prompt_len": 512, "output_len": 128}."""
    return f"{tokens['prompt_len']} + {tokens['output_len']}"


def tokens_note(predicted: dict, ran: dict | None) -> str | None:
    """Where a plan's prediction was made for other prompt and output tokens than this run's (local_plan.TOKENS_KEY);
    None when they are the same or unknown (a bare policy file)."""
    from hivekeeper.core.offload.local_plan import TOKENS_KEY

    tokens = predicted.get(TOKENS_KEY)
    if not tokens or not ran or tokens == ran:
        return None
    return (f"the plan's prediction is for {tokens_words(tokens)} tokens; this run was {tokens_words(ran)} (a plan "
            f"made with --prompt-len {ran['prompt_len']} --output-len {ran['output_len']} predicts this run)")


def predicted_again_note(predicted: dict) -> str | None:
    """Where a plan file's prediction was made again for this run's tokens (local_plan.plan_file_prediction): the
    plan's own figures, and the tokens they were for."""
    from hivekeeper.core.offload.local_plan import PLAN_FIGURES_KEY, TOKENS_KEY

    planned = predicted.get(PLAN_FIGURES_KEY)
    if not planned:
        return None
    figures = ", ".join(f"{name} {planned[key]:.3g}" for name, key in (("throughput", "throughput_tokens_per_s"),
                                                                      ("decode", "decode_tokens_per_s"))
                        if isinstance(planned.get(key), (int, float)))
    return (f"predicted for this run's {tokens_words(predicted[TOKENS_KEY])} tokens by the plan's policy on this "
            f"machine (the plan's figures, for {tokens_words(planned[TOKENS_KEY])} tokens: {figures} tokens/s)")


def page_cache_note(streamed_bytes_per_s: float, disk_read_bytes_per_s: float | None,
                    dropped_page_cache: bool) -> str | None:
    """Why a run streamed weights faster than the disk reads (PAGE_CACHE_FACTOR): the OS page cache held them. None
    when it did not, or when the page cache was dropped (--drop-page-cache) or the disk's figure is unknown."""
    if dropped_page_cache or not streamed_bytes_per_s or not disk_read_bytes_per_s:
        return None
    if streamed_bytes_per_s <= PAGE_CACHE_FACTOR * disk_read_bytes_per_s:
        return None
    return (f"this run streamed weights at {streamed_bytes_per_s / 1e9:.3g} GB/s, faster than the "
            f"{disk_read_bytes_per_s / 1e9:.3g} GB/s disk reads this machine's plans assume: the reads came (at least "
            "partly) from the OS page cache, not the disk; --drop-page-cache measures the disk")


def this_disk_read() -> float | None:
    """This machine's disk read bandwidth as its plans see it (the saved profile's measurement, else detected)."""
    from hivekeeper.core.machine.profiles import detect_or_load_profile

    read = detect_or_load_profile()[0].disk.read_bandwidth
    return float(read) if read else None


def predicted_vs_measured(plan_info: dict, result, *, streamed_bytes_per_s: float = 0.0,
                          disk_read_bytes_per_s: float | None = None, dropped_page_cache: bool = False) -> dict | None:
    """The plan's predicted tokens/s beside this run's: throughput (generated tokens / wall time, prefill
    included: FlexGen's metric) and decode; None when the policy came without a prediction. Its "note" says where
    the prediction is not this run's ("predicts_this_run" false): a plan made for another batch (`--plan FILE`), for
    other prompt and output tokens (a plan file that could not be predicted again for them here), or another
    placement than the one that ran (no GPU here, a --ram-budget-gb; "placement" has both); where a plan file's
    prediction was made again for this run's tokens (its own figures beside); and where the streamed weights came
    from the page cache rather than the disk (page_cache_note)."""
    from hivekeeper.planner.words import counted

    from hivekeeper.core.offload.local_plan import TOKENS_KEY

    predicted = plan_info.get("predicted")
    if not predicted:
        return None
    measured_throughput = result.new_tokens / result.total_s if result.total_s > 0 else None
    decode = result.decode_tokens_per_s
    planned = (plan_info.get("policy") or {}).get("batch_size")
    notes = [f"the plan's prediction is for a batch of {planned}; this run generated "
             f"{counted(result.batch, 'sequence')} together (a plan made with --batch {result.batch} "
             "predicts this run)"] if planned and planned != result.batch else []
    other_tokens = tokens_note(predicted, plan_info.get("run_tokens"))
    if other_tokens:
        notes.append(other_tokens)
    change = placement_change(plan_info)
    if change is not None:
        notes.append(placement_note(change))
    predicts_this_run = not notes
    for note in (predicted_again_note(predicted),
                 page_cache_note(streamed_bytes_per_s, disk_read_bytes_per_s, dropped_page_cache)):
        if note:
            notes.append(note)
    return {**({"note": "; ".join(notes)} if notes else {}), "predicts_this_run": predicts_this_run,
        **({"placement": change} if change is not None else {}),
        "throughput_tokens_per_s": {"predicted": predicted["throughput_tokens_per_s"],
                                    "measured": None if measured_throughput is None else round(measured_throughput, 4)},
        "decode_tokens_per_s": {"predicted": predicted.get("decode_tokens_per_s"),
                                "measured": None if decode is None else round(decode, 4)},
        "predicted_bottleneck": predicted.get("bottleneck"),
        "predicted_for_tokens": predicted.get(TOKENS_KEY),
    }


def describe_predicted_vs_measured(side: dict) -> str:
    def pair(key: str) -> str:
        p, m = side[key]["predicted"], side[key]["measured"]
        return f"{'n/a' if p is None else f'{p:.3g}'} vs {'n/a' if m is None else f'{m:.3g}'}"

    whose = "" if side.get("predicts_this_run", True) else " (the plan's prediction, not for this run)"
    note = f"; note: {side['note']}" if "note" in side else ""
    return (f"predicted{whose} vs measured tokens/s: throughput {pair('throughput_tokens_per_s')}, decode "
            f"{pair('decode_tokens_per_s')} (predicted bottleneck: {side['predicted_bottleneck']}){note}")


# ---- the command ---------------------------------------------------------------------------------------------------
def note_capped_tokens(asked: int, prompt_tokens: int, max_length: int, context: int) -> None:
    """Say on stderr when the model's context leaves fewer new tokens than --max-new-tokens asked for."""
    if prompt_tokens + asked > max_length:
        print(f"note: --max-new-tokens {asked} capped at {max_length - prompt_tokens}: the model's context is "
              f"{context} tokens and the prompt takes {prompt_tokens}", file=sys.stderr)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = f"{parser.description}. {RAW_COMPLETION}" if parser.description else RAW_COMPLETION
    add_model_arguments(parser)
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="the text to continue, given to the model as written (no chat template)")
    prompt.add_argument("--prompts-file", metavar="FILE",
                        help="one prompt per line, generated together as one batch (the planner's batch and "
                             "micro-batches); the prompts must have the same number of tokens")
    parser.add_argument("--batch", type=int, default=1, help="sequences generated together from --prompt")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per sequence (default 64)")
    add_sampling_arguments(parser, temperature=0.0, top_p=1.0)
    parser.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence (benchmarks)")
    parser.add_argument("--drop-page-cache", action="store_true",
                        help="evict streamed weights from the OS page cache after each read, so that every step "
                             "reads the disk (benchmarks of the disk itself)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the text and summary")


def run(args: argparse.Namespace) -> int:
    import time

    from hivekeeper.planner.errors import InputError

    if not 1 <= args.batch <= 65536:
        raise InputError(f"--batch must be an integer from 1 to 65536, got {args.batch}")
    if args.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    prompts = read_prompts(args)
    args.batch = len(prompts) if args.prompts_file else args.batch
    ram_budget = check_budget(args)
    sampling = sampling_params(args)
    check_run_options(args)

    from hivekeeper.core.runtime.generation import check_prompt_fits, context_limit, generate

    set_threads()
    path, tokenizer, config = resolve_model(args)
    check_plan_for(args, path)
    prompt_ids = tokenize_prompts(args, tokenizer, prompts)
    prompt_len = len(prompt_ids[0]) if args.prompts_file else len(prompt_ids)
    check_prompt_fits(prompt_len, config, what=args.prompts_file or "--prompt")
    if getattr(args, "prompts", None):  # the trained prompts take the first positions of the context
        from hivekeeper.core.finetune.prompted import check_room_after_prompts

        check_room_after_prompts(args.prompts, prompt_len, config, what=args.prompts_file or "--prompt")
    max_length = min(prompt_len + args.max_new_tokens, context_limit(config))
    note_capped_tokens(args.max_new_tokens, prompt_len, max_length, context_limit(config))

    prepare_kernels()  # before the warm-up, whose small block would compile them silently
    warm_up_torch_runtime()
    baseline_rss = current_rss_bytes()
    started = time.perf_counter()
    runner = open_runner(args, path, tokenizer, config, batch=args.batch, prompt_len=prompt_len,
                         max_length=max_length, ram_budget=ram_budget, drop_page_cache=args.drop_page_cache)
    so_far = TextSoFar(args.batch, stream=not args.json and args.batch == 1)
    try:
        load_s = time.perf_counter() - started
        try:
            result = generate(runner.model, prompt_ids, max_new_tokens=args.max_new_tokens, batch=args.batch,
                              sampling=sampling, tokenizer=tokenizer, ignore_eos=args.ignore_eos, on_text=so_far.add)
        except InputError as exc:
            if swarm_gave_up(args, exc):  # what was generated stays
                report_interrupted(args, runner, so_far, exc)
            raise
        streamed = getattr(runner.model, "bytes_streamed", 0)
        stages = getattr(runner.model, "stage_seconds", None)  # an offloaded model's block passes, by phase
    finally:
        runner.close()
    report = result.as_dict()
    if args.batch == 1:
        report.pop("texts")
    report.update({
        "model": str(args.model), "load_s": round(load_s, 4), "peak_rss_bytes": peak_rss_bytes(),
        "baseline_rss_bytes": baseline_rss, "bytes_streamed": streamed,
        "streamed_bytes_per_s": round(streamed / result.total_s) if streamed and result.total_s > 0 else 0,
        "stage_seconds": None if stages is None else stages.as_dict(),
        "plan": runner.plan_info, "random_weights": runner.is_demo,
    })
    disk = this_disk_read() if streamed and not args.drop_page_cache else None
    report["predicted_vs_measured"] = predicted_vs_measured(
        runner.plan_info, result, streamed_bytes_per_s=report["streamed_bytes_per_s"], disk_read_bytes_per_s=disk,
        dropped_page_cache=args.drop_page_cache)
    if runner.failovers is not None:
        report["failovers"] = runner.failovers
    if args.json:
        print(json.dumps(report))
        return 0
    if so_far.stream:
        print()  # the text was printed as it came
    else:
        for row, text in enumerate(result.texts):
            print(f"[{row}] {text}")
    tps = result.decode_tokens_per_s
    print("---")
    print(f"{result.new_tokens} new tokens ({', '.join(sorted(set(result.finish_reasons)))}); "
          f"{'n/a' if tps is None else f'{tps:.1f}'} tokens/s; first token after {result.time_to_first_token_s:.2f} s; "
          f"peak RSS {report['peak_rss_bytes'] / 1e6:.0f} MB (runtime before loading {baseline_rss / 1e6:.0f} MB)")
    print(f"plan ({runner.plan_info['source']}): {runner.description}")
    if report["predicted_vs_measured"] is not None:
        print(describe_predicted_vs_measured(report["predicted_vs_measured"]))
    for failover in runner.failovers or []:
        print(f"failover: {describe_failover(failover)}")
    if runner.is_demo:
        print("note: this is a demo checkpoint with RANDOM weights, so the text is gibberish", file=sys.stderr)
    elif not any(text.strip() for text in result.texts) and set(result.finish_reasons) == {"eos"}:
        print(ENDED_AT_ONCE, file=sys.stderr)
    return 0
