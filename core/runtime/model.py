"""Llama-family decoder blocks (Llama 1/2/3/3.1, Mistral, Qwen2) with a KV cache that the caller owns.

The pieces are separate so a node can hold any subset of them: `Embedding` (token ids -> hidden), `Span` (blocks
[start, end), each a `Block`), `Head` (final norm + LM head). `KVCache` is allocated by the caller for a fixed
max_length, so a server knows every byte up front. Weights use Hugging Face's tensor names; inside a block q/k/v and
gate/up are fused into one matrix each (fewer, larger matmuls), and `Block.load_state_dict` accepts the separate HF
tensors and fuses them.

Inference callers run under `torch.inference_mode()`; nothing here forces it, so a server can also run backward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hivekeeper.planner.errors import InputError
from hivekeeper.planner.model_config import (CONFIG_DTYPE_NAMES, DEFAULT_RMS_EPS, DEFAULT_ROPE_THETA, HFConfig,
                                             parse_hf_config, read_config_json)

from hivekeeper.core.runtime.kernels import cpu_decode
from hivekeeper.core.runtime.kernels.cpu_matmul import Linear, linear

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")



# ---------------------------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class ModelConfig:
    """The shape of a Llama-family model, read from a Hugging Face config.json (through planner/model_config.py,
    the reader the planner's ModelSpec is built from too)."""

    family: str  # "llama" | "mistral" | "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = DEFAULT_RMS_EPS
    rope_theta: float = DEFAULT_ROPE_THETA
    rope_scaling: dict | None = None  # normalised: {"rope_type": "llama3"|"linear", ...}; None = plain RoPE
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 (and Llama with attention_bias) have biases on q, k, v
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    o_bias: bool = False  # Llama with attention_bias=true also has a bias on o_proj
    mlp_bias: bool = False  # Llama with mlp_bias=true
    sliding_window: int | None = None  # Mistral v0.1; Qwen2 with use_sliding_window
    sliding_layers: tuple[int, ...] = field(default=())  # layers that use the window (all for Mistral)
    torch_dtype: str | None = None  # dtype the checkpoint is stored in ("bfloat16", "float16", "float32"), if said

    # ---- derived ------------------------------------------------------------------------------------------------
    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def window_of(self, layer: int) -> int | None:
        """The sliding attention window of a layer (keys within the last `window` positions), or None."""
        if self.sliding_window is not None and layer in self.sliding_layers:
            return self.sliding_window
        return None

    def block_param_count(self) -> int:
        h, i = self.hidden_size, self.intermediate_size
        count = h * (self.q_dim + 2 * self.kv_dim) + self.q_dim * h + 3 * h * i + 2 * h
        if self.qkv_bias:
            count += self.q_dim + 2 * self.kv_dim
        if self.o_bias:
            count += h
        if self.mlp_bias:
            count += 2 * i + h
        return count

    # ---- parsing ------------------------------------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, cfg: dict, source: str = "config.json") -> "ModelConfig":
        """Parse a Hugging Face config dict; `source` names it in error messages."""
        check_family(cfg, source)
        return cls.from_parsed(parse_hf_config(cfg, source))

    @classmethod
    def from_parsed(cls, parsed: HFConfig) -> "ModelConfig":
        """The runtime's config from the planner's config.json reader (model_config.py), refusing what the blocks
        here cannot run (another activation, odd head sizes, RoPE variants other than SUPPORTED_ROPE_TYPES)."""
        source = parsed.source
        if parsed.family not in SUPPORTED_FAMILIES:
            raise InputError(f"{source}: model_type {parsed.model_type!r} is not supported; supported: "
                             f"{', '.join(SUPPORTED_FAMILIES)}")
        if parsed.head_dim % 2:
            raise InputError(f"{source}: head_dim {parsed.head_dim} must be even for rotary embeddings")
        if parsed.hidden_act != "silu":
            raise InputError(f"{source}: hidden_act {parsed.hidden_act!r} is not supported (only 'silu')")
        return cls(
            family=parsed.family,
            vocab_size=parsed.vocab_size,
            hidden_size=parsed.hidden_size,
            intermediate_size=parsed.intermediate_size,
            num_layers=parsed.num_layers,
            num_heads=parsed.num_heads,
            num_kv_heads=parsed.num_kv_heads,
            head_dim=parsed.head_dim,
            rms_norm_eps=parsed.rms_norm_eps,
            rope_theta=parsed.rope_theta,
            rope_scaling=rope_scaling(parsed),
            max_position_embeddings=parsed.max_position_embeddings,
            tie_word_embeddings=parsed.tie_word_embeddings,
            qkv_bias=parsed.qkv_bias,
            bos_token_id=parsed.bos_token_id,
            eos_token_ids=parsed.eos_token_ids,
            o_bias=parsed.o_bias,
            mlp_bias=parsed.mlp_bias,
            sliding_window=parsed.sliding_window,
            sliding_layers=parsed.sliding_layers,
            torch_dtype=CONFIG_DTYPE_NAMES.get(parsed.dtype),
        )

    @classmethod
    def from_folder(cls, path: str | Path) -> "ModelConfig":
        """Read `config.json` from a checkpoint folder."""
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise InputError(f"{config_path}: not found (is {path} a Hugging Face checkpoint folder?)")
        return cls.from_hf_config(read_config_json(config_path), source=str(config_path))


def check_family(cfg: dict, source: str) -> None:
    """A config dict whose model_type the runtime runs (llama, mistral, qwen2), else InputError naming the file."""
    if not isinstance(cfg, dict):
        raise InputError(f"{source}: expected a JSON object")
    family = cfg.get("model_type")
    if family is None:
        raise InputError(f"{source}: missing field 'model_type'")
    if family not in SUPPORTED_FAMILIES:
        raise InputError(
            f"{source}: model_type {family!r} is not supported; supported: {', '.join(SUPPORTED_FAMILIES)}"
        )


def rope_scaling(parsed: HFConfig) -> dict | None:
    """The RoPE scaling the blocks apply, normalised: {"rope_type": "llama3"|"linear", ...}; None = plain RoPE."""
    source, params, rope_type = parsed.source, parsed.rope_parameters, parsed.rope_type
    if any(isinstance(value, dict) for value in params.values()):
        raise InputError(f"{source}: per-layer rope parameters are not supported")
    if parsed.partial_rotary_factor != 1.0:
        raise InputError(f"{source}: partial_rotary_factor is not supported")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise InputError(
            f"{source}: rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return None
    try:
        factor = float(params["factor"])
        if rope_type == "linear":
            return {"rope_type": "linear", "factor": factor}
        return {
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": float(params["low_freq_factor"]),
            "high_freq_factor": float(params["high_freq_factor"]),
            "original_max_position_embeddings": int(params.get("original_max_position_embeddings",
                                                               parsed.max_position_embeddings)),
        }
    except KeyError as exc:
        raise InputError(f"{source}: rope scaling {rope_type!r} needs field {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise InputError(f"{source}: rope scaling {rope_type!r} has a field that is not a number ({exc})") from None


# ---------------------------------------------------------------------------------------------------------------
# Rotary position embeddings
# ---------------------------------------------------------------------------------------------------------------
def rope_inverse_frequencies(config: ModelConfig) -> Tensor:
    """inv_freq [head_dim / 2] in fp32, with Llama-3.1 ("llama3") or linear scaling applied."""
    d = config.head_dim
    # explicit device: blocks are built under torch.device("meta") when loading
    exponents = torch.arange(0, d, 2, dtype=torch.int64, device="cpu").float() / d
    inv_freq = 1.0 / (config.rope_theta ** exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    # llama3: keep high frequencies, divide low frequencies by `factor`, interpolate smoothly in between
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelength - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelength >= old_context / high) & (wavelength <= old_context / low)
    return torch.where(is_medium, smoothed, scaled)


class RotaryTable:
    """cos/sin tables [positions, head_dim] per (device, dtype), grown on demand; shared by the blocks of a span.

    A plain object (not a Module) so that sharing it among blocks neither duplicates state_dict entries nor needs
    moving with `.to()`: a table is built on whatever device and dtype the hidden states arrive in.
    """

    def __init__(self, config: ModelConfig):
        self.inv_freq = rope_inverse_frequencies(config)
        self.max_positions = config.max_position_embeddings
        self._tables: dict[tuple[torch.device, torch.dtype], tuple[Tensor, Tensor]] = {}

    def get(self, start: int, length: int, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, signed sin for positions [start, start + length), each [length, 1, head_dim] (see apply_rotary)."""
        key = (device, dtype)
        table = self._tables.get(key)
        if table is None or table[0].shape[0] < start + length:
            self._tables[key] = table = self._build(start + length, device, dtype)
        return table[0][start : start + length], table[1][start : start + length]

    def _build(self, needed: int, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        size = min(max(256, 1 << (needed - 1).bit_length()), max(needed, self.max_positions))
        with torch.inference_mode(False), torch.no_grad():
            positions = torch.arange(size, dtype=torch.float32, device=device)
            freqs = torch.outer(positions, self.inv_freq.to(device))  # [size, head_dim / 2]
            cos, sin = freqs.cos(), freqs.sin()
            # the sign of rotate_half's first half is folded into the table: rotate_half(x) * sin == roll(x) * sin±
            cos = torch.cat((cos, cos), dim=-1)[:, None, :]  # [size, 1, head_dim], broadcast over heads
            signed_sin = torch.cat((-sin, sin), dim=-1)[:, None, :]
            return cos.to(dtype), signed_sin.to(dtype)


def apply_rotary(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """Rotate x [batch, t, heads, head_dim] by its positions' angles (cos, signed_sin [t, 1, head_dim] from
    RotaryTable): x * cos + rotate_half(x) * sin, where rotate_half(x) = cat(-x2, x1) = roll(x) with the sign in
    the table."""
    return (x * cos).addcmul_(x.roll(x.shape[-1] // 2, dims=-1), signed_sin)


# ---------------------------------------------------------------------------------------------------------------
# Layers
# ---------------------------------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one fused op
        # normalise in fp32, scale in the model dtype (as the reference does, so bf16 results match)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def _fuse_on_load(pieces: tuple[str, ...], fused: str):
    """A load_state_dict pre-hook: concatenate HF's separate projections (`q_proj`, `k_proj`, ...) into one."""

    def hook(module, state_dict, prefix, *args):
        for suffix in ("weight", "bias"):
            names = [f"{prefix}{piece}.{suffix}" for piece in pieces]
            if all(name in state_dict for name in names):
                state_dict[f"{prefix}{fused}.{suffix}"] = torch.cat([state_dict.pop(name) for name in names], dim=0)

    return hook


class Attention(nn.Module):
    """Grouped-query self-attention with rotary embeddings; q, k, v computed by one fused matmul."""

    def __init__(self, config: ModelConfig, window: int | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.window = window
        self.qkv_proj = Linear(config.hidden_size, config.q_dim + 2 * config.kv_dim, bias=config.qkv_bias)
        self.o_proj = Linear(config.q_dim, config.hidden_size, bias=config.o_bias)
        self.register_load_state_dict_pre_hook(_fuse_on_load(("q_proj", "k_proj", "v_proj"), "qkv_proj"))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor | None, v_cache: Tensor | None,
                position: int) -> Tensor:
        """x [b, t, hidden] -> [b, t, hidden]; cos/sin from RotaryTable.get; caches as in Block.forward."""
        b, t, _ = x.shape
        nh, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x).view(b, t, nh + 2 * nkv, d)
        qk = apply_rotary(qkv[:, :, : nh + nkv], cos, sin)  # q and k rotated together: [b, t, nh + nkv, d]
        q = qk[:, :, :nh].transpose(1, 2)  # [b, nh, t, d]
        k = qk[:, :, nh:].transpose(1, 2)  # [b, nkv, t, d]
        v = qkv[:, :, nh + nkv :].transpose(1, 2)  # [b, nkv, t, d]
        if k_cache is not None:
            end = position + t
            k_cache[:, :, position:end].copy_(k)
            v_cache[:, :, position:end].copy_(v)
            keys, values, first_key = k_cache[:, :, :end], v_cache[:, :, :end], 0
            if self.window is not None and t == 1 and end > self.window:
                # decode step: keys older than the window are simply not read
                first_key = end - self.window
                keys, values = keys[:, :, first_key:], values[:, :, first_key:]
        else:
            keys, values, first_key = k, v, position
        out = self.attend(q, keys, values, position, first_key)  # [b, nh, t, d]
        return self.o_proj(out.transpose(1, 2).reshape(b, t, nh * d))

    def attend(self, q: Tensor, keys: Tensor, values: Tensor, position: int, first_key: int) -> Tensor:
        """Causal (and windowed) grouped-query attention of q [b, nh, t, d] at positions [position, position + t)
        over keys/values [b, nkv, n, d] at positions [first_key, first_key + n) -> [b, nh, t, d]."""
        b, nh, t, d = q.shape
        nkv, n_keys = keys.shape[1], keys.shape[2]
        groups = nh // nkv
        if t == 1:
            # one query per head: fold each kv head's query group into the "sequence" axis, no mask, no repeat
            out = F.scaled_dot_product_attention(q.reshape(b, nkv, groups, d), keys, values)
            return out.view(b, nh, 1, d)
        gqa = groups > 1
        last_key = first_key + n_keys - 1
        plain_causal = first_key == position and last_key == position + t - 1  # square, top-left aligned
        if plain_causal and (self.window is None or t <= self.window):
            return F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=gqa)
        mask = _causal_mask(position, t, first_key, n_keys, self.window, q.device)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=gqa)


