"""Loading Llama-family weights from a Hugging Face checkpoint folder, a block range at a time.

A checkpoint folder holds config.json and safetensors weights: one model.safetensors, or shards listed by
model.safetensors.index.json. Only the shards that hold the requested tensors are opened; tensors are read through
safetensors' memory map one at a time, so loading a span never materialises the rest of the model.
A GGUF file (or a folder holding one) works wherever such a folder does: `open_checkpoint` gives a Checkpoint or a
gguf.GGUFCheckpoint (the same interface), and every loader here opens through it.
`resolve_checkpoint` turns a hub id into such a folder, downloading only the shards a block range needs, and the
default model's id (default_model.py) into its installed GGUF file.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

from hivekeeper.planner.errors import InputError
from hivekeeper.planner.gguf_metadata import SUFFIX as GGUF_SUFFIX
from hivekeeper.planner.gguf_metadata import find_gguf

from hivekeeper.core.runtime.block_tensors import block_tensor_names, read_block_tensors
from hivekeeper.core.runtime.checkpoint_files import INDEX_FILE, SIDE_FILES, SINGLE_FILE
from hivekeeper.core.runtime.default_model import is_default_model_id, resolve_default_model
from hivekeeper.core.runtime.gguf import GGUFCheckpoint, load_packed_block, load_packed_head, packed_by_default
from hivekeeper.core.runtime.kernels.cpu_matmul import pack_in_order, store_for_decode, store_linears_for_decode
from hivekeeper.core.runtime.model import Block, Embedding, Head, ModelConfig, RotaryTable, Span
from hivekeeper.core.runtime.quant.bnb import check_quant, quantize_block

log = logging.getLogger(__name__)

EMBEDDING_TENSOR = "model.embed_tokens.weight"
FINAL_NORM_TENSOR = "model.norm.weight"
LM_HEAD_TENSOR = "lm_head.weight"

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
           "fp16": torch.float16, "float16": torch.float16}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """'fp32' / 'bf16' / 'fp16' (or a torch dtype) -> torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).lower()]
    except KeyError:
        raise InputError(f"unknown dtype {dtype!r}; choose fp32, bf16 or fp16") from None


