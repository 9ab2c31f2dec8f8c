"""What the chat worker talks to: the model run locally (offloaded as the planner says) or through a swarm.

Imported on the chat worker thread only (it brings torch, and for the swarm hivemind), never at app start. Both
backends hand core.generation.generate a runner with `config`, `embedding`, `span` and `head`, and keep the
conversation's KV cache between replies (core.generation.PromptCache): a reply prefills only the new turn.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

from hivekeeper.core.runtime.chat_history import ChatHistory
from hivekeeper.planner.errors import InputError
from hivekeeper.planner.hardware import HardwareSpec

CONTEXT_LIMIT = 4096  # the KV cache a local chat allocates, at most (the model's context when shorter)


@dataclass(frozen=True)
class BackendKey:
    """Which model, where: a new key means a new backend (the old one is closed)."""

    mode: str  # "local" or "swarm"
    model: str  # checkpoint folder or hub id
    initial_peers: tuple[str, ...] = ()
    quant: str = "none"  # local only: the plan's weight format choice (int8/nf4 need bitsandbytes)
    prompts: str = ""  # a prompts file from `hivekeeper finetune` (core/finetune/prompted.py), or none


@dataclass(frozen=True)
class Request:
    history: ChatHistory  # a copy of the conversation, ending with the user's new message
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    # which conversation: another one empties the kept KV cache (reuse stays exact without it: only the common
    # prefix of the cached and the new prompt is reused)
    conversation_id: str = ""


class ChatBackend:
    """A loaded model and its tokenizer, ready to stream replies."""

    def __init__(self, key: BackendKey, hardware: HardwareSpec | None, describe: Callable[[str], None],
                 efficiency=None):
        import torch  # noqa: F401  (worker thread: the first chat pays for the import, not the app start)

        from hivekeeper.core.runtime.checkpoint import resolve_checkpoint
        from hivekeeper.core.runtime.generation import conversation_cache
        from hivekeeper.core.runtime.kernels.native_kernels import load_saying
        from hivekeeper.core.runtime.tokenizer import load_tokenizer

        self.key = key
        self.runner = None
        self.prompt_cache = None
        self.conversation_id = ""
        self.skipped_messages = 0
        load_saying(describe)  # compiled on the Chat page's first showing (ChatService.prepare_kernels), else now
        describe("finding the checkpoint…")
        if key.mode == "swarm":
            if not key.initial_peers:
                raise InputError("chat through the swarm needs initial peers (join or start a swarm on the Swarm "
                                 "page, or give its addresses there)")
            from hivekeeper.core.swarm.client.inference import SwarmModel

            describe("connecting to the swarm…")
            self.runner = SwarmModel(key.model, initial_peers=list(key.initial_peers))
            self.path = self.runner.path
            self.placement = f"blocks in the swarm; embeddings and head here ({len(key.initial_peers)} initial peers)"
            self.context = self.runner.config.max_position_embeddings
        else:
            self.path = resolve_checkpoint(key.model)
            self.runner, self.placement, self.context = _local_runner(self.path, key, hardware, describe, efficiency)
        if key.prompts:
            describe("loading the model with its trained prompts…")
            self._use_prompts(key)
        self.tokenizer = load_tokenizer(self.path)
        # prompt and reply fit in `context`: for a local model, the KV cache length its plan counts
        self.prompt_cache = conversation_cache(self.context, swarm=key.mode == "swarm")

    def _use_prompts(self, key: BackendKey) -> None:
        """The runner with trained prompts first in every conversation (the local one placed by its plan, the
        prompts' positions taken from the context it counts)."""
        from hivekeeper.core.finetune.prompted import local_prompted_model, swarm_prompted_model

        if key.mode == "swarm":
            self.runner, self.placement = swarm_prompted_model(self.runner, key.prompts)
            self.context = self.runner.config.max_position_embeddings
        else:
            self.runner, self.placement = local_prompted_model(self.runner, key.prompts, self.placement)
            self.context = min(self.runner.config.max_position_embeddings,
                               self.context - self.runner.span.prompts.tokens)

    def reply(self, request: Request, on_text: Callable[[str], None], stop: threading.Event):
        """Stream one reply; returns core.generation's GenerationResult."""
        from hivekeeper.core.runtime.generation import generate
        from hivekeeper.core.runtime.sampling import SamplingParams

        if request.conversation_id != self.conversation_id:
            self.prompt_cache.reset()
            self.conversation_id = request.conversation_id
        context = self.context
        room = max(1, context - min(request.max_new_tokens, context // 2))
        # the oldest turns are left out when the conversation outgrows the context
        prompt, self.skipped_messages = request.history.prompt_ids(self.tokenizer, max_tokens=room)
        sampling = SamplingParams(temperature=request.temperature, top_p=request.top_p, top_k=request.top_k)
        # the reply ends at the context's end (as it would at the model's)
        max_new_tokens = max(1, min(request.max_new_tokens, context - len(prompt)))
        return generate(self.runner, prompt, max_new_tokens=max_new_tokens, sampling=sampling,
                        tokenizer=self.tokenizer, on_text=lambda row, text: on_text(text), stop=stop,
                        prompt_cache=self.prompt_cache)

    def close(self) -> None:
        if self.prompt_cache is not None:
            self.prompt_cache.close()
            self.prompt_cache = None
        if self.runner is not None:
            self.runner.close()
            self.runner = None


def _local_runner(path, key: BackendKey, hardware: HardwareSpec | None, describe: Callable[[str], None],
                  efficiency=None):
    """An OffloadedModel placed as `hivekeeper chat` places it (local_plan.plan_local_run: the planner's chat policy
    for this machine, the dtype this CPU or GPU computes it in), its description, and the KV cache length its plan
    counts. `hardware`: the machine the window shows (None: detected now)."""
    from hivekeeper.core.offload.local_plan import DoesNotFit, plan_local_run, use_runtime_threads
    from hivekeeper.core.offload.offloaded_model import OffloadedModel
    from hivekeeper.core.runtime.checkpoint import load_config

    use_runtime_threads()  # as `hivekeeper chat` does (this process runs no other torch work)
    config = load_config(path)
    context = min(config.max_position_embeddings, CONTEXT_LIMIT)
    describe("planning the placement…")
    turn = min(512, context // 2)  # the prompt and reply lengths the plan is chosen for
    try:
        _, plan = plan_local_run("auto", path, config, batch=1, prompt_len=turn, max_new_tokens=turn,
                                 max_length=context, quant=key.quant if key.quant in ("int8", "nf4") else "none",
                                 hardware=hardware, efficiency=efficiency, fallback=False)
    except DoesNotFit as exc:
        raise InputError(f"{exc} Chat through the swarm instead (Chat → through the swarm).") from None
    describe(f"loading the model ({plan.describe()})…")
    return OffloadedModel(path, plan), plan.describe(), context