def _causal_mask(position: int, t: int, first_key: int, n_keys: int, window: int | None,
                 device: torch.device) -> Tensor:
    """Boolean [t, n_keys]: query at position+i sees keys at first_key+j <= position+i (within the window)."""
    q_pos = torch.arange(position, position + t, device=device)[:, None]
    k_pos = torch.arange(first_key, first_key + n_keys, device=device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up computed by one fused matmul."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.register_load_state_dict_pre_hook(_fuse_on_load(("gate_proj", "up_proj"), "gate_up_proj"))

    def forward(self, x: Tensor) -> Tensor:
        gate_up = self.gate_up_proj(x)
        gate, up = gate_up[..., : self.intermediate_size], gate_up[..., self.intermediate_size :]
        return self.down_proj(F.silu(gate).mul_(up))


class Block(nn.Module):
    """One decoder layer: x + attn(norm(x)), then x + mlp(norm(x)). Weights under HF's names (`self_attn.q_proj...`)
    load through `load_state_dict`, which fuses q/k/v and gate/up."""

    def __init__(self, config: ModelConfig, layer_index: int = 0, rotary: RotaryTable | None = None):
        super().__init__()
        self.layer_index = layer_index
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, window=config.window_of(layer_index))
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)
        self.rotary = rotary if rotary is not None else RotaryTable(config)

    def forward(self, hidden: Tensor, k_cache: Tensor | None = None, v_cache: Tensor | None = None,
                position: int = 0, rope: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """hidden [batch, new_tokens, hidden] at positions [position, position + new_tokens).

        k_cache, v_cache: [batch, kv_heads, max_length, head_dim] views of a KVCache, or None for a plain causal
        forward over `hidden` alone. The new tokens' K/V are written at [position, position + new_tokens).
        rope: (cos, signed sin) of these positions from RotaryTable.get (a Span looks them up once for all blocks).
        """
        cos, sin = rope if rope is not None else self.rotary.get(position, hidden.shape[1], hidden.device, hidden.dtype)
        arrays = cpu_decode.prepare(self, hidden, k_cache)
        if arrays is not None:  # one token per row on the CPU: the same step in numpy
            return cpu_decode.decode_step(self, arrays, hidden, k_cache, v_cache, position, (cos, sin))
        attn = self.self_attn(self.input_layernorm(hidden), cos, sin, k_cache, v_cache, position)
        hidden = attn.add_(hidden)
        mlp = self.mlp(self.post_attention_layernorm(hidden))
        return mlp.add_(hidden)


# ---------------------------------------------------------------------------------------------------------------
# KV cache
# ---------------------------------------------------------------------------------------------------------------
def add_prompt(hidden: Tensor, prompt: Tensor) -> Tensor:
    """hidden [batch, tokens, width] with a block's deep prompt [batch, prefix, width] added to its first positions
    (fine-tuning's deep_ptune, Petals' rule: a step's first min(prefix, tokens) positions)."""
    prefix = min(prompt.shape[1], hidden.shape[1])
    prompt = prompt.to(device=hidden.device, dtype=hidden.dtype)
    return torch.cat([hidden[:, :prefix] + prompt[:, :prefix], hidden[:, prefix:]], dim=1)


class KVCache:
    """Keys and values of a span's blocks for one session, pre-allocated for max_length tokens.

    k, v: [num_blocks, batch, num_kv_heads, max_length, head_dim]; `length` tokens are stored (every row alike).
    """

    def __init__(self, k: Tensor, v: Tensor, length: int = 0):
        if k.shape != v.shape or k.dim() != 5:
            raise ValueError(f"KVCache: k {tuple(k.shape)} and v {tuple(v.shape)} must be equal 5-d shapes")
        self.k, self.v, self.length = k, v, length
        self._views = (k.unbind(0), v.unbind(0))  # per-block views, made once (not per step)

    @classmethod
    def allocate(cls, config: ModelConfig, num_blocks: int, batch: int, max_length: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> "KVCache":
        if max_length > config.max_position_embeddings:
            raise InputError(
                f"max_length {max_length} exceeds the model's context (max_position_embeddings "
                f"{config.max_position_embeddings})"
            )
        if num_blocks < 0 or batch <= 0 or max_length <= 0:
            raise InputError(f"KV cache: bad size (blocks {num_blocks}, batch {batch}, max_length {max_length})")
        shape = (num_blocks, batch, config.num_kv_heads, max_length, config.head_dim)
        # never read beyond `length`, so uninitialised memory is fine
        return cls(torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))

    @staticmethod
    def nbytes_for(config: ModelConfig, num_blocks: int, batch: int, max_length: int,
                   dtype: torch.dtype = torch.float32) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * num_blocks * batch * config.num_kv_heads * max_length * config.head_dim * element

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    @property
    def num_blocks(self) -> int:
        return self.k.shape[0]

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    @property
    def max_length(self) -> int:
        return self.k.shape[3]

    def block(self, index: int) -> tuple[Tensor, Tensor]:
        """(k, v) of one block: [batch, kv_heads, max_length, head_dim] views."""
        return self._views[0][index], self._views[1][index]

    def reorder(self, hypo_ids: Tensor) -> None:
        """Beam search: row i becomes the old row hypo_ids[i], for the stored prefix of every block."""
        hypo_ids = hypo_ids.to(device=self.k.device, dtype=torch.long)
        if hypo_ids.shape != (self.batch,):
            raise InputError(f"hypo_ids must have shape ({self.batch},), got {tuple(hypo_ids.shape)}")
        n = self.length
        for cache in (self.k, self.v):
            cache[:, :, :, :n].copy_(cache[:, :, :, :n].index_select(1, hypo_ids))

    def truncate(self, length: int) -> None:
        """Rewind to the first `length` tokens (the rest is overwritten by later steps)."""
        if not 0 <= length <= self.length:
            raise InputError(f"cannot rewind the KV cache to {length} tokens: it holds {self.length}")
        self.length = length


# ---------------------------------------------------------------------------------------------------------------
# The pieces a node holds
# ---------------------------------------------------------------------------------------------------------------
class Span(nn.Module):
    """Blocks [start, end) of a model, run in order."""

    def __init__(self, config: ModelConfig, start: int, end: int, blocks: list[Block] | None = None):
        super().__init__()
        if not 0 <= start <= end <= config.num_layers:
            raise InputError(f"block range [{start}, {end}) is outside the model's {config.num_layers} blocks")
        self.config, self.start, self.end = config, start, end
        self.rotary = blocks[0].rotary if blocks else RotaryTable(config)
        if blocks is None:
            blocks = [Block(config, i, self.rotary) for i in range(start, end)]
        if len(blocks) != end - start:
            raise ValueError(f"Span [{start}, {end}) needs {end - start} blocks, got {len(blocks)}")
        for block in blocks:
            block.rotary = self.rotary
        self.blocks = nn.ModuleList(blocks)

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (that of the norms: quantized linears keep theirs in another form)."""
        return self.blocks[0].input_layernorm.weight.dtype if len(self.blocks) else torch.float32

    def forward(self, hidden: Tensor, cache: KVCache | None = None) -> Tensor:
        """hidden [batch, new_tokens, hidden] -> [batch, new_tokens, hidden].

        With a cache the new tokens take positions cache.length, cache.length + 1, ... and cache.length advances.
        Without one it is a plain causal forward from position 0.
        """
        t = hidden.shape[1]
        position = cache.length if cache is not None else 0
        self._check(hidden, cache, position + t)
        if hidden.dtype != self.dtype:
            hidden = hidden.to(self.dtype)
        if t == 0:
            return hidden
        rope = self.rotary.get(position, t, hidden.device, hidden.dtype)
        native = None
        if cache is not None and t == 1:  # one token on the CPU: every block in one call of the C kernels
            native = cpu_decode.decode_blocks(self.blocks, [cache.block(i) for i in range(len(self.blocks))],
                                              hidden, position, rope)
        if native is not None:
            hidden = native
        else:
            for i, block in enumerate(self.blocks):
                k, v = cache.block(i) if cache is not None else (None, None)
                hidden = block(hidden, k, v, position, rope)
        if cache is not None:
            cache.length = position + t
        return hidden

    def prefill(self, hidden: Tensor, cache: KVCache, chunk_tokens: int = 512) -> Tensor:
        """Run a long prompt through the span in chunks of `chunk_tokens` (bounds attention memory);
        returns the hidden states of all the prompt's tokens."""
        if chunk_tokens <= 0:
            raise InputError(f"chunk_tokens must be positive, got {chunk_tokens}")
        outputs = [self(hidden[:, i : i + chunk_tokens], cache) for i in range(0, hidden.shape[1], chunk_tokens)]
        return torch.cat(outputs, dim=1) if len(outputs) != 1 else outputs[0]

    def _check(self, hidden: Tensor, cache: KVCache | None, end_position: int) -> None:
        if hidden.dim() != 3 or hidden.shape[-1] != self.config.hidden_size:
            raise InputError(
                f"hidden states must be [batch, tokens, {self.config.hidden_size}], got {tuple(hidden.shape)}"
            )
        if end_position > self.config.max_position_embeddings:
            raise InputError(
                f"{end_position} tokens exceed the model's context (max_position_embeddings "
                f"{self.config.max_position_embeddings})"
            )
        if cache is None:
            return
        if cache.num_blocks != len(self.blocks):
            raise InputError(f"KV cache holds {cache.num_blocks} blocks, the span has {len(self.blocks)}")
        if cache.batch != hidden.shape[0]:
            raise InputError(f"KV cache batch is {cache.batch}, hidden states have batch {hidden.shape[0]}")
        if end_position > cache.max_length:
            raise InputError(f"{end_position} tokens exceed the KV cache's max_length {cache.max_length}")
        if cache.k.dtype != self.dtype or cache.k.device != hidden.device:
            raise InputError(
                f"KV cache is {cache.k.dtype} on {cache.k.device}; the span computes in {self.dtype} on {hidden.device}"
            )


class Embedding(nn.Module):
    """Token ids [batch, t] -> hidden [batch, t, hidden] (`model.embed_tokens.weight`)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size))

    def forward(self, token_ids: Tensor) -> Tensor:
        return F.embedding(token_ids, self.weight)


class Head(nn.Module):
    """Final norm and LM head: hidden [batch, t, hidden] -> logits [batch, t, vocab].

    `lm_head` may be the embedding matrix itself (tied models): pass it as `weight` to share the memory.
    """

    def __init__(self, config: ModelConfig, weight: nn.Parameter | None = None):
        super().__init__()
        self.config = config
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.weight = weight if weight is not None else nn.Parameter(torch.empty(config.vocab_size, config.hidden_size))

    def forward(self, hidden: Tensor) -> Tensor:
        logits = cpu_decode.head_step(self, hidden)  # one row on the CPU: norm and LM head in one native call
        return logits if logits is not None else linear(self.norm(hidden), self.weight)