def check_device(device: str | torch.device) -> torch.device:
    """A torch device that exists on this machine (InputError otherwise)."""
    try:
        device = torch.device(device)
    except RuntimeError as exc:
        raise InputError(f"unknown device {device!r} ({exc})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InputError(f"device {device} requested but CUDA is not available on this machine")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise InputError(f"device {device} requested but only {torch.cuda.device_count()} CUDA device(s) exist")
    return device


class Checkpoint:
    """A checkpoint folder: its config, which file holds each tensor, and open memory maps of the files read so far."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise InputError(f"{self.path}: not a checkpoint folder")
        self.config = ModelConfig.from_folder(self.path)
        self._handles: dict[str, object] = {}  # file name -> open safetensors memory map
        self.weight_map = self._read_weight_map()  # tensor name -> file name (relative to the folder)

    def _read_weight_map(self) -> dict[str, str]:
        index_path = self.path / INDEX_FILE
        if index_path.is_file():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
                if not isinstance(weight_map, dict):
                    raise TypeError("weight_map is not an object")
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
                raise InputError(f"{index_path}: not a valid safetensors index ({exc})") from None
            return {str(name): str(file) for name, file in weight_map.items()}
        if (self.path / SINGLE_FILE).is_file():
            return {name: SINGLE_FILE for name in self._open(SINGLE_FILE).keys()}
        others = sorted(p.name for p in self.path.glob("*.bin")) + sorted(p.name for p in self.path.glob("*.pt*"))
        hint = f" (found {', '.join(others[:3])}: only safetensors weights are supported)" if others else ""
        raise InputError(f"{self.path}: no {SINGLE_FILE} or {INDEX_FILE}{hint}")

    def _open(self, file_name: str):
        handle = self._handles.get(file_name)
        if handle is None:
            file_path = self.path / file_name
            if not file_path.is_file():
                raise InputError(f"{file_path}: missing shard (listed in {INDEX_FILE})")
            try:
                handle = safe_open(str(file_path), framework="pt", device="cpu")
            except Exception as exc:  # safetensors raises its own error type for truncated or garbled files
                raise InputError(f"{file_path}: corrupt or truncated safetensors file ({exc})") from None
            self._handles[file_name] = handle
        return handle

    def has(self, name: str) -> bool:
        return name in self.weight_map

    def files_for(self, names: list[str]) -> list[str]:
        """The files (relative names) holding these tensors; a name not in the checkpoint is an InputError."""
        files = []
        for name in names:
            file_name = self.weight_map.get(name)
            if file_name is None:
                raise InputError(f"{self.path}: tensor {name!r} is missing from the checkpoint")
            if file_name not in files:
                files.append(file_name)
        return files

    def read(self, name: str, dtype: torch.dtype | None = None, shape: tuple[int, ...] | None = None) -> Tensor:
        """One tensor, read from its file's memory map into CPU memory (converted to `dtype`)."""
        (file_name,) = self.files_for([name])
        handle = self._open(file_name)
        try:
            tensor = handle.get_tensor(name)
        except Exception as exc:
            raise InputError(f"{self.path / file_name}: cannot read tensor {name!r} ({exc})") from None
        if shape is not None and tuple(tensor.shape) != tuple(shape):
            raise InputError(
                f"{self.path / file_name}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(shape)}"
            )
        return tensor if dtype is None or tensor.dtype == dtype else tensor.to(dtype)

    def read_block(self, layer: int, dtype: torch.dtype) -> dict[str, Tensor]:
        """Every tensor of one layer, keyed by its name inside the block (`self_attn.q_proj.weight`, ...)."""
        return read_block_tensors(self, layer, dtype)

    def close(self) -> None:
        self._handles.clear()


# ---------------------------------------------------------------------------------------------------------------
# Public loaders
# ---------------------------------------------------------------------------------------------------------------
def open_checkpoint(path: str | Path, packed: bool = False) -> Checkpoint | GGUFCheckpoint:
    """The checkpoint at `path`: a GGUFCheckpoint for a GGUF file (or a folder holding one), else a Checkpoint.
    packed: a GGUF's CPU fp32 blocks keep their Q8_0/Q4_0/Q4_1 linears packed (gguf.load_packed_block)."""
    return Checkpoint(path) if find_gguf(path) is None else GGUFCheckpoint(path, packed=packed)


def load_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a checkpoint folder (config.json) or a GGUF (its metadata)."""
    if find_gguf(path) is not None:
        return open_checkpoint(path).config
    return ModelConfig.from_folder(path)


def load_block(checkpoint: Checkpoint, layer: int, *, dtype: torch.dtype = torch.float32, device="cpu",
               quant: str = "none", rotary: RotaryTable | None = None) -> Block:
    """Build one decoder layer from an open Checkpoint (weights read from the memory map, fused, then moved)."""
    quant = check_quant(quant)
    dtype = parse_dtype(dtype)
    # quantized blocks hold their non-quantized parts (norms, biases) and compute in a 16-bit dtype
    load_dtype = dtype if quant == "none" else quant_compute_dtype(dtype, device)
    if (isinstance(checkpoint, GGUFCheckpoint) and checkpoint.packed and quant == "none"
            and dtype == torch.float32 and torch.device(device).type == "cpu"):
        block = load_packed_block(checkpoint, layer, rotary)
        store_linears_for_decode(block)  # the linears not packed (other GGUF types)
        return block
    with torch.device("meta"):
        block = Block(checkpoint.config, layer, rotary)
    block.load_state_dict(checkpoint.read_block(layer, load_dtype), strict=True, assign=True)
    block.requires_grad_(False)
    if quant != "none":
        return quantize_block(block, quant, device)
    block = block.to(device)
    store_linears_for_decode(block)  # CPU fp32 only: faster decode matmuls
    return block


def quant_compute_dtype(dtype: torch.dtype, device) -> torch.dtype:
    if dtype != torch.float32:
        return dtype
    # fp32 activations with 8/4-bit weights: bitsandbytes computes in 16 bits anyway; on CPU keep fp32 norms
    return torch.float32 if torch.device(device).type == "cpu" else torch.float16


def load_span(path: str | Path, start: int, end: int, *, dtype: str | torch.dtype = torch.float32,
              device: str | torch.device = "cpu", quant: str = "none", packed: bool | None = None) -> Span:
    """Blocks [start, end) of the checkpoint at `path`, reading only the shards that hold them.

    dtype: fp32/bf16/fp16 (compute and storage dtype); quant: "none", "int8" or "nf4" (bitsandbytes).
    packed: for a GGUF on the CPU in fp32, keep Q8_0/Q4_0/Q4_1 linears as their block bytes (QuantizedLinear)
    instead of dequantizing them; None: yes unless HIVEKEEPER_GGUF_PACKED=0 (gguf.packed_by_default).
    """
    dtype, quant = parse_dtype(dtype), check_quant(quant)
    checkpoint = open_checkpoint(path, packed=packed_by_default() if packed is None else packed)
    config = checkpoint.config
    if not (isinstance(start, int) and isinstance(end, int) and 0 <= start < end <= config.num_layers):
        raise InputError(f"block range [{start}, {end}) must be non-empty and inside the model's "
                         f"{config.num_layers} blocks")
    check_device(device)
    names = [n for layer in range(start, end) for n in block_tensor_names(config, layer)]
    files = checkpoint.files_for(names)  # a missing tensor or shard fails before any weight is read
    for file_name in files if isinstance(checkpoint, Checkpoint) else ():
        if not (checkpoint.path / file_name).is_file():
            raise InputError(f"{checkpoint.path / file_name}: missing shard (listed in {INDEX_FILE})")
    rotary = RotaryTable(config)
    try:
        blocks = [load_block(checkpoint, layer, dtype=dtype, device=device, quant=quant, rotary=rotary)
                  for layer in range(start, end)]
    finally:
        checkpoint.close()
    if quant == "none":
        pack_in_order(blocks)  # CPU fp32 weights in one buffer, in the order a decode step reads them
    return Span(config, start, end, blocks)


def load_embedding(path: str | Path, *, dtype: str | torch.dtype = torch.float32,
                   device: str | torch.device = "cpu") -> Embedding:
    """The token embedding (`model.embed_tokens.weight`)."""
    check_device(device)
    checkpoint = open_checkpoint(path)
    config = checkpoint.config
    weight = checkpoint.read(EMBEDDING_TENSOR, parse_dtype(dtype), (config.vocab_size, config.hidden_size))
    checkpoint.close()
    with torch.device("meta"):
        embedding = Embedding(config)
    embedding.load_state_dict({"weight": weight}, assign=True)
    return embedding.requires_grad_(False).to(device)


def load_head(path: str | Path, *, dtype: str | torch.dtype = torch.float32, device: str | torch.device = "cpu",
              embedding: Embedding | None = None, decode_layout: bool = True, packed: bool | None = None) -> Head:
    """The final norm and LM head. For tied models pass the loaded `embedding` to share its matrix.
    decode_layout: store an untied CPU fp32 matrix as decode reads it fastest (cpu_matmul.store_for_decode: a re-store
    briefly holds a second copy of it). packed: a GGUF's Q8_0/Q4_0/Q4_1 head matrix stays packed on the CPU in fp32
    (gguf.load_packed_head); None: as load_span decides (gguf.packed_by_default)."""
    check_device(device)
    checkpoint = open_checkpoint(path)
    config = checkpoint.config
    dtype = parse_dtype(dtype)
    shape = (config.vocab_size, config.hidden_size)
    norm = checkpoint.read(FINAL_NORM_TENSOR, dtype, (config.hidden_size,))
    packed = packed_by_default() if packed is None else packed
    if (packed and isinstance(checkpoint, GGUFCheckpoint) and dtype == torch.float32
            and torch.device(device).type == "cpu"):
        untied = checkpoint.has(LM_HEAD_TENSOR) and not config.tie_word_embeddings
        head = load_packed_head(checkpoint, LM_HEAD_TENSOR if untied else EMBEDDING_TENSOR, norm,
                                None if untied or embedding is None else embedding.weight)
        if head is not None:
            return head
    if checkpoint.has(LM_HEAD_TENSOR) and not config.tie_word_embeddings:
        weight = checkpoint.read(LM_HEAD_TENSOR, dtype, shape)
    elif config.tie_word_embeddings and embedding is not None:
        weight = None
    elif config.tie_word_embeddings:
        weight = checkpoint.read(EMBEDDING_TENSOR, dtype, shape)
    else:
        raise InputError(f"{checkpoint.path}: tensor {LM_HEAD_TENSOR!r} is missing (and the embeddings are not tied)")
    checkpoint.close()
    with torch.device("meta"):
        head = Head(config)
    if weight is None:
        head.load_state_dict({"norm.weight": norm}, strict=False, assign=True)
        head.weight = embedding.weight  # shared, not copied
        return head.requires_grad_(False).to(device)
    head.load_state_dict({"norm.weight": norm, "weight": weight}, assign=True)
    head = head.requires_grad_(False).to(device)
    if decode_layout:  # CPU fp32 only (a tied matrix stays as the embedding lookup needs it)
        store_for_decode(head.weight)
    return head


# ---------------------------------------------------------------------------------------------------------------
# Hub ids
# ---------------------------------------------------------------------------------------------------------------
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+|[A-Za-z0-9][\w.-]*")


def resolve_checkpoint(model: str, *, blocks: tuple[int, int] | None = None, embeddings: bool | None = None,
                       cache_dir: str | Path | None = None) -> Path:
    """A checkpoint for `model`: a local folder as it is, a GGUF file (or the one in a folder), the default model's
    id (its installed GGUF), or a hub id downloaded into the HF cache.

    For a hub id only config.json, the tokenizer files and the shards holding blocks [start, end) are fetched
    (all shards when blocks is None); `embeddings` also fetches the embedding, final norm and LM head (default:
    only when blocks is None). Downloads show a progress bar on a terminal; a cut connection resumes, and a rerun
    fetches only the files not yet in the cache. Offline or failing downloads raise InputError saying what to do.
    """
    if is_default_model_id(model):
        return resolve_default_model()
    path = Path(model).expanduser()
    gguf_file = find_gguf(path)
    if gguf_file is not None:
        return gguf_file
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise InputError(f"{path}: not a checkpoint folder (no config.json, no .gguf file)")
        return path
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") > 1 or not _HUB_ID.fullmatch(model) \
            or path.suffix.lower() == GGUF_SUFFIX:
        raise InputError(f"{model}: no such checkpoint folder or GGUF file (and not a Hugging Face hub id like "
                         f"'org/name')")
    return _download(model, blocks, blocks is None if embeddings is None else embeddings, cache_dir)


def _download(repo_id: str, blocks: tuple[int, int] | None, embeddings: bool, cache_dir) -> Path:
    """Fetch what blocks [start, end) need from the hub into the HF cache; returns the snapshot folder.

    Each file is one `hf_hub_download` (a HEAD for its commit and ETag, then a GET unless the cache has it), so a
    rerun fetches only what is missing, and with the hub unreachable (or HF_HUB_OFFLINE=1) the cached files still
    resolve.
    """
    from huggingface_hub import _CACHED_NO_EXIST, hf_hub_download, try_to_load_from_cache
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError, RemoteEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    unreachable: list[str | None] = []  # the hub probed once per call, the first time a file is not cached

    def fetch(file_name: str, required: bool = True, missing: str | None = None) -> Path | None:
        cached = try_to_load_from_cache(repo_id, file_name, cache_dir=cache_dir)
        if not required and cached is _CACHED_NO_EXIST:
            # the hub said this commit has no such file: asking again costs a request, and with the network down
            # huggingface_hub retries it for about 20 s before giving up
            return None
        if cached is None:  # it must come from the hub: with the hub down, say so at once instead of after retries
            if not unreachable:
                unreachable.append(_hub_unreachable())
            if unreachable[0] is not None:
                if not required:
                    return None
                raise _hub_error(repo_id, f"{file_name} is not in the local cache and {unreachable[0]}")
        try:
            return Path(hf_hub_download(repo_id, file_name, cache_dir=cache_dir))
        except RemoteEntryNotFoundError:
            if required:
                raise _hub_error(repo_id, missing or f"the repository has no {file_name}", retry_hint=False) from None
            return None
        except LocalEntryNotFoundError as exc:  # offline, hub unreachable or failing, and the file not cached
            if not required:
                return None
            raise _hub_error(repo_id, f"{file_name} is not in the local cache and {_unreachable(exc)}") from None
        except GatedRepoError:
            raise _hub_error(repo_id, "the repository is gated: accept its conditions on its hub page, then log in "
                                      "with `hf auth login` or set HF_TOKEN", retry_hint=False) from None
        except RepositoryNotFoundError:
            raise _hub_error(repo_id, "no such repository, or it is private: check the id; for a private model log "
                                      "in with `hf auth login` or set HF_TOKEN", retry_hint=False) from None
        except RevisionNotFoundError:
            raise _hub_error(repo_id, "the repository has no 'main' revision", retry_hint=False) from None
        except Exception as exc:  # other HTTP errors (403...), a full disk, a download cut too many times
            raise _hub_error(repo_id, f"fetching {file_name} failed: {_first_line(exc)}") from None

    folder = fetch("config.json").parent
    config = ModelConfig.from_folder(folder)
    for side_file in SIDE_FILES:
        fetch(side_file, required=False)
    index = fetch(INDEX_FILE, required=False)
    if index is None:
        fetch(SINGLE_FILE, missing=f"the repository has neither {SINGLE_FILE} nor {INDEX_FILE}; only safetensors "
                                   f"weights are supported")
        return folder
    try:
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise InputError(f"{index}: not a valid safetensors index ({exc})") from None
    wanted = sorted(shards_for(config, weight_map, blocks, embeddings, source=f"{repo_id} {INDEX_FILE}"))
    log.info("%s: fetching %d of %d weight shards%s", repo_id, len(wanted), len(set(weight_map.values())),
             "" if blocks is None else f" (blocks [{blocks[0]}, {blocks[1]}))")
    for shard in wanted:  # huggingface_hub shows a progress bar per file on a terminal
        fetch(shard)
    return folder


def shards_for(config: ModelConfig, weight_map: dict[str, str], blocks: tuple[int, int] | None, embeddings: bool,
               source: str = INDEX_FILE) -> set[str]:
    """The shard files holding blocks [start, end) (and the embedding, final norm and LM head if `embeddings`);
    every shard when blocks is None."""
    if blocks is None:
        return set(weight_map.values())
    start, end = blocks
    if not 0 <= start <= end <= config.num_layers:
        raise InputError(f"{source}: block range [{start}, {end}) is outside the model's {config.num_layers} blocks")
    names = [n for layer in range(start, end) for n in block_tensor_names(config, layer)]
    if embeddings:
        names += [EMBEDDING_TENSOR, FINAL_NORM_TENSOR] + ([LM_HEAD_TENSOR] if LM_HEAD_TENSOR in weight_map else [])
    missing = [n for n in names if n not in weight_map]
    if missing:
        raise InputError(f"{source}: tensor {missing[0]!r} is not listed")
    return {weight_map[n] for n in names}


def _hub_error(repo_id: str, reason: str, retry_hint: bool = True) -> InputError:
    """One line: the model, why, and what to do. retry_hint: the cause is the network, not the repository."""
    message = (f"cannot get model {repo_id!r} from the Hugging Face hub ({reason}). For an offline test model run "
               f"`hivekeeper demo-model DIR` and pass DIR as the model")
    if retry_hint:
        message += f", or download {repo_id!r} with network access (HF_HUB_OFFLINE unset); files already " \
                   f"downloaded are kept in the cache"
    return InputError(message + ".")


def _hub_unreachable(timeout: float = 5.0) -> str | None:
    """None when the hub endpoint answers at all (any HTTP status); else why it cannot be reached. One request,
    no retries: huggingface_hub retries a refused or timed-out connection for ~25 s, printing a line per retry,
    which is right for a blip during a download but not for a machine that is offline. With HF_HUB_OFFLINE set
    nothing is asked (huggingface_hub refuses at once)."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    if constants.HF_HUB_OFFLINE:
        return None
    try:
        get_session().head(constants.ENDPOINT, timeout=timeout)
    except Exception as exc:  # refused, DNS, timeout, TLS
        return f"the hub at {constants.ENDPOINT} cannot be reached ({_first_line(exc)}); check the connection"
    return None


def _unreachable(exc: BaseException) -> str:
    """Why huggingface_hub could not ask the hub about a file, from the error behind its LocalEntryNotFoundError."""
    from huggingface_hub import constants
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    cause = exc
    while cause is not None:
        if isinstance(cause, OfflineModeIsEnabled):
            return "HF_HUB_OFFLINE is set"
        if isinstance(cause, HfHubHTTPError) and cause.response is not None:
            return f"the hub at {constants.ENDPOINT} answered HTTP {cause.response.status_code}; try again later"
        if cause.__cause__ is None and cause is not exc:  # the network error itself (refused, timeout, DNS)
            return f"the hub at {constants.ENDPOINT} cannot be reached ({_first_line(cause)}); check the connection"
        cause = cause.__cause__
    return f"the hub at {constants.ENDPOINT} cannot be reached; check the connection"


def _first_line(exc: BaseException) -> str:
    """`Type: first line of the message` (huggingface_hub's messages run over several lines)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
