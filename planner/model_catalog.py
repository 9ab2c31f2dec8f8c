"""The model catalog and where a ModelSpec comes from (`load_model_spec`): a catalog id, a file, the local HF cache.

The catalog is data: planner/data/models/<org>--<name>.json holds the hub's config.json of each model, verbatim, and
goes through the same parser as a user's file: model_config.py, the one config.json reader (the runtime's
ModelConfig is built from it too). Supported model_type values: llama (Llama 1, 2, 3, 3.1, 3.2 and TinyLlama),
mistral, mixtral, qwen2, falcon (old and new_decoder_architecture; RefinedWeb aliases), bloom, opt.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any

from .errors import InputError
from .gguf_metadata import find_gguf, hf_config_dict, open_reader
from .model_config import HFConfig, parse_hf_config, read_config_json
from .models import ModelSpec

MODELS_DIR = Path(__file__).parent / "data" / "models"
# the built-in model's id (core/runtime/default_model.DEFAULT_MODEL_ID is this one; plan and the app take it as a
# model id); only suggested here, as the planner reads its GGUF file, not this id
BUILT_IN_MODEL_ID = "smollm2-135m-instruct"

# Current hub ids of catalog models Meta renamed (meta-llama/Meta-Llama-3.1-* became meta-llama/Llama-3.1-*); a base
# model maps to its Instruct twin, whose architecture (all the planner reads) is the same.
ALIASES = {f"meta-llama/Llama-3.1-{size}{suffix}": f"meta-llama/Meta-Llama-3.1-{size}-Instruct"
           for size in ("8B", "70B", "405B") for suffix in ("", "-Instruct")}

# ---- catalog ------------------------------------------------------------------------------------------------------
def _catalog_files() -> dict[str, Path]:
    return {path.stem.replace("--", "/"): path for path in sorted(MODELS_DIR.glob("*.json"))}


def model_ids() -> list[str]:
    """Hub ids of every catalog model, sorted."""
    return sorted(_catalog_files(), key=str.lower)


def _catalog_path(model_id: str) -> Path | None:
    """Exact id first, then case-insensitive, then the bare name after the org ('Llama-2-7b-hf') when unique."""
    files = _catalog_files()
    model_id = next((target for alias, target in ALIASES.items() if alias.lower() == model_id.lower()), model_id)
    if model_id in files:
        return files[model_id]
    wanted = model_id.lower()
    matches = [path for key, path in files.items() if key.lower() == wanted]
    if not matches and "/" not in model_id:
        matches = [path for key, path in files.items() if key.split("/", 1)[1].lower() == wanted]
    return matches[0] if len(matches) == 1 else None


def get_model(model_id: str) -> ModelSpec:
    """The ModelSpec of a catalog model, by hub id (case-insensitive; the bare name also works when unique)."""
    path = _catalog_path(model_id)
    if path is None:
        close = did_you_mean(model_id)
        hint = f"did you mean {' or '.join(close)}? " if close else ""
        raise InputError(f"unknown model {model_id!r}; {hint}catalog ids: {', '.join(model_ids())} "
                         "(or pass a config.json file or a folder holding one)")
    return spec_from_hf_config(read_config_json(path), path.stem.replace("--", "/"), source=str(path))


def did_you_mean(model_id: str) -> list[str]:
    """Catalog ids and the built-in model's id close to an unknown one (`closeness` at least 0.6), best first; at
    most three."""
    scores = {candidate: closeness(model_id, candidate) for candidate in [*model_ids(), BUILT_IN_MODEL_ID]}
    return sorted((c for c, score in scores.items() if score >= 0.6), key=lambda c: -scores[c])[:3]


def closeness(given: str, candidate: str) -> float:
    """difflib's ratio of two model ids, case-insensitive, on the whole ids or on their last path parts (the names
    after the org: 'HuggingFaceTB/SmolLM2-135M-Instruct' is 'smollm2-135m-instruct'), whichever is closer."""
    given, candidate = given.lower(), candidate.lower()
    pairs = ((given, candidate), (given.rsplit("/", 1)[-1], candidate.rsplit("/", 1)[-1]))
    return max(difflib.SequenceMatcher(None, a, b).ratio() for a, b in pairs)


def hf_cache_dir() -> Path:
    """The local Hugging Face hub cache (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub)."""
    if os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE"):
        return Path(os.environ.get("HF_HUB_CACHE") or os.environ["HUGGINGFACE_HUB_CACHE"]).expanduser()
    xdg_cache = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    home = os.environ.get("HF_HOME") or os.path.join(xdg_cache, "huggingface")
    return Path(home).expanduser() / "hub"


def cached_config_path(model_id: str) -> Path | None:
    """config.json of a hub model already in the local cache (the snapshot refs/main points at), never downloading."""
    repo = hf_cache_dir() / f"models--{model_id.replace('/', '--')}"
    snapshots = repo / "snapshots"
    if not snapshots.is_dir():
        return None
    try:
        main = (repo / "refs" / "main").read_text().strip()
    except OSError:
        main = ""
    candidates = [snapshots / main / "config.json"] if main else []
    candidates += sorted(snapshots.glob("*/config.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    return next((path for path in candidates if path.is_file()), None)


def load_model_spec(arg: str) -> ModelSpec:
    """A ModelSpec from a catalog id, a config.json file, a folder holding one, a GGUF file (or a folder holding one),
    or a hub id in the local HF cache."""
    path = Path(arg).expanduser()
    gguf_file = find_gguf(path)
    if gguf_file is not None:  # the config from the GGUF's metadata (its sizes: gguf_metadata.gguf_sizes)
        source = str(gguf_file)
        return spec_from_hf_config(hf_config_dict(open_reader(gguf_file), source), gguf_file.stem, source=source)
    if path.is_dir():
        config_path = path / "config.json"
        if not config_path.is_file():
            raise InputError(f"{path}: folder has no config.json")
        return spec_from_hf_config(read_config_json(config_path), path.resolve().name, source=str(config_path))
    if path.is_file():
        name = path.resolve().parent.name if path.name == "config.json" else path.stem
        return spec_from_hf_config(read_config_json(path), name, source=str(path))
    if arg.endswith(".json") or arg.startswith((".", "/", "~")):
        raise InputError(f"{arg}: no such file or folder")
    if _catalog_path(arg) is None and "/" in arg:
        cached = cached_config_path(arg)
        if cached is not None:
            return spec_from_hf_config(read_config_json(cached), arg, source=str(cached))
    return get_model(arg)


# ---- config.json parsing -------------------------------------------------------------------------------------------
def spec_from_hf_config(config: dict[str, Any], name: str, *, source: str | None = None) -> ModelSpec:
    """Parse a Hugging Face config.json (as a dict) into a ModelSpec; `source` names the file in error messages."""
    return spec_from_config(parse_hf_config(config, source or name), name)


def spec_from_config(config: HFConfig, name: str) -> ModelSpec:
    """The ModelSpec of a parsed config (model_config.py, the reader the runtime's ModelConfig shares)."""
    return ModelSpec(
        name=name,
        family=config.family,
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        vocab_size=config.vocab_size,
        tie_word_embeddings=config.tie_word_embeddings,
        max_position_embeddings=config.max_position_embeddings,
        num_experts=config.num_experts,
        experts_per_token=config.experts_per_token,
        gated_mlp=config.gated_mlp,
        linear_bias=config.linear_bias,
        qkv_bias=config.qkv_bias,
        out_bias=config.o_bias,
        mlp_bias=config.mlp_bias,
        norm_has_bias=config.norm_has_bias,
        norms_per_block=config.norms_per_block,
        learned_positions=config.learned_positions,
        embedding_norm=config.embedding_norm,
        embed_proj_dim=config.embed_proj_dim,
        final_norm=config.final_norm,
        torch_dtype=config.dtype or "bf16",
    )
