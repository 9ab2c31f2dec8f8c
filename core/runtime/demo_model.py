"""Demo checkpoints: a Llama-family model in Hugging Face format with seeded RANDOM weights, for offline use.

A demo checkpoint is a real checkpoint folder (config.json, safetensors weights, generation_config.json,
tokenizer.json with a byte-level BPE tokenizer trained on a little built-in English, tokenizer_config.json with a
chat template) that any Llama loader reads, transformers included. Its weights are random, so what it writes is
gibberish; it exists so that tests and a first run work without downloading anything.

Weights are written tensor by tensor straight into safetensors files, so peak memory is one tensor whatever the
model size; everything goes into a temporary folder beside the destination, renamed into place at the end.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import tempfile
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterator

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from hivekeeper.planner.errors import InputError

from hivekeeper.core.runtime.demo_text import DEMO_TEXT

FAMILIES = ("llama", "mistral", "qwen2")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_SAFETENSORS_DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
_CONFIG_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}

# Special tokens, in id order: Llama's <unk>/<s>/</s> at 0/1/2, then the chat roles of the template below.
UNK, BOS, EOS = "<unk>", "<s>", "</s>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (UNK, BOS, EOS, *ROLE_TOKENS)
_BYTE_ALPHABET = 256
_CHUNK_ELEMENTS = 1 << 22  # weights are generated and written 4M values at a time

# Zephyr/TinyLlama-style turns: "<|role|>\n" + text + "</s>\n"; the reply starts after "<|assistant|>\n".
CHAT_TEMPLATE = (
    "{%- for message in messages %}\n"
    "    {%- if message['role'] not in ['system', 'user', 'assistant'] %}\n"
    "        {{- raise_exception('roles must be system, user or assistant, not ' + message['role']) }}\n"
    "    {%- endif %}\n"
    "    {%- if loop.first %}{{- bos_token }}{%- endif %}\n"
    "    {{- '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}\n"
)

PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(layers=2, hidden=64, intermediate=192, heads=4, kv_heads=2, vocab=512, max_position=2048),
    "100m": dict(layers=12, hidden=768, intermediate=2048, heads=12, kv_heads=4, vocab=32000, max_position=4096),
    "1b": dict(layers=16, hidden=2048, intermediate=8192, heads=32, kv_heads=8, vocab=32000, max_position=4096),
}


@dataclass(frozen=True)
class DemoSpec:
    """Shape and format of a demo checkpoint. Defaults give the tiny model (2 layers, hidden 64)."""

    layers: int = 2
    hidden: int = 64
    intermediate: int | None = None  # None: about 8/3 of hidden, rounded up to a multiple of 32 (Llama's ratio)
    heads: int = 4
    kv_heads: int | None = None  # None: half the heads when even (grouped-query attention), else all
    vocab: int = 512
    max_position: int = 2048
    seed: int = 0
    dtype: str = "fp32"
    family: str = "llama"
    tie_embeddings: bool = False
    shard_size_mb: float | None = None  # None: a single model.safetensors
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    def resolved(self) -> "DemoSpec":
        """The spec with its defaults filled in, checked; InputError names the first bad field."""
        fields = asdict(self)
        if self.intermediate is None:
            fields["intermediate"] = max(32, 32 * math.ceil(8 * self.hidden / 3 / 32)) if self.hidden > 0 else 0
        if self.kv_heads is None:
            fields["kv_heads"] = self.heads // 2 if self.heads % 2 == 0 else self.heads
        spec = DemoSpec(**fields)
        spec._check()
        return spec

    def _check(self) -> None:
        for name in ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab", "max_position"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InputError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
        if self.hidden % self.heads:
            raise InputError(f"--heads {self.heads} must divide --hidden {self.hidden}")
        if self.heads % self.kv_heads:
            raise InputError(f"--kv-heads {self.kv_heads} must divide --heads {self.heads}")
        if (self.hidden // self.heads) % 2:
            raise InputError(
                f"head size --hidden/--heads = {self.hidden // self.heads} must be even "
                "(rotary embeddings rotate pairs)"
            )
        smallest_vocab = _BYTE_ALPHABET + len(SPECIAL_TOKENS)
        if self.vocab < smallest_vocab:
            raise InputError(
                f"--vocab {self.vocab} is too small: the byte-level tokenizer needs {_BYTE_ALPHABET} byte tokens "
                f"and {len(SPECIAL_TOKENS)} special tokens, so at least {smallest_vocab}"
            )
        if self.seed < 0:
            raise InputError(f"--seed must be >= 0, got {self.seed}")
        if self.dtype not in DTYPES:
            raise InputError(f"--dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.family not in FAMILIES:
            raise InputError(f"--family {self.family!r} is not one of {', '.join(FAMILIES)}")
        if self.shard_size_mb is not None and not self.shard_size_mb > 0:
            raise InputError(f"--shard-size-mb must be > 0, got {self.shard_size_mb}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


@dataclass
class DemoCheckpoint:
    """What was written: the folder, the parameter count and the bytes of weights."""

    path: Path
    spec: DemoSpec
    num_params: int
    weight_bytes: int
    files: list[str] = field(default_factory=list)


# ---- weights ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _TensorPlan:
    name: str
    shape: tuple[int, ...]
    std: float | None  # None: all ones (a norm's weight)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def tensor_plan(spec: DemoSpec) -> list[_TensorPlan]:
    """Every weight of the checkpoint in file order, with the std of its random init.

    The init keeps activations sane however deep the model is: inputs of each linear layer are RMS-normalized, so
    std 1/sqrt(fan_in) keeps outputs near unit scale, and the two projections that write into the residual stream
    are scaled down by sqrt(2 * layers) so that the stream's variance stays bounded over all the layers.
    """
    h, i, hd = spec.hidden, spec.intermediate, spec.head_dim
    q_dim, kv_dim = spec.heads * hd, spec.kv_heads * hd
    residual_scale = 1.0 / math.sqrt(2 * spec.layers)
    # A tied embedding doubles as the LM head, so it gets the head's scale; the residual stream is normalized anyway.
    plan = [_TensorPlan("model.embed_tokens.weight", (spec.vocab, h), 1 / math.sqrt(h) if spec.tie_embeddings else 1.0)]
    for layer in range(spec.layers):
        p = f"model.layers.{layer}."
        plan += [
            _TensorPlan(p + "input_layernorm.weight", (h,), None),
            _TensorPlan(p + "self_attn.q_proj.weight", (q_dim, h), 1 / math.sqrt(h)),
            _TensorPlan(p + "self_attn.k_proj.weight", (kv_dim, h), 1 / math.sqrt(h)),
            _TensorPlan(p + "self_attn.v_proj.weight", (kv_dim, h), 1 / math.sqrt(h)),
        ]
        if spec.family == "qwen2":
            plan += [
                _TensorPlan(p + "self_attn.q_proj.bias", (q_dim,), 0.02),
                _TensorPlan(p + "self_attn.k_proj.bias", (kv_dim,), 0.02),
                _TensorPlan(p + "self_attn.v_proj.bias", (kv_dim,), 0.02),
            ]
        plan += [
            _TensorPlan(p + "self_attn.o_proj.weight", (h, q_dim), residual_scale / math.sqrt(q_dim)),
            _TensorPlan(p + "post_attention_layernorm.weight", (h,), None),
            _TensorPlan(p + "mlp.gate_proj.weight", (i, h), 1 / math.sqrt(h)),
            _TensorPlan(p + "mlp.up_proj.weight", (i, h), 1 / math.sqrt(h)),
            _TensorPlan(p + "mlp.down_proj.weight", (h, i), residual_scale / math.sqrt(i)),
        ]
    plan.append(_TensorPlan("model.norm.weight", (h,), None))
    if not spec.tie_embeddings:
        plan.append(_TensorPlan("lm_head.weight", (spec.vocab, h), 1 / math.sqrt(h)))
    return plan


def _shard_groups(
    plan: list[_TensorPlan], bytes_per_param: int, shard_size_mb: float | None
) -> list[list[_TensorPlan]]:
    """Split the tensors, in order, into files of at most shard_size_mb (a larger tensor gets a file of its own)."""
    if shard_size_mb is None:
        return [plan]
    limit = shard_size_mb * 1024 * 1024
    groups: list[list[_TensorPlan]] = [[]]
    size = 0
    for tensor in plan:
        nbytes = tensor.numel * bytes_per_param
        if groups[-1] and size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(tensor)
        size += nbytes
    return groups


def _write_safetensors(
    path: Path,
    tensors: list[_TensorPlan],
    dtype: torch.dtype,
    make: Callable[[_TensorPlan], Iterator[torch.Tensor]],
    on_bytes: Callable[[int], None],
) -> None:
    """Write a safetensors file one tensor at a time: the header first (all shapes are known), then the data."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for tensor in tensors:
        nbytes = tensor.numel * itemsize
        header[tensor.name] = {
            "dtype": _SAFETENSORS_DTYPE[dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    header_bytes += b" " * (-len(header_bytes) % 8)  # data starts 8-byte aligned, as safetensors itself writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)))
        f.write(header_bytes)
        for tensor in tensors:
            for chunk in make(tensor):
                data = chunk.to(dtype).contiguous()
                f.write(data.view(torch.uint8).numpy())  # a byte view: works for bf16 too, which numpy lacks
                on_bytes(data.numel() * itemsize)


def _weight_files(spec: DemoSpec, folder: Path, on_bytes: Callable[[int], None]) -> list[str]:
    """Write the weights (single file, or shards plus index) into folder; returns the file names."""
    dtype = DTYPES[spec.dtype]
    itemsize = torch.empty((), dtype=dtype).element_size()
    plan = tensor_plan(spec)
    generator = torch.Generator().manual_seed(spec.seed)

    def make(tensor: _TensorPlan) -> Iterator[torch.Tensor]:
        """The tensor's values in row chunks of about _CHUNK_ELEMENTS, so that a large one never sits in memory."""
        # drawn in file order from one generator: the same seed gives the same weights, sharded or not
        row = math.prod(tensor.shape[1:])
        rows_per_chunk = max(1, _CHUNK_ELEMENTS // max(row, 1))
        for start in range(0, tensor.shape[0], rows_per_chunk):
            shape = (min(rows_per_chunk, tensor.shape[0] - start), *tensor.shape[1:])
            if tensor.std is None:
                yield torch.ones(shape)
            else:
                yield torch.randn(shape, generator=generator).mul_(tensor.std)

    groups = _shard_groups(plan, itemsize, spec.shard_size_mb)
    if len(groups) == 1 and spec.shard_size_mb is None:
        _write_safetensors(folder / "model.safetensors", plan, dtype, make, on_bytes)
        return ["model.safetensors"]
    names = [f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors" for k in range(len(groups))]
    weight_map = {}
    for name, group in zip(names, groups):
        _write_safetensors(folder / name, group, dtype, make, on_bytes)
        weight_map.update({tensor.name: name for tensor in group})
    index = {"metadata": {"total_size": sum(t.numel for t in plan) * itemsize}, "weight_map": weight_map}
    _write_json(folder / "model.safetensors.index.json", index)
    return [*names, "model.safetensors.index.json"]


# ---- tokenizer ---------------------------------------------------------------------------------------------------
@lru_cache(maxsize=8)
def tokenizer_json(vocab_size: int) -> str:
    """tokenizer.json of a byte-level BPE tokenizer with exactly vocab_size ids, trained on the built-in text.

    The text supports a few thousand merges; a larger vocabulary is filled up with reserved special tokens (as
    Llama 3 reserves ids), which plain text never produces.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(DEMO_TEXT.split("\n\n"), trainer=trainer)
    filler = vocab_size - tokenizer.get_vocab_size(with_added_tokens=True)
    if filler > 0:
        tokenizer.add_special_tokens([f"<|reserved_{k}|>" for k in range(filler)])
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B:1", special_tokens=[(BOS, bos_id)]
    )
    return tokenizer.to_str(pretty=False)


def _tokenizer_config(spec: DemoSpec) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": UNK,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": spec.max_position,
        "chat_template": CHAT_TEMPLATE,
    }


# ---- config files ------------------------------------------------------------------------------------------------
def model_config(spec: DemoSpec) -> dict:
    """config.json as transformers writes it for the family, plus hivekeeper_demo: true."""
    architectures = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
    config = {
        "architectures": [architectures[spec.family]],
        "model_type": spec.family,
        "vocab_size": spec.vocab,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": spec.tie_embeddings,
        "torch_dtype": _CONFIG_DTYPE[spec.dtype],
        "bos_token_id": SPECIAL_TOKENS.index(BOS),
        "eos_token_id": SPECIAL_TOKENS.index(EOS),
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "use_cache": True,
    }
    if spec.family == "llama":
        config.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    elif spec.family == "mistral":
        config.update(sliding_window=None)
    else:
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=spec.layers)
    config.update(hivekeeper_demo=True, hivekeeper_seed=spec.seed)
    return config


def _generation_config() -> dict:
    return {"bos_token_id": SPECIAL_TOKENS.index(BOS), "eos_token_id": SPECIAL_TOKENS.index(EOS)}


def _readme(spec: DemoSpec, num_params: int) -> str:
    return f"""# Hivekeeper demo checkpoint — RANDOM WEIGHTS

This folder was written by `hivekeeper demo-model`. It is a {spec.family} model in Hugging Face format with
{num_params:,} parameters ({spec.layers} layers, hidden {spec.hidden}, {spec.heads} heads / {spec.kv_heads} KV heads,
vocabulary {spec.vocab}, {spec.dtype}), whose weights are **random** (seed {spec.seed}).

It has not been trained: whatever it generates is gibberish. It exists to exercise loading, offloading, serving and
chat offline, and to benchmark them. The tokenizer is a real byte-level BPE trained on a few pages of English, and
the chat template is Zephyr-style (`<|system|>`, `<|user|>`, `<|assistant|>`, each turn ending with `</s>`).

config.json carries `"hivekeeper_demo": true` so that tools can tell.
"""


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# ---- the whole folder ----------------------------------------------------------------------------------------------
def count_params(spec: DemoSpec) -> int:
    return sum(t.numel for t in tensor_plan(spec.resolved()))


def _is_replaceable(path: Path) -> bool:
    """An empty folder, or an earlier demo checkpoint (never any other data)."""
    if not any(path.iterdir()):
        return True
    config = path / "config.json"
    try:
        return json.loads(config.read_text(encoding="utf-8")).get("hivekeeper_demo") is True
    except (OSError, ValueError, AttributeError):
        return False


def write_demo_checkpoint(
    path: str | Path,
    spec: DemoSpec | None = None,
    *,
    overwrite: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> DemoCheckpoint:
    """Write a demo checkpoint to `path` (a new folder, an empty one, or with overwrite=True an earlier demo).

    progress(done_bytes, total_bytes) is called as weights are written. On any failure nothing is left behind.
    """
    spec = (spec or DemoSpec()).resolved()
    dest = Path(path).absolute()
    if dest.exists() and not dest.is_dir():
        raise InputError(f"{dest}: exists and is not a folder")
    if dest.is_dir() and any(dest.iterdir()):
        if not overwrite:
            raise InputError(f"{dest}: folder exists and is not empty; choose a new folder or pass --force")
        if not _is_replaceable(dest):
            raise InputError(
                f"{dest}: not a demo checkpoint (no \"hivekeeper_demo\" in config.json); refusing to replace it"
            )

    plan = tensor_plan(spec)
    num_params = sum(t.numel for t in plan)
    weight_bytes = num_params * torch.empty((), dtype=DTYPES[spec.dtype]).element_size()
    dest.parent.mkdir(parents=True, exist_ok=True)
    if not os.access(dest.parent, os.W_OK):
        raise InputError(f"{dest.parent}: cannot write there (no permission, or a read-only file system)")
    usage = shutil.disk_usage(dest.parent)
    if usage.total == 0:  # /proc, /sys: "0.00 GB free" said nothing about why
        raise InputError(f"{dest.parent}: not a folder on a disk (a virtual file system); choose another folder")
    free = usage.free
    if weight_bytes + (64 << 20) > free:
        raise InputError(
            f"{dest.parent}: not enough free disk space for {weight_bytes / 1e9:.2f} GB of weights "
            f"({free / 1e9:.2f} GB free)"
        )

    temp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".partial", dir=dest.parent))
    try:
        done = 0

        def on_bytes(n: int) -> None:
            nonlocal done
            done += n
            if progress is not None:
                progress(done, weight_bytes)

        files = _weight_files(spec, temp, on_bytes)
        (temp / "tokenizer.json").write_text(tokenizer_json(spec.vocab), encoding="utf-8")
        _write_json(temp / "tokenizer_config.json", _tokenizer_config(spec))
        _write_json(temp / "special_tokens_map.json", {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK})
        _write_json(temp / "config.json", model_config(spec))
        _write_json(temp / "generation_config.json", _generation_config())
        (temp / "README.md").write_text(_readme(spec, num_params), encoding="utf-8")
        files += ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json",
                  "generation_config.json", "README.md"]
        os.chmod(temp, 0o755)  # mkdtemp makes it owner-only
        _move_into_place(temp, dest)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return DemoCheckpoint(path=dest, spec=spec, num_params=num_params, weight_bytes=weight_bytes, files=files)


def _move_into_place(temp: Path, dest: Path) -> None:
    """Rename the finished folder to dest; an earlier demo checkpoint there is swapped out first, then deleted."""
    if dest.is_dir() and any(dest.iterdir()):
        old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".old", dir=dest.parent))
        os.replace(dest, old / "checkpoint")
        try:
            os.replace(temp, dest)
        except BaseException:
            os.replace(old / "checkpoint", dest)
            raise
        finally:
            shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(temp, dest)  # replaces an empty folder atomically


def make_demo_checkpoint(path: str | Path, overwrite: bool = False, **sizes) -> Path:
    """Write a demo checkpoint with DemoSpec fields given as keywords (tiny by default); returns its folder.

    For tests: make_demo_checkpoint(tmp_path / "m", layers=3, vocab=300) takes well under a second.
    """
    return write_demo_checkpoint(path, DemoSpec(**sizes), overwrite=overwrite).path
