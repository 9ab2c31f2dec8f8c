"""Trainable prompts and their file.

"ptune": `tokens` soft prompt vectors put before the input's embeddings. "deep_ptune": those, plus one prompt per
block added to the first `tokens` positions of that block's input (Petals' deep prompts: what rpc_forward and
rpc_backward take as their `prompts` argument, [blocks, batch, tokens, hidden]).

The file is safetensors: `prompts.input` [tokens, hidden], `prompts.deep` [blocks, tokens, hidden] (deep_ptune),
and Adam's moments (`adam.<name>.exp_avg`, `adam.<name>.exp_avg_sq`) so that a run resumes where it stopped. Its
metadata says what it is: format, model, method, tokens, hidden size, blocks, steps trained and learning rate.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from hivekeeper.planner.errors import InputError

METHODS = ("ptune", "deep_ptune")
FILE_FORMAT = "hivekeeper-prompts/1"
MAX_PROMPT_TOKENS = 256


@dataclass(frozen=True)
class PromptsInfo:
    model: str
    method: str
    tokens: int
    hidden_size: int
    num_layers: int
    step: int = 0  # optimizer steps trained
    lr: float = 0.0


class TrainablePrompts(nn.Module):
    """The trained parameters: `input` [tokens, hidden] and, for deep_ptune, `deep` [blocks, tokens, hidden]."""

    def __init__(self, method: str, tokens: int, hidden_size: int, num_layers: int):
        super().__init__()
        check_method(method)
        if not 1 <= tokens <= MAX_PROMPT_TOKENS:
            raise InputError(f"--prompt-tokens must be between 1 and {MAX_PROMPT_TOKENS}, got {tokens}")
        self.method = method
        self.input = nn.Parameter(torch.zeros(tokens, hidden_size))
        # Petals starts deep prompts at zero: training begins from the frozen model's own behaviour
        self.deep = nn.Parameter(torch.zeros(num_layers, tokens, hidden_size)) if method == "deep_ptune" else None

    @property
    def tokens(self) -> int:
        return self.input.shape[0]

    def start_from_vocabulary(self, embedding_weight: Tensor, seed: int = 0) -> None:
        """Soft prompts start as the embeddings of random vocabulary tokens (trains faster than noise)."""
        generator = torch.Generator().manual_seed(seed)
        rows = torch.randint(0, embedding_weight.shape[0], (self.tokens,), generator=generator)
        with torch.no_grad():
            self.input.copy_(embedding_weight[rows].float())

    def for_batch(self, batch: int, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor | None]:
        """(input prompts [batch, tokens, hidden], deep prompts [blocks, batch, tokens, hidden] or None)."""
        first = self.input.to(dtype)[None].expand(batch, -1, -1)
        deep = None if self.deep is None else self.deep.to(dtype)[:, None].expand(-1, batch, -1, -1)
        return first, deep


def check_prompt_tokens(tokens: int, context: int, what: str) -> None:
    """Prompt tokens take the first positions of the model's context, ptune and deep_ptune alike: they must leave
    room for an example (and be at most MAX_PROMPT_TOKENS). `what` names them: "--prompt-tokens 9000"."""
    most = min(MAX_PROMPT_TOKENS, context - 1)
    if tokens >= context:
        cap = f" (and at most {most})" if most < context - 1 else ""
        raise InputError(f"{what}: must be below the model's context of {context} tokens{cap}")
    if not 1 <= tokens <= most:
        raise InputError(f"{what}: must be between 1 and {most}")


def check_method(method: str) -> None:
    if method not in METHODS:
        raise InputError(f"--method must be one of {', '.join(METHODS)}, got {method!r}")


def save_prompts(path: str | Path, prompts: TrainablePrompts, info: PromptsInfo,
                 optimizer: torch.optim.Optimizer | None = None) -> None:
    """Write the prompts (and the optimizer's moments) atomically: a crash leaves the previous file."""
    from safetensors.torch import save

    from hivekeeper.core.atomic_file import write_bytes_atomic

    tensors = {f"prompts.{name}": p.detach().float().contiguous() for name, p in prompts.named_parameters()}
    if optimizer is not None:
        for name, param in prompts.named_parameters():
            state = optimizer.state.get(param, {})
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    tensors[f"adam.{name}.{key}"] = state[key].detach().float().contiguous()
    metadata = {"format": FILE_FORMAT, "model": info.model, "method": info.method, "prompt_tokens": str(info.tokens),
                "hidden_size": str(info.hidden_size), "num_layers": str(info.num_layers), "step": str(info.step),
                "lr": repr(info.lr)}
    write_bytes_atomic(path, save(tensors, metadata=metadata), mode=0o644)


def load_prompts(path: str | Path) -> tuple[TrainablePrompts, PromptsInfo, dict[str, Tensor]]:
    """(prompts, what they are, Adam's moments by name) from a file save_prompts wrote; InputError names the file
    and what is wrong with it."""
    from hivekeeper.core.runtime.safetensors_file import SafetensorsFile

    path = Path(path)
    if path.is_dir():
        raise InputError(f"{path}: a folder, not a prompts file")
    if not path.is_file():
        raise InputError(f"{path}: no such prompts file")
    try:
        reader = SafetensorsFile(path)
    except InputError as exc:  # most often a text file of prompts given to --prompts instead of --prompts-file
        raise InputError(f"{exc}: not a prompts file from `hivekeeper finetune --out` (for a text file of prompts, one "
                         "a line, use --prompts-file)") from None
    try:
        info = _info(path, reader.metadata)
        prompts = TrainablePrompts(info.method, info.tokens, info.hidden_size, info.num_layers)
        with torch.no_grad():
            for name, param in prompts.named_parameters():
                reader.read_into(f"prompts.{name}", param.data)
        moments = {}
        for name in reader.entries:
            if name.startswith("adam."):
                moments[name] = torch.empty(reader.entries[name][1])
                reader.read_into(name, moments[name])
    finally:
        reader.close()
    return prompts, info, moments


def _info(path: Path, metadata: dict) -> PromptsInfo:
    if metadata.get("format") != FILE_FORMAT:
        raise InputError(f"{path}: not a prompts file of `hivekeeper finetune` (metadata format "
                         f"{metadata.get('format')!r}, expected {FILE_FORMAT!r})")
    try:
        info = PromptsInfo(model=str(metadata["model"]), method=str(metadata["method"]),
                           tokens=int(metadata["prompt_tokens"]), hidden_size=int(metadata["hidden_size"]),
                           num_layers=int(metadata["num_layers"]), step=int(metadata.get("step", 0)),
                           lr=float(metadata.get("lr", 0.0)))
    except (KeyError, ValueError) as exc:
        raise InputError(f"{path}: prompts metadata field {exc} is missing or not a number") from None
    check_method(info.method)
    return info


def check_fits(path: str | Path, info: PromptsInfo, config) -> None:
    """Prompts trained for another shape of model cannot run on this one."""
    if (info.hidden_size, info.num_layers) != (config.hidden_size, config.num_layers):
        raise InputError(f"{path}: the prompts were trained for {info.model} (hidden size {info.hidden_size}, "
                         f"{info.num_layers} blocks); this model has hidden size {config.hidden_size} and "
                         f"{config.num_layers} blocks")
