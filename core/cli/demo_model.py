"""`hivekeeper demo-model DIR`: write a Llama checkpoint with seeded random weights, for offline use and tests."""

from __future__ import annotations

import argparse
import sys

# Kept in step with demo_model.PRESETS / FAMILIES / DTYPES; repeated here so that `--help` does not import torch.
_PRESET_NAMES = ("tiny", "100m", "1b")
_FAMILIES = ("llama", "mistral", "qwen2")
_DTYPES = ("fp32", "bf16", "fp16")
_SIZE_FLAGS = ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab", "max_position")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", metavar="DIR", help="folder to create (must not exist, or be empty)")
    parser.add_argument("--preset", choices=_PRESET_NAMES, default="tiny",
                        help="starting sizes: tiny (2 layers, hidden 64; the default), 100m (~125M params), "
                             "1b (~1.1B params); the flags below override them")
    parser.add_argument("--layers", type=int, help="number of transformer blocks")
    parser.add_argument("--hidden", type=int, help="hidden size")
    parser.add_argument("--intermediate", type=int, help="MLP size (default: about 8/3 of hidden)")
    parser.add_argument("--heads", type=int, help="attention heads (must divide hidden)")
    parser.add_argument("--kv-heads", type=int, help="key/value heads (must divide heads)")
    parser.add_argument("--vocab", type=int, help="vocabulary size (at least 262)")
    parser.add_argument("--max-position", type=int, help="context length in config.json")
    parser.add_argument("--seed", type=int, default=0, help="random seed; the same seed writes identical files")
    parser.add_argument("--dtype", choices=_DTYPES, default="fp32", help="weight dtype (default fp32)")
    parser.add_argument("--shard-size-mb", type=float,
                        help="split the weights into shards of at most this size, with model.safetensors.index.json")
    parser.add_argument("--family", choices=_FAMILIES, default="llama", help="architecture (default llama)")
    parser.add_argument("--tie-embeddings", action="store_true", help="share the embedding with the LM head")
    parser.add_argument("--force", action="store_true", help="replace DIR if it holds an earlier demo checkpoint")


def run(args: argparse.Namespace) -> int:
    from hivekeeper.core.runtime.demo_model import PRESETS, DemoSpec, write_demo_checkpoint

    sizes = dict(PRESETS[args.preset])
    explicit = {name: getattr(args, name) for name in _SIZE_FLAGS if getattr(args, name) is not None}
    if "heads" in explicit and "kv_heads" not in explicit:
        sizes.pop("kv_heads")  # derive it from the new head count instead of the preset's
    if "hidden" in explicit and "intermediate" not in explicit:
        sizes.pop("intermediate")
    sizes.update(explicit)
    spec = DemoSpec(
        **sizes,
        seed=args.seed,
        dtype=args.dtype,
        family=args.family,
        tie_embeddings=args.tie_embeddings,
        shard_size_mb=args.shard_size_mb,
    )

    show_progress = sys.stderr.isatty()
    last_percent = -1

    def progress(done: int, total: int) -> None:
        nonlocal last_percent
        percent = 100 * done // max(total, 1)
        if show_progress and percent != last_percent:
            last_percent = percent
            print(f"\rwriting weights: {percent:3d}%", end="", file=sys.stderr, flush=True)

    result = write_demo_checkpoint(args.dir, spec, overwrite=args.force, progress=progress)
    if show_progress:
        print(file=sys.stderr)
    s = result.spec
    print(f"Wrote {result.path}: {s.family}, {result.num_params:,} parameters ({s.layers} layers, hidden {s.hidden}, "
          f"{s.heads} heads / {s.kv_heads} KV heads, vocab {s.vocab}), "
          f"{result.weight_bytes / 1e6:,.1f} MB of {s.dtype} "
          f"weights in {sum(f.endswith('.safetensors') for f in result.files)} file(s).")
    print("NOTE: the weights are RANDOM (seed %d): this model is untrained and generates gibberish. "
          "It is for offline tests and benchmarks only." % s.seed)
    return 0
