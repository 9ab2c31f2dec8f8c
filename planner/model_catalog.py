"""The model catalog and config.json parsing: turn a Hugging Face config into a ModelSpec.

The catalog is data: planner/data/models/<org>--<name>.json holds the hub's config.json of each model, verbatim, and
goes through the same parser as a user's file. Supported model_type values: llama (Llama 1, 2, 3, 3.1, 3.2 and
TinyLlama), mistral, mixtral, qwen2, falcon (old and new_decoder_architecture; RefinedWeb aliases), bloom, opt.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

from .errors import InputError
from .models import ModelSpec

MODELS_DIR = Path(__file__).parent / "data" / "models"

_DTYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "fp16": "fp16", "bf16": "bf16", "fp32": "fp32"}


# ---- catalog ------------------------------------------------------------------------------------------------------
def _catalog_files() -> dict[str, Path]:
    return {path.stem.replace("--", "/"): path for path in sorted(MODELS_DIR.glob("*.json"))}


def model_ids() -> list[str]:
    """Hub ids of every catalog model, sorted."""
    return sorted(_catalog_files(), key=str.lower)


def _catalog_path(model_id: str) -> Path | None:
    """Exact id first, then case-insensitive, then the bare name after the org ('Llama-2-7b-hf') when unique."""
    files = _catalog_files()
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
        raise InputError(f"unknown model {model_id!r}; catalog ids: {', '.join(model_ids())} "
                         "(or pass a config.json file or a folder holding one)")
    return spec_from_hf_config(_read_json(path), path.stem.replace("--", "/"), source=str(path))


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
    """A ModelSpec from a catalog id, a config.json file, a folder holding one, or a hub id in the local HF cache."""
    path = Path(arg).expanduser()
    if path.is_dir():
        config_path = path / "config.json"
        if not config_path.is_file():
            raise InputError(f"{path}: folder has no config.json")
        return spec_from_hf_config(_read_json(config_path), path.resolve().name, source=str(config_path))
    if path.is_file():
        name = path.resolve().parent.name if path.name == "config.json" else path.stem
        return spec_from_hf_config(_read_json(path), name, source=str(path))
    if arg.endswith(".json") or arg.startswith((".", "/", "~")):
        raise InputError(f"{arg}: no such file or folder")
    if _catalog_path(arg) is None and "/" in arg:
        cached = cached_config_path(arg)
        if cached is not None:
            return spec_from_hf_config(_read_json(cached), arg, source=str(cached))
    return get_model(arg)


def _read_json(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise InputError(f"{path}: expected a JSON object (a Hugging Face config.json)")
    return doc


# ---- config.json parsing -------------------------------------------------------------------------------------------
class _Config:
    """Typed, checked reads of config fields; every error names the source and the field."""

    def __init__(self, config: dict, source: str):
        self.config = config
        self.source = source

    def error(self, key: str, problem: str) -> InputError:
        return InputError(f"{self.source}: field {key!r} {problem}")

    def integer(self, *keys: str, default: int | None = None, minimum: int = 1, maximum: int = 10**8) -> int:
        """The first of `keys` present (aliases, e.g. n_layer / num_hidden_layers), as a checked integer."""
        for key in keys:
            value = self.config.get(key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
                raise self.error(key, f"must be an integer, got {value!r}")
            if not minimum <= value <= maximum:
                raise self.error(key, f"must be between {minimum} and {maximum}, got {value}")
            return int(value)
        if default is None:
            raise self.error(keys[0], "is missing")
        return default

    def flag(self, key: str, default: bool) -> bool:
        value = self.config.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.error(key, f"must be true or false, got {value!r}")
        return value

    def dtype(self) -> str:
        for key in ("torch_dtype", "dtype"):
            value = self.config.get(key)
            if value is None:
                continue
            if not isinstance(value, str) or value.lower() not in _DTYPES:
                raise self.error(key, f"must be one of float16, bfloat16, float32, got {value!r}")
            return _DTYPES[value.lower()]
        return "bf16"


def _attention_shape(cfg: _Config, hidden: int, heads: int, kv_heads: int, head_dim_key: str | None) -> int:
    """Head dimension, checking that the head counts fit the hidden size."""
    if kv_heads > heads or heads % kv_heads:
        raise cfg.error("num_key_value_heads", f"({kv_heads}) must divide the number of attention heads ({heads})")
    if head_dim_key and cfg.config.get(head_dim_key) is not None:
        return cfg.integer(head_dim_key)
    if hidden % heads:
        raise cfg.error("num_attention_heads", f"({heads}) must divide hidden_size ({hidden})")
    return hidden // heads


def _llama_like(cfg: _Config, name: str, family: str) -> ModelSpec:
    """Llama, Mistral, Mixtral and Qwen2: RMSNorm, SwiGLU MLP, rotary positions, grouped-query attention."""
    hidden = cfg.integer("hidden_size")
    heads = cfg.integer("num_attention_heads")
    kv_heads = cfg.integer("num_key_value_heads", default=heads)
    head_dim = _attention_shape(cfg, hidden, heads, kv_heads, "head_dim")
    default_positions = {"llama": 2048, "qwen2": 32768}.get(family, 4096 * 32)
    attention_bias = cfg.flag("attention_bias", False)
    experts, experts_per_token = 1, 1
    if family == "mixtral":
        experts = cfg.integer("num_local_experts")
        experts_per_token = cfg.integer("num_experts_per_tok", default=2)
        if experts_per_token > experts:
            raise cfg.error("num_experts_per_tok", f"({experts_per_token}) exceeds num_local_experts ({experts})")
    return ModelSpec(
        name=name,
        family=family,
        num_layers=cfg.integer("num_hidden_layers"),
        hidden_size=hidden,
        intermediate_size=cfg.integer("intermediate_size"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=cfg.integer("vocab_size"),
        tie_word_embeddings=cfg.flag("tie_word_embeddings", False),
        max_position_embeddings=cfg.integer("max_position_embeddings", default=default_positions),
        num_experts=experts,
        experts_per_token=experts_per_token,
        qkv_bias=family == "qwen2" or attention_bias,  # Qwen2 always biases q, k and v
        out_bias=attention_bias,
        mlp_bias=cfg.flag("mlp_bias", False),
        torch_dtype=cfg.dtype(),
    )


def _falcon(cfg: _Config, name: str, family: str) -> ModelSpec:
    """Falcon: LayerNorm, plain GELU MLP, multi-query (old) or grouped-query (new_decoder_architecture) attention."""
    hidden = cfg.integer("hidden_size", "n_embed")
    heads = cfg.integer("num_attention_heads", "n_head")
    new_arch = cfg.flag("new_decoder_architecture", cfg.config.get("model_type") == "RefinedWeb")
    if new_arch:
        kv_heads = cfg.integer("num_kv_heads", "n_head_kv", default=heads)
        # two norms (ln_attn, ln_mlp) unless the config asks for one shared norm (Falcon2-11B)
        norms = cfg.integer("num_ln_in_parallel_attn", default=2, maximum=2)
    else:
        kv_heads = 1 if cfg.flag("multi_query", True) else heads
        norms = 1 if cfg.flag("parallel_attn", True) else 2
    head_dim = _attention_shape(cfg, hidden, heads, kv_heads, None)
    return ModelSpec(
        name=name,
        family="falcon",
        num_layers=cfg.integer("num_hidden_layers", "n_layer"),
        hidden_size=hidden,
        intermediate_size=cfg.integer("ffn_hidden_size", default=4 * hidden),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=cfg.integer("vocab_size"),
        tie_word_embeddings=cfg.flag("tie_word_embeddings", True),
        max_position_embeddings=cfg.integer("max_position_embeddings", default=2048),
        gated_mlp=False,
        linear_bias=cfg.flag("bias", False),
        norm_has_bias=True,
        norms_per_block=norms,
        torch_dtype=cfg.dtype(),
    )


def _bloom(cfg: _Config, name: str, family: str) -> ModelSpec:
    """BLOOM: LayerNorm (also right after the embedding), ALiBi, biases everywhere, 4×hidden GELU MLP."""
    hidden = cfg.integer("hidden_size", "n_embed")
    heads = cfg.integer("n_head", "num_attention_heads")
    return ModelSpec(
        name=name,
        family="bloom",
        num_layers=cfg.integer("n_layer", "num_hidden_layers"),
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=_attention_shape(cfg, hidden, heads, heads, None),
        vocab_size=cfg.integer("vocab_size"),
        tie_word_embeddings=cfg.flag("tie_word_embeddings", True),
        max_position_embeddings=cfg.integer("seq_length", default=2048),  # ALiBi: no table; 2048 = training length
        gated_mlp=False,
        linear_bias=True,
        norm_has_bias=True,
        embedding_norm=True,
        torch_dtype=cfg.dtype(),
    )


def _opt(cfg: _Config, name: str, family: str) -> ModelSpec:
    """OPT: LayerNorm, learned positions (offset by 2 rows), biases everywhere, ReLU MLP of ffn_dim."""
    hidden = cfg.integer("hidden_size")
    heads = cfg.integer("num_attention_heads")
    positions = cfg.integer("max_position_embeddings", default=2048)
    proj_dim = cfg.integer("word_embed_proj_dim", default=hidden)
    final_norm = cfg.flag("do_layer_norm_before", True) and not cfg.flag("_remove_final_layer_norm", False)
    return ModelSpec(
        name=name,
        family="opt",
        num_layers=cfg.integer("num_hidden_layers"),
        hidden_size=hidden,
        intermediate_size=cfg.integer("ffn_dim"),
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=_attention_shape(cfg, hidden, heads, heads, None),
        vocab_size=cfg.integer("vocab_size"),
        tie_word_embeddings=cfg.flag("tie_word_embeddings", True),
        max_position_embeddings=positions,
        gated_mlp=False,
        linear_bias=cfg.flag("enable_bias", True),
        norm_has_bias=True,
        learned_positions=positions + 2,
        embed_proj_dim=0 if proj_dim == hidden else proj_dim,
        final_norm=final_norm,
        torch_dtype=cfg.dtype(),
    )


_PARSERS: dict[str, tuple[str, Callable[[_Config, str, str], ModelSpec]]] = {
    "llama": ("llama", _llama_like),
    "mistral": ("mistral", _llama_like),
    "mixtral": ("mixtral", _llama_like),
    "qwen2": ("qwen2", _llama_like),
    "falcon": ("falcon", _falcon),
    "refinedweb": ("falcon", _falcon),  # Falcon-40B's original remote-code type
    "refinedwebmodel": ("falcon", _falcon),  # Falcon-7B's
    "bloom": ("bloom", _bloom),
    "opt": ("opt", _opt),
}


def spec_from_hf_config(config: dict[str, Any], name: str, *, source: str | None = None) -> ModelSpec:
    """Parse a Hugging Face config.json (as a dict) into a ModelSpec; `source` names the file in error messages."""
    where = source or name
    if not isinstance(config, dict):
        raise InputError(f"{where}: expected a JSON object (a Hugging Face config.json)")
    model_type = config.get("model_type")
    if model_type is None:
        raise InputError(f"{where}: field 'model_type' is missing")
    if not isinstance(model_type, str) or model_type.lower() not in _PARSERS:
        raise InputError(f"{where}: field 'model_type' is {model_type!r}, not a supported family "
                         f"({', '.join(sorted({family for family, _ in _PARSERS.values()}))})")
    family, parse = _PARSERS[model_type.lower()]
    return parse(_Config(config, where), name, family)
