"""The model behind the OpenAI-compatible API: the request checks that need the model (its id, the prompt's tokens,
the room left in its context), the engine that generates (core/runtime/continuous: concurrent requests decoded
together when the blocks are in memory, one after another otherwise), and the OpenAI response objects.

Kept apart from the HTTP layer (server.py) so the rules are plain functions of a request.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from hivekeeper.planner.errors import InputError

from hivekeeper.core.api.schema import APIError, GenerationRequest
from hivekeeper.core.runtime.continuous import Completion, ContinuousBatcher, Request, SerialEngine

FINISH_REASONS = {"eos": "stop", "stop_string": "stop", "length": "length", "stopped": "stop"}
OWNER = "hivekeeper"


@dataclass
class ModelService:
    """The model the API serves: the runner (core/cli/generate.Runner), its tokenizer and config, the engine that
    generates, the id clients name it by (with other accepted names), and whether it runs through a swarm."""

    runner: object
    tokenizer: object
    config: object
    engine: object  # ContinuousBatcher or SerialEngine
    model_id: str
    aliases: tuple[str, ...] = ()
    swarm: bool = False
    api_key: str | None = None

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_id and name not in self.aliases:
            raise APIError(404, f"'model': this server serves {self.model_id!r}, not {name!r}", param="model",
                           code="model_not_found")

    def check_key(self, authorization: str) -> None:
        if self.api_key and authorization != f"Bearer {self.api_key}":
            raise APIError(401, "a valid API key is required: send 'Authorization: Bearer KEY'",
                           code="invalid_api_key", error_type="authentication_error")

    def prompt_ids(self, request: GenerationRequest) -> list[int]:
        """The request's prompt as token ids: messages through the model's chat template, or the raw prompt."""
        try:
            if request.is_chat:
                return list(self.tokenizer.apply_chat_template(request.messages, add_generation_prompt=True))
            return list(self.tokenizer.encode(request.prompt))
        except InputError as exc:
            param = "messages" if request.is_chat else "prompt"
            raise APIError(400, f"'{param}': {exc}", param=param) from None

    def max_new_tokens(self, request: GenerationRequest, prompt_tokens: int) -> int:
        """What the reply may hold: max_tokens, or the rest of the context; a prompt that leaves no room is a 400."""
        from hivekeeper.core.runtime.generation import context_limit

        context = context_limit(self.config)
        room = context - prompt_tokens
        param = "messages" if request.is_chat else "prompt"
        if room < 1:
            raise APIError(400, f"'{param}': the prompt has {prompt_tokens} tokens; the model's context is "
                                f"{context} tokens, which leaves no room for a reply: shorten it",
                           param=param, code="context_length_exceeded")
        if request.max_tokens is not None and request.max_tokens > room:
            raise APIError(400, f"'max_tokens': {request.max_tokens} new tokens after a prompt of {prompt_tokens} "
                                f"tokens exceed the model's context of {context} tokens (at most {room})",
                           param="max_tokens", code="context_length_exceeded")
        return request.max_tokens or room

    def engine_request(self, request: GenerationRequest, on_text, on_done) -> Request:
        """A checked API request as the engine's Request (every refusal raised here, before anything is sent)."""
        from hivekeeper.core.runtime.sampling import SamplingParams

        self.check_model(request.model)
        ids = self.prompt_ids(request)
        sampling = SamplingParams(temperature=request.temperature, top_p=request.top_p, seed=request.seed)
        return Request(ids, self.max_new_tokens(request, len(ids)), sampling, tuple(request.stop),
                       on_text=on_text, on_done=on_done)

    def failure(self, exc: BaseException) -> APIError:
        """What a failed generation answers: 400 for bad input, else 500 (503 through a swarm: its servers)."""
        if isinstance(exc, APIError):
            return exc
        if isinstance(exc, InputError):
            return APIError(400, str(exc))
        status, kind = (503, "service_unavailable") if self.swarm else (500, "server_error")
        return APIError(status, f"{type(exc).__name__}: {exc}", error_type=kind)

    def model_card(self) -> dict:
        return {"id": self.model_id, "object": "model", "created": int(time.time()), "owned_by": OWNER}

    def warm_up(self) -> None:
        """One token generated before the server answers: what runs once per process (the native kernels' build
        on first use, the first allocations) is not paid by the first client."""
        from hivekeeper.core.runtime.generation import generate

        generate(self.runner.model, self.tokenizer.encode("Hello") or [0], max_new_tokens=1)

    def close(self) -> None:
        self.engine.close()
        self.runner.close()


def engine_for(model, tokenizer, max_rows: int):
    """The engine for an opened model: continuous batching when every block is held in memory (an OffloadedModel
    whose plan keeps them all resident, with a K/V cache; with trained prompts, their K/V start each row), else one
    request after another (blocks streamed from disk, K/V recomputed, or a swarm client)."""
    from hivekeeper.core.runtime.model import Span

    prompted = getattr(model, "offloaded", None)  # a runner with trained prompts (core/finetune/prompted.py)
    inner = prompted or model
    resident, plan = getattr(inner, "resident", None), getattr(inner, "plan", None)
    layers = inner.config.num_layers
    if resident is not None and plan is not None and len(resident) == layers and not plan.kv_recompute \
            and max_rows > 1:
        span = Span(inner.config, 0, layers, [resident[i] for i in range(layers)])
        prefix = model.row_prefix(span) if prompted is not None else None  # the prompts' K/V first in each row
        return ContinuousBatcher(inner.embedding, span, inner.head, tokenizer, max_rows=max_rows, prefix=prefix)
    return SerialEngine(model, tokenizer)


def usage(done: Completion) -> dict:
    completion = len(done.token_ids)
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": completion,
            "total_tokens": done.prompt_tokens + completion}


class Reply:
    """The OpenAI objects of one response: ids, the chat or completion shapes, whole or as stream chunks."""

    def __init__(self, service: ModelService, request: GenerationRequest):
        self.service, self.request = service, request
        self.id = ("chatcmpl-" if request.is_chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.object = "chat.completion" if request.is_chat else "text_completion"

    def envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.service.model_id,
                "system_fingerprint": OWNER, "choices": choices}

    def whole(self, done: Completion) -> dict:
        reason = FINISH_REASONS.get(done.finish_reason, "stop")
        if self.request.is_chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": done.text}, "finish_reason": reason,
                      "logprobs": None}
        else:
            choice = {"index": 0, "text": done.text, "finish_reason": reason, "logprobs": None}
        return {**self.envelope(self.object, [choice]), "usage": usage(done)}

    def chunk(self, text: str | None = None, reason: str | None = None, first: bool = False) -> dict:
        """One stream chunk: the reply's next text (the chat's first one also carries the role), or the end."""
        if self.request.is_chat:
            delta = {"role": "assistant", "content": ""} if first else ({} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
            return self.envelope("chat.completion.chunk", [choice])
        return self.envelope("text_completion", [{"index": 0, "text": text or "", "finish_reason": reason,
                                                  "logprobs": None}])

    def end_chunk(self, done: Completion) -> dict:
        return self.chunk(reason=FINISH_REASONS.get(done.finish_reason, "stop"))

    def usage_chunk(self, done: Completion) -> dict:
        chunk_object = "chat.completion.chunk" if self.request.is_chat else "text_completion"
        return {**self.envelope(chunk_object, []), "usage": usage(done)}
