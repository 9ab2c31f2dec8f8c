"""GGUF files (llama.cpp, Ollama, LM Studio, GPT4All) without torch: finding them, their config, their real sizes.

The one GGUF reader of the project: the `gguf` package's GGUFReader (the llama.cpp project's own, numpy only), opened
here, so the planner can read a GGUF's shape and stored bytes while staying free of torch, and the runtime
(core/runtime/gguf.py) builds its weights and tokenizer on the same reader. From the metadata:

- `hf_config_dict`: a Hugging Face config dict (what config.json would say), parsed by the planner's and the
  runtime's config parsers like any other;
- `gguf_sizes`: what each tensor type costs (bytes per weight), the real total and each block's bytes in the file,
  and each block's bytes as the runtime holds it packed (`held_bytes`: Q8_0/Q4_0/Q4_1 linears as stored, the rest
  fp32), the one count of that for local and swarm plans.

Opening is fast: GGUFReader builds one numpy view per element of every metadata array up front (a 49152-token
vocabulary and its merges: 100k views, ~12 s on a busy machine, paid by every process that opens the default model).
`FastReader` (a GGUFReader) reads arrays of strings and numbers by a scan of their lengths instead, and gives each a
`LazyArrayField`: its `contents()` decodes the values from the file in one pass; its `parts` and `data` (the views)
are built by the package's own code on first access, so every value is what GGUFReader gives.

Bad input (wrong magic, truncated file, an unknown architecture, several files in a folder, a split file) raises
InputError with one line naming the file and the problem. A truncated file (a download cut short) is found by the
reader itself: every read past the end raises `Truncated`, said as such instead of numpy's or struct's words.
"""

from __future__ import annotations

import functools
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import InputError
from .formats import PACKED_FORMATS

GGUF_MAGIC = b"GGUF"
SUFFIX = ".gguf"
# llama.cpp's architecture name -> Hugging Face model_type (Mistral 7B files usually say "llama")
ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}
# architectures whose Q/K rows llama.cpp's converter permutes (for its interleaved RoPE)
PERMUTED_ARCHITECTURES = ("llama", "mistral")
# tensor types the runtime dequantizes (what people download); others (Q2_K, Q3_K, IQ*) are refused by name
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
SPLIT_FILE = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)
BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
# GGUF tensor name (after `blk.N.`) -> Hugging Face name (after `model.layers.N.`)
BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
# a block's linears as the runtime loads them: fused module path -> the HF pieces concatenated (by rows) into it. A
# fused linear is held packed only when every piece is stored in one and the same Q8_0/Q4_0/Q4_1 type (`packs_together`)
FUSED_LINEARS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                 "self_attn.o_proj": ("self_attn.o_proj",),
                 "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
                 "mlp.down_proj": ("mlp.down_proj",)}


# ---------------------------------------------------------------------------------------------------------------
# Finding and opening files
# ---------------------------------------------------------------------------------------------------------------
class Truncated(ValueError):
    """A read of a GGUF's header (metadata, tensor list) or tensor data that runs past the end of the file; `end`:
    where the tensor data ends (the file's full size), when known."""

    def __init__(self, part: str = "header", end: int | None = None):
        super().__init__(f"its {part} runs past the end of the file" if end is None
                         else f"its {part} runs to byte {end:,}")


def has_magic(path: Path) -> bool:
    """Whether the file at `path` starts with the GGUF magic (False when it cannot be read)."""
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
        if path.suffix.lower() != SUFFIX and not has_magic(path):
            return None
        if SPLIT_FILE.search(path.name):
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


def require_gguf(path: str | Path) -> Path:
    """The GGUF file of `path` (see find_gguf); InputError when there is none."""
    found = find_gguf(path)
    if found is None:
        raise InputError(f"{path}: not a GGUF file (nor a folder holding one)")
    return found


@functools.lru_cache(maxsize=4)
def cached_reader(path: str, mtime_ns: int, size: int):
    """The loaders of one process (config, span, embedding, head, tokenizer, plan) share a reader per file version."""
    return fast_reader_class()(path, "r")


