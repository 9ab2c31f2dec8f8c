"""GGUF checkpoints (the format of llama.cpp, Ollama, LM Studio, GPT4All), read as if they were Hugging Face ones.

People already hold GGUF files, so a `.gguf` file (or a folder holding exactly one) works wherever a checkpoint
folder does. The file is read with the `gguf` package's GGUFReader (the llama.cpp project's own reader); from it:

- the model config: the metadata (`{arch}.block_count`, `embedding_length`, ...) is turned into a Hugging Face
  config dict and parsed by `ModelConfig.from_hf_config`, so there is one config reader;
- the weights, under Hugging Face names (`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`),
  read through the memory map and dequantized to float32 one tensor at a time (so loading a span touches only its
  blocks' bytes), with llama.cpp's Q/K row permutation undone for llama/mistral;
- the tokenizer and chat template (gguf_tokenizer.py).

`GGUFCheckpoint` has the interface of `checkpoint.Checkpoint` (`config`, `has`, `files_for`, `read`, `read_block`,
`close`), so the block/embedding/head loaders take either. Bad input (wrong magic, truncated file, an unknown
architecture or tensor type, a missing tokenizer) raises InputError with one line naming the file and the problem.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from hivekeeper.planner.errors import InputError

from hivekeeper.core.runtime.model import ModelConfig

GGUF_MAGIC = b"GGUF"
SUFFIX = ".gguf"
# llama.cpp's architecture name -> Hugging Face model_type (Mistral 7B files usually say "llama")
ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}
# architectures whose Q/K rows llama.cpp's converter permutes (for its interleaved RoPE)
PERMUTED_ARCHITECTURES = ("llama", "mistral")
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
_SPLIT_FILE = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)

# GGUF tensor name (after `blk.N.`) -> Hugging Face name (after `model.layers.N.`)
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


# ---------------------------------------------------------------------------------------------------------------
# Finding and opening files
# ---------------------------------------------------------------------------------------------------------------
def _has_magic(path: Path) -> bool:
    try:
        with open(path, "rb") as file:
            return file.read(4) == GGUF_MAGIC
    except OSError:
        return False


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file `path` names: a `.gguf` file (or any file starting with the GGUF magic), or a folder without
    safetensors weights holding exactly one `.gguf`. None when `path` is no GGUF (e.g. a Hugging Face folder);
    InputError when a folder holds several, or the file is one part of a split GGUF."""
    path = Path(path).expanduser()
    if path.is_file():
        if path.suffix.lower() != SUFFIX and not _has_magic(path):
            return None
        if _SPLIT_FILE.search(path.name):
            raise InputError(f"{path}: split GGUF files are not supported; merge the parts into one file first "
                             f"(llama.cpp: `llama-gguf-split --merge {path.name} merged.gguf`)")
        return path
    if not path.is_dir() or any(path.glob("model*.safetensors*")):
        return None
    found = sorted(p for p in path.iterdir() if p.suffix.lower() == SUFFIX and p.is_file())
    if len(found) > 1:
        names = ", ".join(p.name for p in found[:4]) + (", ..." if len(found) > 4 else "")
        raise InputError(f"{path}: holds {len(found)} GGUF files ({names}); pass the one to use as the model")
    return find_gguf(found[0]) if found else None


def is_gguf(path: str | Path) -> bool:
    """Whether `path` is a GGUF file or a folder holding one (see find_gguf); never raises."""
    try:
        return find_gguf(path) is not None
    except InputError:
        return True  # it is GGUF, just not usable as it is: opening it says why


def _require_gguf(path: str | Path) -> Path:
    found = find_gguf(path)
    if found is None:
        raise InputError(f"{path}: not a GGUF file (nor a folder holding one)")
    return found


@functools.lru_cache(maxsize=4)
def _cached_reader(path: str, _mtime_ns: int, _size: int):
    """GGUFReader parses every metadata value up front (seconds for a large vocabulary), so the loaders of one
    process (span, embedding, head, tokenizer) share a reader per file version."""
    from gguf import GGUFReader

    return GGUFReader(path, "r")


