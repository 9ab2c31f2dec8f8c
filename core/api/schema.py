"""The requests the OpenAI-compatible API accepts, checked field by field before any token is computed.

A request that breaks a rule gets an APIError: the HTTP status and an OpenAI-shaped JSON body whose message names
the field (`{"error": {"message", "type", "param", "code"}}`), so a client sees what to fix and the server goes on.
Fields OpenAI defines that we do not act on (logprobs, presence_penalty at 0, user, ...) are accepted and ignored;
those that would change the answer in a way we cannot honour (n > 1, tools) are refused.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

ROLES = ("system", "user", "assistant")
MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_BODY_BYTES = 16 * 1024 * 1024  # a request body larger than this is refused (413) before it is read


class APIError(Exception):
    """A request the API refuses: HTTP status, message (naming the field), OpenAI error type, param and code."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 error_type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.error_type = status, message, param, code, error_type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}


def bad(param: str, message: str, code: str | None = None) -> APIError:
    """A 400 for one field: the message starts with the field's name."""
    return APIError(400, f"'{param}': {message}", param=param, code=code)


@dataclass
class GenerationRequest:
    """One checked request. Exactly one of `messages` (chat) and `prompt` (completion) is set."""

    model: str | None
    messages: list[dict] | None = None
    prompt: str | None = None
    max_tokens: int | None = None  # None: up to the end of the context
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the token counts

    @property
    def is_chat(self) -> bool:
        return self.messages is not None


def parse_json(raw: bytes) -> dict:
    """The body as a JSON object, or a 400 saying it is not one."""
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON ({exc})", code="invalid_json") from None
    except RecursionError:  # e.g. 100000 nested arrays: Python's parser gives up, the body is no request
        raise APIError(400, "the request body nests JSON deeper than the parser takes", code="invalid_json") from None
    if not isinstance(doc, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    return doc


def chat_request(doc: dict) -> GenerationRequest:
    request = common_fields(doc)
    request.messages = checked_messages(doc.get("messages"))
    if doc.get("tools") or doc.get("functions"):
        raise bad("tools", "tools and function calling are not supported by this server")
    return request


def completion_request(doc: dict) -> GenerationRequest:
    request = common_fields(doc)
    request.prompt = checked_prompt(doc.get("prompt"))
    if doc.get("echo"):
        raise bad("echo", "echo is not supported by this server")
    return request


def common_fields(doc: dict) -> GenerationRequest:
    """The sampling, length, stop and stream fields shared by both endpoints."""
    model = doc.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", "must be a string")
    n = doc.get("n", 1)
    if n not in (1, None):
        raise bad("n", f"this server generates one choice per request; got {n!r}")
    return GenerationRequest(
        model=model, max_tokens=checked_max_tokens(doc),
        temperature=checked_number(doc, "temperature", 1.0, 0.0, 2.0),
        top_p=checked_number(doc, "top_p", 1.0, 0.0, 1.0, low_open=True),
        seed=checked_seed(doc.get("seed")), stop=checked_stop(doc.get("stop")),
        stream=checked_bool(doc, "stream"), include_usage=checked_include_usage(doc.get("stream_options")),
    )


def checked_messages(messages) -> list[dict]:
    if messages is None:
        raise bad("messages", "is required: a list of {\"role\", \"content\"} objects")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "must be a non-empty list of {\"role\", \"content\"} objects")
    return [checked_message(i, m) for i, m in enumerate(messages)]


def checked_message(index: int, message) -> dict:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise bad(where, "must be an object with 'role' and 'content'")
    role = message.get("role")
    if role not in ROLES:
        raise bad(f"{where}.role", f"must be one of {', '.join(ROLES)}; got {role!r}")
    return {"role": role, "content": message_text(f"{where}.content", message.get("content"))}


def message_text(where: str, content) -> str:
    """A message's content: a string, or a list of text parts ({"type": "text", "text": ...}) joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise bad(where, "must be a string or a list of {\"type\": \"text\", \"text\": ...} parts (no images)")


def checked_prompt(prompt) -> str:
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise bad("prompt", "is required: one string (a list of several prompts is not supported)")
    if not prompt:
        raise bad("prompt", "must not be empty")
    return prompt


def checked_max_tokens(doc: dict) -> int | None:
    name = "max_completion_tokens" if doc.get("max_completion_tokens") is not None else "max_tokens"
    value = doc.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise bad(name, f"must be a whole number of tokens, at least 1; got {value!r}")
    return value


def checked_number(doc: dict, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = doc.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value > high or value < low or (low_open and value == low):
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise bad(name, f"must be a number in {interval}; got {value!r}")
    return float(value)


def checked_seed(seed) -> int | None:
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise bad("seed", f"must be a whole number >= 0; got {seed!r}")
    return seed


def checked_stop(stop) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad("stop", "must be a non-empty string or a list of them")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad("stop", f"at most {MAX_STOP_STRINGS} stop strings; got {len(stops)}")
    return stops


def checked_bool(doc: dict, name: str) -> bool:
    value = doc.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad(name, f"must be true or false; got {value!r}")
    return value


def checked_include_usage(options) -> bool:
    if options is None:
        return False
    if not isinstance(options, dict):
        raise bad("stream_options", "must be an object such as {\"include_usage\": true}")
    return checked_bool(options, "include_usage")
