"""The one config.json reader: a Hugging Face config (a file, or a dict such as a GGUF's metadata gives) parsed into
`HFConfig`, the fields the planner's ModelSpec and the runtime's ModelConfig are both built from.

Reading it once keeps the two in agreement: which linears carry biases, the head dimension, the defaults of fields
a config may omit. They follow transformers' modeling code of each family:

- llama: q/k/v/o biases iff `attention_bias`, MLP biases iff `mlp_bias`;
- qwen2: q/k/v biases always, none on o_proj or the MLP (`attention_bias` and `mlp_bias` are not read);
- mistral, mixtral: no biases (the fields are not read);
- falcon, bloom, opt: one `bias`/`enable_bias` flag for every linear (`linear_bias`).

Every error is one line naming the file and the field (fields.Fields). What a family supports beyond its shape
(RoPE variants, activation) is the runtime's to refuse: the reader only records it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .errors import InputError
from .fields import Fields, check_integer, read_json_file

LLAMA_LIKE = ("llama", "mistral", "mixtral", "qwen2")
# model_type (lower case) -> family
FAMILIES = {"llama": "llama", "mistral": "mistral", "mixtral": "mixtral", "qwen2": "qwen2", "falcon": "falcon",
            "refinedweb": "falcon",  # Falcon-40B's original remote-code type
            "refinedwebmodel": "falcon",  # Falcon-7B's
            "bloom": "bloom", "opt": "opt"}
# transformers' defaults for fields a config may omit
DEFAULT_MAX_POSITIONS = {"llama": 2048, "qwen2": 32768, "mistral": 4096 * 32, "mixtral": 4096 * 32}
DEFAULT_ROPE_THETA = 10000.0
DEFAULT_RMS_EPS = 1e-6
DEFAULT_MISTRAL_WINDOW = 4096  # transformers' MistralConfig default when the key is absent
# config.json's dtype names (torch_dtype / dtype) -> the project's
DTYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "fp16": "fp16", "bf16": "bf16", "fp32": "fp32"}
CONFIG_DTYPE_NAMES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


@dataclass(frozen=True)
class HFConfig:
    """A model's shape and structure as its config.json says, with transformers' defaults filled in."""

    source: str  # the file (or name) errors cite
    model_type: str  # as written ("RefinedWebModel")
    family: str  # "llama", "mistral", "mixtral", "qwen2", "falcon", "bloom", "opt"
    num_layers: int
    hidden_size: int
    intermediate_size: int  # per expert for mixture-of-experts models
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    hidden_act: str = "silu"
    rms_norm_eps: float = DEFAULT_RMS_EPS
    rope_theta: float = DEFAULT_ROPE_THETA
    rope_type: str = "default"  # "default", "linear", "llama3", "yarn", ... (the runtime says which it runs)
    rope_parameters: dict = field(default_factory=dict)  # the rope_scaling / rope_parameters object as given
    partial_rotary_factor: float = 1.0
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    linear_bias: bool = False  # biases on every attention and MLP linear (falcon with bias=true, bloom, opt)
    sliding_window: int | None = None  # Mistral v0.1; Qwen2 with use_sliding_window
    sliding_layers: tuple[int, ...] = ()  # the layers that use the window
    num_experts: int = 1
    experts_per_token: int = 1
    gated_mlp: bool = True  # SwiGLU (3 matrices) vs a plain 2-matrix MLP
    norm_has_bias: bool = False  # LayerNorm vs RMSNorm
    norms_per_block: int = 2
    learned_positions: int = 0  # rows of a learned position table (OPT: max_position_embeddings + 2)
    embedding_norm: bool = False  # a LayerNorm right after the embedding (BLOOM)
    embed_proj_dim: int = 0  # OPT's word_embed_proj_dim when it differs from hidden_size
    final_norm: bool = True
    dtype: str | None = None  # "fp16", "bf16" or "fp32" as config.json's torch_dtype says; None when absent
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()


# ---- shared pieces -------------------------------------------------------------------------------------------------
def head_dim(cfg: Fields, hidden: int, heads: int, kv_heads: int, head_dim_key: str | None) -> int:
    """The head dimension, checking that the head counts fit the hidden size."""
    if kv_heads > heads or heads % kv_heads:
        raise cfg.error("num_key_value_heads", f"({kv_heads}) must divide the number of attention heads ({heads})")
    if head_dim_key and cfg.has(head_dim_key):
        return cfg.integer(head_dim_key)
    if hidden % heads:
        raise cfg.error("num_attention_heads", f"({heads}) must divide hidden_size ({hidden})")
    return hidden // heads


def config_dtype(cfg: Fields) -> str | None:
    """torch_dtype (or transformers 5's dtype) as 'fp16'/'bf16'/'fp32'; None when the config names none."""
    key = cfg.first(("torch_dtype", "dtype"))
    if key is None:
        return None
    value = cfg.doc[key]
    name = value.lower().removeprefix("torch.") if isinstance(value, str) else None
    if name not in DTYPES:
        raise cfg.error(key, f"must be one of float16, bfloat16, float32, got {value!r}")
    return DTYPES[name]


def token_ids(cfg: Fields) -> tuple[int | None, tuple[int, ...]]:
    """bos_token_id (or None) and eos_token_id (a number or a list) as a tuple."""
    bos = cfg.integer("bos_token_id", low=0, default=None)
    eos = cfg.doc.get("eos_token_id")
    listed = eos if isinstance(eos, list) else [] if eos is None else [eos]
    eos_ids = tuple(check_integer(value, 0, 10**8, where=cfg.where, name=cfg.name("eos_token_id")) for value in listed)
    return bos, eos_ids


def rope(cfg: Fields) -> dict[str, Any]:
    """RoPE settings in either layout, transformers 4 (rope_theta + rope_scaling) or 5 (rope_parameters)."""
    params = cfg.doc.get("rope_parameters") or cfg.doc.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise InputError(f"{cfg.where}: rope_parameters / rope_scaling must be an object, got {params!r}")
    theta = params.get("rope_theta", cfg.doc.get("rope_theta", DEFAULT_ROPE_THETA))
    partial = params.get("partial_rotary_factor", cfg.doc.get("partial_rotary_factor", 1.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if not isinstance(rope_type, str):
        raise cfg.error("rope_scaling", f"has a rope_type that is not a name: {rope_type!r}")
    return {"rope_theta": _positive(cfg, "rope_theta", theta), "rope_type": rope_type, "rope_parameters": params,
            "partial_rotary_factor": _positive(cfg, "partial_rotary_factor", partial)}


def _positive(cfg: Fields, name: str, value: Any) -> float:
    """A positive number (no upper bound the reader could know)."""
    return Fields({name: value}, cfg.where).number(name, 1e-30, float("inf"))


def sliding_window(cfg: Fields, family: str, num_layers: int) -> tuple[int | None, tuple[int, ...]]:
    """The attention window and the layers that use it: every layer of a Mistral (4096 when the key is absent,
    none when it is null); for Qwen2 with use_sliding_window, `layer_types` or the layers from max_window_layers."""
    if family == "mistral":
        window = cfg.integer("sliding_window", default=None) if "sliding_window" in cfg.doc \
            else DEFAULT_MISTRAL_WINDOW
        return (window, tuple(range(num_layers))) if window else (None, ())
    if family != "qwen2" or not cfg.doc.get("use_sliding_window") or not cfg.doc.get("sliding_window"):
        return None, ()
    window = cfg.integer("sliding_window")
    layer_types = cfg.doc.get("layer_types")
    if layer_types:
        if not isinstance(layer_types, list):
            raise cfg.error("layer_types", f"must be a list, got {layer_types!r}")
        return window, tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention")
    first = cfg.integer("max_window_layers", default=28, low=0)
    return window, tuple(range(first, num_layers))


# ---- families ------------------------------------------------------------------------------------------------------
def llama_like(cfg: Fields, family: str) -> dict[str, Any]:
    """Llama, Mistral, Mixtral and Qwen2: RMSNorm, SwiGLU MLP, rotary positions, grouped-query attention."""
    hidden = cfg.integer("hidden_size")
    heads = cfg.integer("num_attention_heads")
    kv_heads = cfg.integer("num_key_value_heads", default=heads)
    num_layers = cfg.integer("num_hidden_layers")
    experts, experts_per_token = 1, 1
    if family == "mixtral":
        experts = cfg.integer("num_local_experts")
        experts_per_token = cfg.integer("num_experts_per_tok", default=2)
        if experts_per_token > experts:
            raise cfg.error("num_experts_per_tok", f"({experts_per_token}) exceeds num_local_experts ({experts})")
    llama_attention_bias = family == "llama" and cfg.flag("attention_bias", False)
    window, window_layers = sliding_window(cfg, family, num_layers)
    bos, eos = token_ids(cfg)
    act = cfg.doc.get("hidden_act", "silu")
    return dict(
        num_layers=num_layers, hidden_size=hidden, intermediate_size=cfg.integer("intermediate_size"),
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim(cfg, hidden, heads, kv_heads, "head_dim"),
        vocab_size=cfg.integer("vocab_size"), tie_word_embeddings=cfg.flag("tie_word_embeddings", False),
        max_position_embeddings=cfg.integer("max_position_embeddings", default=DEFAULT_MAX_POSITIONS[family]),
        hidden_act=act if isinstance(act, str) else repr(act),
        rms_norm_eps=cfg.number("rms_norm_eps", 1e-30, 1.0, default=DEFAULT_RMS_EPS), **rope(cfg),
        qkv_bias=family == "qwen2" or llama_attention_bias, o_bias=llama_attention_bias,
        mlp_bias=family == "llama" and cfg.flag("mlp_bias", False),
        sliding_window=window, sliding_layers=window_layers,
        num_experts=experts, experts_per_token=experts_per_token, bos_token_id=bos, eos_token_ids=eos,
    )


def falcon(cfg: Fields, family: str) -> dict[str, Any]:
    """Falcon: LayerNorm, plain GELU MLP, multi-query (old) or grouped-query (new_decoder_architecture) attention."""
    hidden = cfg.integer("hidden_size", "n_embed")
    heads = cfg.integer("num_attention_heads", "n_head")
    if cfg.flag("new_decoder_architecture", cfg.doc.get("model_type") == "RefinedWeb"):
        kv_heads = cfg.integer("num_kv_heads", "n_head_kv", default=heads)
        # two norms (ln_attn, ln_mlp) unless the config asks for one shared norm (Falcon2-11B)
        norms = cfg.integer("num_ln_in_parallel_attn", default=2, high=2)
    else:
        kv_heads = 1 if cfg.flag("multi_query", True) else heads
        norms = 1 if cfg.flag("parallel_attn", True) else 2
    return dict(
        num_layers=cfg.integer("num_hidden_layers", "n_layer"), hidden_size=hidden,
        intermediate_size=cfg.integer("ffn_hidden_size", default=4 * hidden), num_heads=heads,
        num_kv_heads=kv_heads, head_dim=head_dim(cfg, hidden, heads, kv_heads, None),
        vocab_size=cfg.integer("vocab_size"), tie_word_embeddings=cfg.flag("tie_word_embeddings", True),
        max_position_embeddings=cfg.integer("max_position_embeddings", default=2048), hidden_act="gelu",
        gated_mlp=False, linear_bias=cfg.flag("bias", False), norm_has_bias=True, norms_per_block=norms,
    )


def bloom(cfg: Fields, family: str) -> dict[str, Any]:
    """BLOOM: LayerNorm (also right after the embedding), ALiBi, biases everywhere, 4×hidden GELU MLP."""
    hidden = cfg.integer("hidden_size", "n_embed")
    heads = cfg.integer("n_head", "num_attention_heads")
    return dict(
        num_layers=cfg.integer("n_layer", "num_hidden_layers"), hidden_size=hidden, intermediate_size=4 * hidden,
        num_heads=heads, num_kv_heads=heads, head_dim=head_dim(cfg, hidden, heads, heads, None),
        vocab_size=cfg.integer("vocab_size"), tie_word_embeddings=cfg.flag("tie_word_embeddings", True),
        max_position_embeddings=cfg.integer("seq_length", default=2048),  # ALiBi: no table; 2048 = training length
        hidden_act="gelu", gated_mlp=False, linear_bias=True, norm_has_bias=True, embedding_norm=True,
    )


def opt(cfg: Fields, family: str) -> dict[str, Any]:
    """OPT: LayerNorm, learned positions (offset by 2 rows), biases everywhere, ReLU MLP of ffn_dim."""
    hidden = cfg.integer("hidden_size")
    heads = cfg.integer("num_attention_heads")
    positions = cfg.integer("max_position_embeddings", default=2048)
    proj_dim = cfg.integer("word_embed_proj_dim", default=hidden)
    return dict(
        num_layers=cfg.integer("num_hidden_layers"), hidden_size=hidden, intermediate_size=cfg.integer("ffn_dim"),
        num_heads=heads, num_kv_heads=heads, head_dim=head_dim(cfg, hidden, heads, heads, None),
        vocab_size=cfg.integer("vocab_size"), tie_word_embeddings=cfg.flag("tie_word_embeddings", True),
        max_position_embeddings=positions, hidden_act="relu", gated_mlp=False,
        linear_bias=cfg.flag("enable_bias", True), norm_has_bias=True, learned_positions=positions + 2,
        embed_proj_dim=0 if proj_dim == hidden else proj_dim,
        final_norm=cfg.flag("do_layer_norm_before", True) and not cfg.flag("_remove_final_layer_norm", False),
    )


PARSERS: dict[str, Callable[[Fields, str], dict[str, Any]]] = {
    "llama": llama_like, "mistral": llama_like, "mixtral": llama_like, "qwen2": llama_like,
    "falcon": falcon, "bloom": bloom, "opt": opt,
}


def family_of(config: dict, where: str) -> tuple[str, str]:
    """(model_type as written, family), or InputError naming the file: missing or unsupported model_type."""
    model_type = config.get("model_type")
    if model_type is None:
        raise InputError(f"{where}: field 'model_type' is missing")
    if not isinstance(model_type, str) or model_type.lower() not in FAMILIES:
        raise InputError(f"{where}: field 'model_type' is {model_type!r}, not a supported family "
                         f"({', '.join(sorted(set(FAMILIES.values())))})")
    return model_type, FAMILIES[model_type.lower()]


def parse_hf_config(config: Any, source: str) -> HFConfig:
    """Parse a Hugging Face config (a dict); `source` names it in error messages."""
    if not isinstance(config, dict):
        raise InputError(f"{source}: expected a JSON object (a Hugging Face config.json)")
    model_type, family = family_of(config, source)
    cfg = Fields(config, source)
    return HFConfig(source=source, model_type=model_type, family=family, dtype=config_dtype(cfg),
                    **PARSERS[family](cfg, family))


def read_hf_config(path: str | Path) -> HFConfig:
    """Read and parse a config.json file (errors name the file)."""
    return parse_hf_config(read_config_json(path), str(path))


def read_config_json(path: str | Path) -> dict:
    """The JSON object of a config.json file, or InputError naming the file."""
    doc = read_json_file(path)
    if not isinstance(doc, dict):
        raise InputError(f"{path}: expected a JSON object (a Hugging Face config.json)")
    return doc