def open_reader(path: str | Path):
    """The gguf package's GGUFReader of the GGUF at `path`; InputError for anything that is not a valid GGUF."""
    file = _require_gguf(path)
    try:
        stat = file.stat()
        with open(file, "rb") as handle:
            head = handle.read(4)
    except OSError as exc:
        raise InputError(f"{file}: cannot read ({exc.strerror or exc})") from None
    if head != GGUF_MAGIC:
        raise InputError(f"{file}: not a GGUF file (it starts with {head!r}, a GGUF starts with {GGUF_MAGIC!r})")
    try:
        return _cached_reader(str(file.resolve()), stat.st_mtime_ns, stat.st_size)
    except ImportError:
        raise InputError(f"{file}: reading GGUF files needs the `gguf` package (pip install gguf)") from None
    except Exception as exc:  # the reader raises ValueError/IndexError/KeyError on truncated or garbled data
        raise InputError(f"{file}: corrupt or truncated GGUF file ({type(exc).__name__}: {_one_line(exc)})") from None


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def field(reader, key: str, default=None):
    """One metadata value (a str, number, bool or list), or `default` when the key is absent."""
    entry = reader.get_field(key)
    if entry is None or not entry.types:
        return default
    return entry.contents()


# ---------------------------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------------------------
def architecture(reader, source: str) -> str:
    arch = field(reader, "general.architecture")
    if arch is None:
        raise InputError(f"{source}: no 'general.architecture' in the GGUF metadata")
    if arch not in ARCHITECTURES:
        raise InputError(f"{source}: GGUF architecture {arch!r} is not supported; supported: "
                         f"{', '.join(ARCHITECTURES)}")
    return arch


# Hugging Face config field -> GGUF metadata key (after "{arch}."), for the fields every file must give
_REQUIRED = {"num_hidden_layers": "block_count", "hidden_size": "embedding_length",
             "intermediate_size": "feed_forward_length", "num_attention_heads": "attention.head_count"}


def hf_config_dict(reader, source: str) -> dict:
    """A Hugging Face config dict (what config.json would say) from the GGUF metadata."""
    arch = architecture(reader, source)
    tensors = {t.name: t for t in reader.tensors}

    def meta(key: str, default=None):
        return field(reader, f"{arch}.{key}", default)

    cfg = {name: meta(key) for name, key in _REQUIRED.items()}
    for name, key in _REQUIRED.items():
        if cfg[name] is None:
            raise InputError(f"{source}: the GGUF metadata has no {arch}.{key}")
    cfg.update({
        "model_type": ARCHITECTURES[arch],
        "num_key_value_heads": meta("attention.head_count_kv", cfg["num_attention_heads"]),
        "rms_norm_eps": _float32(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": _float32(meta("rope.freq_base", 10000.0)),
        "max_position_embeddings": meta("context_length"),
        "vocab_size": _vocab_size(reader, tensors, arch),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": field(reader, "tokenizer.ggml.eos_token_id"),
        "hidden_act": "silu",
        "head_dim": meta("attention.key_length"),
    })
    cfg = {key: value for key, value in cfg.items() if value is not None}  # absent: the family's default
    cfg.update(_optional_fields(reader, tensors, arch, cfg, source))
    return cfg


def _optional_fields(reader, tensors: dict, arch: str, cfg: dict, source: str) -> dict:
    """Biases, sliding window, partial rotary and RoPE scaling: only what the file says differs from the default."""
    extra = {}
    head_dim = cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    rotary = field(reader, f"{arch}.rope.dimension_count")
    if rotary is not None and rotary != head_dim:
        extra["partial_rotary_factor"] = rotary / head_dim  # the parser refuses it, naming the file
    if arch in PERMUTED_ARCHITECTURES and "blk.0.attn_q.bias" in tensors:
        extra["attention_bias"] = True
    if "blk.0.ffn_up.bias" in tensors:
        extra["mlp_bias"] = True
    if ARCHITECTURES[arch] == "mistral":  # None = full attention (what llama.cpp does)
        extra["sliding_window"] = field(reader, f"{arch}.attention.sliding_window")
    scaling = _rope_scaling(reader, tensors, arch, source)
    if scaling is not None:
        extra["rope_scaling"] = scaling
    return extra


def _float32(value: float) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def _vocab_size(reader, tensors: dict, arch: str) -> int | None:
    """The embedding's rows (the model's vocabulary; a tokenizer may list fewer), else the metadata's counts."""
    embedding = tensors.get("token_embd.weight")
    if embedding is not None and len(embedding.shape) == 2:
        return int(embedding.shape[1])  # GGUF lists dimensions innermost first: [hidden, vocab]
    tokens = reader.get_field("tokenizer.ggml.tokens")
    return field(reader, f"{arch}.vocab_size") or (len(tokens.data) if tokens is not None else None)


def _rope_scaling(reader, tensors: dict, arch: str, source: str) -> dict | None:
    """RoPE scaling: linear (or another type, named so the parser refuses it) from the metadata, or Llama 3.1's
    scaling, which llama.cpp stores as per-frequency factors in a `rope_freqs.weight` tensor."""
    kind = field(reader, f"{arch}.rope.scaling.type")
    factor = field(reader, f"{arch}.rope.scaling.factor")
    if kind not in (None, "none") and factor not in (None, 0, 1.0):
        return {"rope_type": kind, "factor": factor}
    if "rope_freqs.weight" in tensors:
        return _llama3_scaling(reader, tensors["rope_freqs.weight"], arch, source)
    return None


def _llama3_scaling(reader, tensor, arch: str, source: str) -> dict:
    """The llama3 rope_scaling whose factors equal the file's rope_freqs (Llama 3.1/3.2/3.3 all use low 1, high 4,
    original context 8192; only the factor differs)."""
    freqs = np.asarray(tensor.data, dtype=np.float32).reshape(-1)
    theta = float(field(reader, f"{arch}.rope.freq_base", 10000.0))
    dims = 2 * freqs.size
    wavelength = 2 * np.pi * theta ** (np.arange(0, dims, 2) / dims)
    factor, low, high, old = float(freqs.max()), 1.0, 4.0, 8192
    smooth = np.clip((old / wavelength - low) / (high - low), 0.0, 1.0)
    expected = 1.0 / ((1 - smooth) / factor + smooth)
    if not np.allclose(freqs, expected, rtol=1e-3):
        raise InputError(f"{source}: rope_freqs.weight holds RoPE factors that match no supported scaling")
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
            "original_max_position_embeddings": old}


