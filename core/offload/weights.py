"""Reading a block's weights from a checkpoint's safetensors files into Block modules, for the offload engine.

`BlockReader.fill` reads each HF tensor of a layer with positioned reads (runtime/safetensors_file.py) straight into
its place in a Block built once (`empty_block`), q/k/v and gate/up rows into their fused matrices
(`block_destinations`), so a streamed block's buffer is reused from layer to layer; a tensor of another dtype than
the file's goes through one scratch buffer kept for the reader's life. It counts the bytes and, per layer, the reads
it made (`bytes_read`, `reads`): with micro-batches a streamed block must be read once per step. Thread-safe: the
streamer's reader thread fills slots while blocks compute. `drop_page_cache=True` also evicts what was read from the
OS page cache, for benchmarks of the disk itself.
"""

from __future__ import annotations

import threading
from collections import Counter

import torch
from torch import Tensor

from hivekeeper.planner.errors import InputError

from hivekeeper.core.runtime.checkpoint import Checkpoint, block_tensor_names
from hivekeeper.core.runtime.model import Block, ModelConfig, RotaryTable
from hivekeeper.core.runtime.safetensors_file import SafetensorsFile


def block_destinations(block: Block, config: ModelConfig) -> dict[str, Tensor]:
    """HF tensor name (within a layer) -> the tensor (or the rows of a fused one) of `block` it fills."""
    q, kv, inter = config.q_dim, config.kv_dim, config.intermediate_size
    attn, mlp = block.self_attn, block.mlp
    qkv, gate_up = attn.qkv_proj.weight, mlp.gate_up_proj.weight
    dest = {
        "input_layernorm.weight": block.input_layernorm.weight,
        "post_attention_layernorm.weight": block.post_attention_layernorm.weight,
        "self_attn.q_proj.weight": qkv[:q], "self_attn.k_proj.weight": qkv[q : q + kv],
        "self_attn.v_proj.weight": qkv[q + kv :], "self_attn.o_proj.weight": attn.o_proj.weight,
        "mlp.gate_proj.weight": gate_up[:inter], "mlp.up_proj.weight": gate_up[inter:],
        "mlp.down_proj.weight": mlp.down_proj.weight,
    }
    if config.qkv_bias:
        bias = attn.qkv_proj.bias
        dest.update({"self_attn.q_proj.bias": bias[:q], "self_attn.k_proj.bias": bias[q : q + kv],
                     "self_attn.v_proj.bias": bias[q + kv :]})
    if config.o_bias:
        dest["self_attn.o_proj.bias"] = attn.o_proj.bias
    if config.mlp_bias:
        bias = mlp.gate_up_proj.bias
        dest.update({"mlp.gate_proj.bias": bias[:inter], "mlp.up_proj.bias": bias[inter:],
                     "mlp.down_proj.bias": mlp.down_proj.bias})
    return dest


class BlockReader:
    """Fills Block modules with a layer's weights from the checkpoint's files (thread-safe: positioned reads)."""

    def __init__(self, checkpoint: Checkpoint, drop_page_cache: bool = False):
        self.checkpoint, self.config = checkpoint, checkpoint.config
        self.drop_page_cache = drop_page_cache
        self._files: dict[str, SafetensorsFile] = {}
        self._lock = threading.Lock()
        self.bytes_read = 0
        self.reads: Counter[int] = Counter()  # layer -> times its weights were read (fills), for the zig-zag check
        self._scratch = torch.empty(0, dtype=torch.uint8)  # a tensor of the file's dtype, read before converting
        self._scratch_lock = threading.Lock()

    def _file(self, file_name: str) -> SafetensorsFile:
        with self._lock:
            handle = self._files.get(file_name)
            if handle is None:
                path = self.checkpoint.path / file_name
                if not path.is_file():
                    raise InputError(f"{path}: missing shard (listed in the checkpoint's index)")
                handle = self._files[file_name] = SafetensorsFile(path)
            return handle

    def check_layer(self, layer: int) -> None:
        """Fail early (before any weight is read) on a tensor missing from the index or its file."""
        for name in block_tensor_names(self.config, layer):
            (file_name,) = self.checkpoint.files_for([name])
            if name not in self._file(file_name).entries:
                raise InputError(f"{self.checkpoint.path / file_name}: tensor {name!r} is missing")

    def fill(self, block: Block, layer: int) -> int:
        """Read layer `layer` into `block` (whose shapes match any layer); returns the bytes read."""
        prefix = f"model.layers.{layer}."
        total = 0
        read: dict[SafetensorsFile, list[str]] = {}
        for suffix, dest in block_destinations(block, self.config).items():
            name = prefix + suffix
            (file_name,) = self.checkpoint.files_for([name])
            handle = self._file(file_name)
            total += self._read(handle, name, dest)
            read.setdefault(handle, []).append(name)
        if self.drop_page_cache:
            for handle, names in read.items():
                handle.drop_from_page_cache(names)
        block.layer_index = layer
        block.self_attn.window = self.config.window_of(layer)
        with self._lock:
            self.bytes_read += total
            self.reads[layer] += 1
        return total

    def _read(self, handle: SafetensorsFile, name: str, dest: Tensor) -> int:
        """Read tensor `name` into `dest`; when its dtype differs from the file's (a 16-bit plan over an fp32 file),
        through one scratch buffer kept for the reader's life rather than a temporary per tensor: freed temporaries
        of every size stayed in the C library's heaps and put a bf16 run over its RAM budget
        (placement.sixteen_bit_cpu_transients counts the scratch)."""
        file_dtype = handle.entries.get(name, (None,))[0]
        if file_dtype is None or file_dtype == dest.dtype or dest.device.type != "cpu":
            return handle.read_into(name, dest)
        with self._scratch_lock:
            nbytes = dest.numel() * file_dtype.itemsize
            if self._scratch.numel() < nbytes:
                self._scratch = torch.empty(nbytes, dtype=torch.uint8)
            staged = self._scratch[:nbytes].view(file_dtype).view(dest.shape)
            count = handle.read_into(name, staged)
            dest.copy_(staged)
        return count

    def close(self) -> None:
        self._scratch = torch.empty(0, dtype=torch.uint8)
        with self._lock:
            for handle in self._files.values():
                handle.close()
            self._files.clear()


def empty_block(config: ModelConfig, rotary: RotaryTable, dtype: torch.dtype, device: str | torch.device,
                pin: bool = False) -> Block:
    """A Block with uninitialised weights of `dtype` on `device` (pinned host memory when pin=True)."""
    with torch.device("meta"):
        block = Block(config, 0, rotary)
    # not Module.to_empty: it touches (and for a moment doubles) the memory it allocates
    for module in block.modules():
        for name, param in module.named_parameters(recurse=False):
            fresh = torch.empty(param.shape, dtype=dtype, device=device, pin_memory=pin)
            module._parameters[name] = torch.nn.Parameter(fresh, requires_grad=False)
    block.rotary = rotary
    return block