@functools.cache
def fast_reader_class():
    """FastReader, defined on first use so that importing the planner does not import `gguf`."""
    from gguf import GGUFReader, GGUFValueType
    from gguf.gguf_reader import ReaderField

    class LazyArrayField(ReaderField):
        """A non-empty array of strings or numbers: `contents()` from one pass over the file, `parts` and `data`
        (GGUFReader's one view per element) built by GGUFReader's own code on first access."""

        def __new__(cls, reader, offset: int, name: str, key_parts: list, value_offset: int, item_type, read_values):
            self = super().__new__(cls, offset, name, [], [], [GGUFValueType.ARRAY, item_type])
            self.__dict__.update(reader=reader, key_parts=key_parts, value_offset=value_offset,
                                 read_values=read_values)
            return self

        @property
        def parts(self) -> list:
            return self.views()[0]

        @property
        def data(self) -> list:
            return self.views()[1]

        def views(self) -> tuple[list, list]:
            if "built" not in self.__dict__:
                _, parts, idxs, _ = GGUFReader._get_field_parts(self.reader, self.value_offset, GGUFValueType.ARRAY)
                self.built = (self.key_parts + parts, [idx + len(self.key_parts) for idx in idxs])
            return self.built

        def contents(self, index_or_slice: int | slice = slice(None)):
            if "values" not in self.__dict__:  # decoded on first use, as GGUFReader does (a bad string raises then)
                self.values = self.read_values()
            return self.values[index_or_slice]

    class FastReader(GGUFReader):
        """GGUFReader whose metadata arrays of strings and numbers are LazyArrayFields, and whose reads past the
        end of the file raise Truncated (GGUFReader's own raise numpy's words there, or return a short view)."""

        def _get(self, offset: int, dtype, count: int = 1, override_order=None):
            end = offset + np.dtype(dtype).itemsize * int(count)
            if end > self.data.size:
                raise Truncated()
            return super()._get(offset, dtype, count, override_order)

        def _build_tensors(self, start_offs: int, fields: list) -> None:
            try:
                super()._build_tensors(start_offs, fields)
            except Truncated:
                raise Truncated("tensor data", tensor_data_end(start_offs, fields)) from None

        def _build_fields(self, offs: int, count: int) -> int:
            for _ in range(count):
                orig_offs = offs
                kv_klen, kv_kdata = self._get_str(offs)
                offs += int(kv_klen.nbytes + kv_kdata.nbytes)
                raw_kv_type = self._get(offs, np.uint32)
                offs += int(raw_kv_type.nbytes)
                key_parts, name = [kv_klen, kv_kdata, raw_kv_type], str(bytes(kv_kdata), encoding="utf-8")
                is_array = raw_kv_type[0] == GGUFValueType.ARRAY
                lazy = self.lazy_array(orig_offs, name, key_parts, offs) if is_array else None
                if lazy is None:
                    size, parts, idxs, types = self._get_field_parts(offs, raw_kv_type[0])
                    idxs = [idx + len(key_parts) for idx in idxs]
                    self._push_field(ReaderField(orig_offs, name, key_parts + parts, idxs, types), skip_sum=True)
                else:
                    field, size = lazy
                    self._push_field(field, skip_sum=True)
                offs += size
            return offs

        def lazy_array(self, offset: int, name: str, key_parts: list, value_offset: int):
            """(LazyArrayField, its bytes) for a non-empty array of strings or numbers at `value_offset`, else None
            (nested or empty arrays, rare and short, take GGUFReader's own path)."""
            item_type = int(self._get(value_offset, np.uint32)[0])
            count = int(self._get(value_offset + 4, np.uint64)[0])
            start = value_offset + 12
            if count == 0 or item_type == GGUFValueType.ARRAY:
                return None
            if item_type == GGUFValueType.STRING:
                read_values, end = self.string_values(start, count)
            else:
                dtype = np.dtype(self.gguf_scalar_to_np[GGUFValueType(item_type)])
                end = start + count * dtype.itemsize
                view = self._get(start, dtype, count)
                read_values = view.tolist
            if end > self.data.size:
                raise Truncated()
            field = LazyArrayField(self, offset, name, key_parts, value_offset, GGUFValueType(item_type), read_values)
            return field, end - value_offset

        def string_values(self, start: int, count: int):
            """(a function decoding the `count` strings from `start`, the offset after them); a string is a u64
            length, then that many UTF-8 bytes."""
            unpack = struct.Struct("<Q" if self.endianess.name == "LITTLE" else ">Q").unpack_from
            buffer, offs, heads = memoryview(self.data), start, []
            for _ in range(count):  # the one loop per string: lengths say where the next one starts
                heads.append(offs)
                if offs + 8 > len(buffer):
                    raise Truncated()
                offs += 8 + unpack(buffer, offs)[0]
            heads.append(offs)
            return functools.partial(decode_strings, buffer, heads), offs

    return FastReader