def load_gguf_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a GGUF file (or a folder holding one)."""
    reader = open_reader(path)
    source = str(_require_gguf(path))
    return ModelConfig.from_hf_config(hf_config_dict(reader, source), source=source)


# ---------------------------------------------------------------------------------------------------------------
# Tensors
# ---------------------------------------------------------------------------------------------------------------
def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor, or None for tensors the runtime does not use (rope_freqs...)."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    match = _BLOCK_TENSOR.match(gguf_name)
    if match is None or match.group(2) not in _BLOCK_NAMES:
        return None
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"


def torch_shape(tensor) -> tuple[int, ...]:
    """A GGUF tensor's shape in torch order (GGUF lists dimensions innermost first)."""
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


def dequantize(tensor, source: str = "") -> Tensor:
    """A GGUF tensor (a ReaderTensor) as a float32 torch tensor in torch order; its bytes are read from the memory
    map now. InputError for a type this runtime does not dequantize."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    kind = tensor.tensor_type.name
    if kind not in SUPPORTED_TYPES:
        raise InputError(f"{source}: tensor {tensor.name!r} has type {kind}, which is not supported; supported: "
                         f"{', '.join(SUPPORTED_TYPES)}")
    data = tensor.data
    if tensor.tensor_type == GGMLQuantizationType.F32:
        values = np.array(data, dtype=np.float32)  # a copy: the memory map is read-only and stays the file's
    else:
        values = gguf_dequantize(np.asarray(data), tensor.tensor_type)
    return torch.from_numpy(np.ascontiguousarray(values).reshape(torch_shape(tensor)))


def unpermute_qk(weight: Tensor, heads: int) -> Tensor:
    """Undo llama.cpp's converter, which reorders each head's rows of q/k (weight or bias) from the Hugging Face
    half-split RoPE layout to interleaved pairs: reshape(heads, 2, d/2, ...).swapaxes(1, 2)."""
    shape = weight.shape
    return weight.reshape(heads, shape[0] // heads // 2, 2, *shape[1:]).transpose(1, 2).reshape(shape)


class GGUFCheckpoint:
    """A GGUF file opened as a checkpoint: its config, its tensors under Hugging Face names, its tokenizer.

    The same interface as checkpoint.Checkpoint; `read` dequantizes one tensor to float32 from the memory map."""

    def __init__(self, path: str | Path):
        self.path = _require_gguf(path)
        self.source = str(self.path)
        self.reader = open_reader(self.path)
        self.architecture = architecture(self.reader, self.source)
        self.config = ModelConfig.from_hf_config(hf_config_dict(self.reader, self.source), source=self.source)
        self.tensors = {}  # Hugging Face name -> ReaderTensor
        for tensor in self.reader.tensors:
            name = hf_name(tensor.name)
            if name is not None:
                self.tensors[name] = tensor
        self._check_types()
        self.weight_map = {name: self.path.name for name in self.tensors}

    def _check_types(self) -> None:
        """Fail on an unsupported tensor type when opening, before any weight is loaded."""
        for tensor in self.tensors.values():
            if tensor.tensor_type.name not in SUPPORTED_TYPES:
                raise InputError(f"{self.source}: tensor {tensor.name!r} has type {tensor.tensor_type.name}, which "
                                 f"is not supported; supported: {', '.join(SUPPORTED_TYPES)}")

    def has(self, name: str) -> bool:
        return name in self.tensors

    def files_for(self, names: list[str]) -> list[str]:
        """[the file name] when every tensor is in the file; a missing one is an InputError (as Checkpoint's)."""
        for name in names:
            if name not in self.tensors:
                raise InputError(f"{self.source}: tensor {name!r} is missing from the GGUF file")
        return [self.path.name] if names else []

    def tensor_type(self, name: str) -> str:
        """How a tensor is stored: 'Q4_1', 'F32', ..."""
        self.files_for([name])
        return self.tensors[name].tensor_type.name

    def stored_bytes(self, name: str) -> int:
        """The bytes a tensor takes in the file (what a packed, still-quantized copy would hold)."""
        self.files_for([name])
        return int(self.tensors[name].n_bytes)

    def read(self, name: str, dtype: torch.dtype | None = None, shape: tuple[int, ...] | None = None) -> Tensor:
        """One tensor under its Hugging Face name, dequantized (Q/K rows unpermuted), converted to `dtype`."""
        self.files_for([name])
        tensor = dequantize(self.tensors[name], self.source)
        if shape is not None and tuple(tensor.shape) != tuple(shape):
            raise InputError(f"{self.source}: tensor {self.tensors[name].name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(shape)}")
        if self.architecture in PERMUTED_ARCHITECTURES:
            if ".self_attn.q_proj." in name:
                tensor = unpermute_qk(tensor, self.config.num_heads)
            elif ".self_attn.k_proj." in name:
                tensor = unpermute_qk(tensor, self.config.num_kv_heads)
        return tensor if dtype is None or tensor.dtype == dtype else tensor.to(dtype)

    def read_block(self, layer: int, dtype: torch.dtype) -> dict[str, Tensor]:
        """Every tensor of one layer, keyed by its name inside the block (`self_attn.q_proj.weight`, ...)."""
        from hivekeeper.core.runtime.checkpoint import _expected_block_shapes, block_tensor_names  # here: checkpoint may import this module

        names = block_tensor_names(self.config, layer)
        self.files_for(names)  # fail on a missing tensor before reading anything
        expected = _expected_block_shapes(self.config)
        prefix = f"model.layers.{layer}."
        return {name[len(prefix):]: self.read(name, dtype, expected[name[len(prefix):]]) for name in names}

    def tokenizer(self):
        """The tokenizer and chat template from the metadata (a runtime.tokenizer.Tokenizer)."""
        from hivekeeper.core.runtime.gguf_tokenizer import tokenizer_from_reader

        return tokenizer_from_reader(self.reader, self.source)

    def close(self) -> None:
        """Nothing to release per checkpoint: the reader (and its memory map) is shared, see _cached_reader."""


def load_gguf_tokenizer(path: str | Path):
    """The tokenizer of a GGUF file (or a folder holding one)."""
    from hivekeeper.core.runtime.gguf_tokenizer import tokenizer_from_reader

    return tokenizer_from_reader(open_reader(path), str(_require_gguf(path)))
