"""A conversation: a system prompt and the user/assistant turns, turned into prompt tokens with the model's chat
template, and saved as JSON (written to a temporary file, then renamed over the old one, so a crash never leaves a
half-written history).

    {"version": 1, "system_prompt": "You are terse.", "messages": [{"role": "user", "content": "hi"}, ...]}
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from hivekeeper.planner.errors import InputError

from hivekeeper.core.atomic_file import write_json_atomic

FORMAT_VERSION = 1
ROLES = ("user", "assistant")


@dataclass
class ChatHistory:
    """The turns of one chat. `system_prompt` ("" for none) is kept by reset()."""

    system_prompt: str = ""
    messages: list[dict[str, str]] = field(default_factory=list)

    def add(self, role: str, content: str) -> None:
        if role not in ROLES:
            raise InputError(f"chat history: role must be one of {', '.join(ROLES)}, got {role!r}")
        if not isinstance(content, str):
            raise InputError(f"chat history: content must be text, got {type(content).__name__}")
        self.messages.append({"role": role, "content": content})

    def add_user(self, content: str) -> None:
        self.add("user", content)

    def add_assistant(self, content: str) -> None:
        self.add("assistant", content)

    def reset(self) -> None:
        """Forget the turns; keep the system prompt."""
        self.messages.clear()

    def conversation(self, skip: int = 0) -> list[dict[str, str]]:
        """The messages as a chat template takes them: the system prompt first (if any), then the turns from `skip`."""
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return system + [dict(m) for m in self.messages[skip:]]

    def prompt_ids(self, tokenizer, max_tokens: int | None = None) -> tuple[list[int], int]:
        """Token ids of the conversation, ending with the assistant's turn opened; and how many old messages were
        left out so that it fits in max_tokens (the oldest turns go first; the system prompt and the last message
        always stay). InputError when even that is too long."""
        skip = 0
        while True:
            ids = tokenizer.apply_chat_template(self.conversation(skip), add_generation_prompt=True)
            if max_tokens is None or len(ids) <= max_tokens:
                return ids, skip
            if skip >= len(self.messages) - 1:
                raise InputError(f"the last message with the system prompt is {len(ids)} tokens; the limit is "
                                 f"{max_tokens} tokens (the model's context less the reply): shorten it")
            skip += 2 if skip + 2 < len(self.messages) else 1  # drop a whole user/assistant exchange

    # ---- JSON ------------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"version": FORMAT_VERSION, "system_prompt": self.system_prompt,
                "messages": [dict(m) for m in self.messages]}

    @classmethod
    def from_dict(cls, doc, source: str = "chat history") -> "ChatHistory":
        if not isinstance(doc, dict):
            raise InputError(f"{source}: expected a JSON object")
        version = doc.get("version", FORMAT_VERSION)
        if version != FORMAT_VERSION:
            raise InputError(f"{source}: field 'version' is {version!r}; this Hivekeeper reads version {FORMAT_VERSION}")
        system = doc.get("system_prompt", "")
        if not isinstance(system, str):
            raise InputError(f"{source}: field 'system_prompt' must be a string")
        messages = doc.get("messages", [])
        if not isinstance(messages, list):
            raise InputError(f"{source}: field 'messages' must be a list")
        history = cls(system_prompt=system)
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or message.get("role") not in ROLES \
                    or not isinstance(message.get("content"), str):
                raise InputError(f"{source}: messages[{i}] must be {{\"role\": \"user\"|\"assistant\", "
                                 f"\"content\": text}}")
            history.add(message["role"], message["content"])
        return history

    def save(self, path: str | Path) -> None:
        """Write the history as JSON atomically (temporary file in the same folder, then rename)."""
        write_json_atomic(path, self.to_dict())

    @classmethod
    def load(cls, path: str | Path) -> "ChatHistory":
        path = Path(path)
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise InputError(f"{path}: no such chat history file") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InputError(f"{path}: not a valid chat history JSON file ({exc})") from None
        return cls.from_dict(doc, source=str(path))