def tensor_data_end(start: int, fields: list) -> int:
    """Where the last tensor's data ends (the size the whole file should have), from GGUFReader's tensor-info fields
    (name length, name, dimension count, dimensions, type, offset) and the data section's `start`."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    ends = [0]
    for entry in fields:
        dims, raw_type, offset = entry.parts[3], entry.parts[4], entry.parts[5]
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(int(raw_type[0]))]
        ends.append(start + int(offset[0]) + int(np.prod(dims, dtype=np.int64)) * size // block)
    return max(ends)


def decode_strings(buffer: memoryview, heads: list[int]) -> list[str]:
    """The strings whose u64 lengths start at `heads` (the last: where the next value starts), in one decode: each
    length becomes one 0xFF byte, which UTF-8 never holds, so splitting the decoded text there gives the strings.
    Text that is no UTF-8 is decoded string by string, which raises UnicodeDecodeError as GGUFReader does."""
    raw = np.array(buffer[heads[0]:heads[-1]], dtype=np.uint8)
    starts = np.asarray(heads[:-1], dtype=np.int64) - heads[0]
    keep = np.ones(raw.size, dtype=bool)
    keep[(starts[:, None] + np.arange(1, 8)).ravel()] = False
    raw[starts] = 0xFF
    text = raw[keep][1:].tobytes().decode("utf-8", errors="surrogateescape")
    strings = text.split("\udcff")
    if len(strings) == len(starts) and not re.search("[\udc80-\udcfe]", text):
        return strings
    return [str(buffer[a + 8:b], encoding="utf-8") for a, b in zip(heads, heads[1:])]


def open_reader(path: str | Path):
    """A GGUFReader (FastReader) of the GGUF at `path`; InputError for anything that is not a valid GGUF."""
    file = require_gguf(path)
    try:
        stat = file.stat()
        with open(file, "rb") as handle:
            head = handle.read(4)
    except OSError as exc:
        raise InputError(f"{file}: cannot read ({exc.strerror or exc})") from None
    if not head:
        raise InputError(f"{file}: the file is empty, not a GGUF file")
    if head != GGUF_MAGIC:
        raise InputError(f"{file}: not a GGUF file (it starts with {head!r}, a GGUF starts with {GGUF_MAGIC!r})")
    try:
        return cached_reader(str(file.resolve()), stat.st_mtime_ns, stat.st_size)
    except ImportError:
        raise InputError(f"{file}: reading GGUF files needs the `gguf` package (pip install gguf)") from None
    except Truncated as exc:
        raise InputError(f"{file}: corrupt or truncated GGUF file ({stat.st_size:,} bytes; {exc}), e.g. a download "
                         f"cut short: download or copy it again") from None
    except Exception as exc:  # the reader raises ValueError/IndexError/KeyError on truncated or garbled data
        raise InputError(f"{file}: corrupt or truncated GGUF file ({type(exc).__name__}: {one_line(exc)})") from None


def one_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type name when it has none)."""
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
    """The file's `general.architecture`, if it is one the runtime runs."""
    arch = field(reader, "general.architecture")
    if arch is None:
        raise InputError(f"{source}: no 'general.architecture' in the GGUF metadata")
    if arch not in ARCHITECTURES:
        raise InputError(f"{source}: GGUF architecture {arch!r} is not supported; supported: "
                         f"{', '.join(ARCHITECTURES)}")
    return arch


# Hugging Face config field -> GGUF metadata key (after "{arch}."), for the fields every file must give
REQUIRED_FIELDS = {"num_hidden_layers": "block_count", "hidden_size": "embedding_length",
                   "intermediate_size": "feed_forward_length", "num_attention_heads": "attention.head_count"}


def hf_config_dict(reader, source: str) -> dict:
    """A Hugging Face config dict (what config.json would say) from the GGUF metadata."""
    arch = architecture(reader, source)
    tensors = {t.name: t for t in reader.tensors}

    def meta(key: str, default=None):
        return field(reader, f"{arch}.{key}", default)

    cfg = {name: meta(key) for name, key in REQUIRED_FIELDS.items()}
    for name, key in REQUIRED_FIELDS.items():
        if cfg[name] is None:
            raise InputError(f"{source}: the GGUF metadata has no {arch}.{key}")
    if (meta("expert_count") or 0) > 1:
        raise InputError(f"{source}: mixture-of-experts GGUF files ({meta('expert_count')} experts) are not supported")
    cfg.update({
        "model_type": ARCHITECTURES[arch],
        "num_key_value_heads": meta("attention.head_count_kv", cfg["num_attention_heads"]),
        "rms_norm_eps": float32_decimal(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float32_decimal(meta("rope.freq_base", 10000.0)),
        "max_position_embeddings": meta("context_length"),
        "vocab_size": vocab_size(reader, tensors, arch),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": field(reader, "tokenizer.ggml.eos_token_id"),
        "hidden_act": "silu",
        "head_dim": meta("attention.key_length"),
        "torch_dtype": runtime_dtype(reader),
    })
    cfg = {key: value for key, value in cfg.items() if value is not None}  # absent: the family's default
    cfg.update(optional_fields(reader, tensors, arch, cfg, source))
    return cfg


def runtime_dtype(reader) -> str:
    """The dtype the runtime reads the weights as (config.json's torch_dtype): bfloat16 or float16 when every
    matrix is stored so, else float32 (quantized types are dequantized to float32)."""
    kinds = {t.tensor_type.name for t in reader.tensors if len(t.shape) == 2}
    if kinds == {"BF16"}:
        return "bfloat16"
    if kinds == {"F16"}:
        return "float16"
    return "float32"


def optional_fields(reader, tensors: dict, arch: str, cfg: dict, source: str) -> dict:
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
    scaling = rope_scaling(reader, tensors, arch, source)
    if scaling is not None:
        extra["rope_scaling"] = scaling
    return extra


def float32_decimal(value: float) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def vocab_size(reader, tensors: dict, arch: str) -> int | None:
    """The embedding's rows (the model's vocabulary; a tokenizer may list fewer), else the metadata's counts."""
    embedding = tensors.get("token_embd.weight")
    if embedding is not None and len(embedding.shape) == 2:
        return int(embedding.shape[1])  # GGUF lists dimensions innermost first: [hidden, vocab]
    tokens = reader.get_field("tokenizer.ggml.tokens")
    return field(reader, f"{arch}.vocab_size") or (len(tokens.data) if tokens is not None else None)


def rope_scaling(reader, tensors: dict, arch: str, source: str) -> dict | None:
    """RoPE scaling: linear (or another type, named so the parser refuses it) from the metadata, or Llama 3.1's
    scaling, which llama.cpp stores as per-frequency factors in a `rope_freqs.weight` tensor."""
    kind = field(reader, f"{arch}.rope.scaling.type")
    factor = field(reader, f"{arch}.rope.scaling.factor")
    if kind not in (None, "none") and factor not in (None, 0, 1.0):
        return {"rope_type": kind, "factor": factor}
    if "rope_freqs.weight" in tensors:
        return llama3_scaling(reader, tensors["rope_freqs.weight"], arch, source)
    return None


def llama3_scaling(reader, tensor, arch: str, source: str) -> dict:
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


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor, or None for tensors the runtime does not use (rope_freqs...)."""
    if gguf_name in TOP_NAMES:
        return TOP_NAMES[gguf_name]
    match = BLOCK_TENSOR.match(gguf_name)
    if match is None or match.group(2) not in BLOCK_NAMES:
        return None
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{BLOCK_NAMES[part]}.{kind}"


def unsupported_type(source: str, tensor) -> InputError:
    """The one-line error for a tensor whose type the runtime does not dequantize."""
    return InputError(f"{source}: tensor {tensor.name!r} has type {tensor.tensor_type.name}, which is not supported; "
                      f"supported: {', '.join(SUPPORTED_TYPES)}")


def check_tensor_types(reader, source: str) -> None:
    """InputError naming the first tensor the runtime loads whose type it cannot dequantize."""
    for tensor in reader.tensors:
        if tensor.tensor_type.name not in SUPPORTED_TYPES and hf_name(tensor.name) is not None:
            raise unsupported_type(source, tensor)


# ---------------------------------------------------------------------------------------------------------------
# Sizes
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TypeSize:
    """The weights of one tensor type in a file and the bytes they take there."""

    name: str  # "Q4_1", "F32", ...
    weights: int
    bytes: int

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.bytes / self.weights if self.weights else 0.0


@dataclass(frozen=True)
class GGUFSizes:
    """What a GGUF's weights take in the file, by tensor type, per block and outside the blocks."""

    path: str
    file_bytes: int  # the whole file (metadata, tokenizer included)
    types: tuple[TypeSize, ...]  # the tensors the runtime loads, by type, largest first
    block_bytes: tuple[int, ...]  # stored bytes of each block
    block_weights: tuple[int, ...]  # weights (parameters) of each block
    outside_bytes: int  # embedding, final norm and LM head
    outside_weights: int
    # each block as a server or engine holds it when it keeps the file's Q8_0/Q4_0/Q4_1 linears packed (held_bytes):
    # those at their stored bytes, every other tensor dequantized to fp32 (4 bytes a weight); the one count of it
    # (local plans, the streamed engine and swarm plans all read it here, so they size a block alike)
    packed_block_bytes: tuple[int, ...] = ()

    @property
    def tensor_bytes(self) -> int:
        """All weights the runtime loads, as stored (what a packed, still-quantized copy would hold)."""
        return sum(t.bytes for t in self.types)

    @property
    def weights(self) -> int:
        return sum(t.weights for t in self.types)

    @property
    def main_type(self) -> str:
        """The type that holds the most weights (Q4_1 for a 'Q4_1' file, whose embedding may be Q8_0)."""
        return max(self.types, key=lambda t: t.weights).name if self.types else "F32"

    def as_dict(self) -> dict:
        """JSON-ready (docs/gguf.md): the file, its tensors' bytes by type, the largest block's bytes."""
        return {
            "file": self.path, "file_bytes": self.file_bytes, "tensor_bytes": self.tensor_bytes,
            "weights": self.weights, "main_type": self.main_type,
            "types": {t.name: {"weights": t.weights, "bytes": t.bytes, "bits_per_weight": round(t.bits_per_weight, 4)}
                      for t in self.types},
            "block_bytes": max(self.block_bytes, default=0), "outside_block_bytes": self.outside_bytes,
        }


def gguf_sizes(path: str | Path) -> GGUFSizes:
    """The real sizes of the GGUF at `path` (a file or a folder holding one), from its tensor table only."""
    file = require_gguf(path)
    reader = open_reader(file)
    architecture(reader, str(file))
    check_tensor_types(reader, str(file))
    blocks = int(field(reader, f"{field(reader, 'general.architecture')}.block_count", 0))
    block_bytes, block_weights = [0] * blocks, [0] * blocks
    block_tensors: list[dict] = [{} for _ in range(blocks)]  # name inside the block -> ReaderTensor
    outside_bytes = outside_weights = 0
    by_type: dict[str, list[int]] = {}
    for tensor in reader.tensors:
        if hf_name(tensor.name) is None:
            continue  # not a weight the runtime loads (rope_freqs, ...)
        match = BLOCK_TENSOR.match(tensor.name)
        weights, stored = int(tensor.n_elements), int(tensor.n_bytes)
        totals = by_type.setdefault(tensor.tensor_type.name, [0, 0])
        totals[0] += weights
        totals[1] += stored
        if match is not None and int(match.group(1)) < blocks:
            block_bytes[int(match.group(1))] += stored
            block_weights[int(match.group(1))] += weights
            block_tensors[int(match.group(1))][f"{BLOCK_NAMES[match.group(2)]}.{match.group(3)}"] = tensor
        else:
            outside_bytes, outside_weights = outside_bytes + stored, outside_weights + weights
    types = sorted((TypeSize(name, w, b) for name, (w, b) in by_type.items()), key=lambda t: -t.bytes)
    return GGUFSizes(str(file), file.stat().st_size, tuple(types), tuple(block_bytes), tuple(block_weights),
                     outside_bytes, outside_weights, tuple(held_bytes(tensors) for tensors in block_tensors))


def packs_together(type_names) -> bool:
    """Whether a fused linear whose pieces are stored as `type_names` ('Q4_1', ...) is held packed: all of one
    Q8_0/Q4_0/Q4_1 type. Pieces of different types are dequantized to fp32, as the runtime's loader does (one fused
    matrix has one block format; core/runtime/gguf.packs)."""
    kinds = {name.lower() for name in type_names}
    return len(kinds) == 1 and kinds <= set(PACKED_FORMATS)


def held_bytes(tensors: dict) -> int:
    """The bytes a block holds packed, from its tensors (name inside the block, `self_attn.q_proj.weight`, ->
    ReaderTensor): the linears of a fused linear that packs at their stored bytes, everything else (norms, biases,
    linears of other types) at 4 bytes a weight."""
    packed = set()
    for pieces in FUSED_LINEARS.values():
        names = [f"{piece}.weight" for piece in pieces]
        if all(name in tensors for name in names) and packs_together(tensors[n].tensor_type.name for n in names):
            packed.update(names)
    return sum(int(t.n_bytes) if name in packed else 4 * int(t.n_elements) for name, t in tensors.items())
