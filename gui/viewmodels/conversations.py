"""Saved conversations: one core.chat_history file per conversation, plus a small sidecar with the app's notes.

    conversations/<id>.json       the ChatHistory (system prompt and turns), written atomically by core
    conversations/<id>.meta.json  title, model, run mode (local or swarm), and per assistant reply its tokens/s
                                  (written atomically too)

Every change is saved at once (the user's message when sent, the reply when it ends), so a crash loses at most
the reply being generated.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from hivekeeper.core.runtime.chat_history import ChatHistory
from hivekeeper.planner.errors import InputError

from hivekeeper.core.atomic_file import write_json_atomic


@dataclass
class Conversation:
    id: str
    history: ChatHistory
    title: str = "New chat"
    model: str = ""
    created: float = field(default_factory=time.time)
    reply_stats: dict[int, dict] = field(default_factory=dict)  # message index -> {"tokens_per_s", "tokens", ...}
    mode: str = ""  # how its last reply ran: "local" or "swarm" ("" for conversations saved before it was kept)


class ConversationStore:
    def __init__(self, folder: Path):
        self.folder = Path(folder)

    def _paths(self, conversation_id: str) -> tuple[Path, Path]:
        if not conversation_id or "/" in conversation_id or conversation_id.startswith("."):
            raise InputError(f"bad conversation id {conversation_id!r}")
        return self.folder / f"{conversation_id}.json", self.folder / f"{conversation_id}.meta.json"

    def new(self, system_prompt: str = "", model: str = "") -> Conversation:
        conversation_id = time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
        return Conversation(conversation_id, ChatHistory(system_prompt=system_prompt), model=model)

    def save(self, conversation: Conversation) -> None:
        history_path, meta_path = self._paths(conversation.id)
        conversation.history.save(history_path)
        write_json_atomic(meta_path, {
            "title": conversation.title, "model": conversation.model, "mode": conversation.mode,
            "created": conversation.created, "reply_stats": {str(k): v for k, v in conversation.reply_stats.items()},
        })

    def load(self, conversation_id: str) -> Conversation:
        history_path, meta_path = self._paths(conversation_id)
        history = ChatHistory.load(history_path)
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
            if not isinstance(meta, dict):
                meta = {}
        except (OSError, ValueError):
            meta = {}  # the notes are optional: the conversation itself is what matters
        stats = {}
        for key, value in (meta.get("reply_stats") or {}).items():
            if str(key).isdigit() and isinstance(value, dict):
                stats[int(key)] = value
        title = meta.get("title") if isinstance(meta.get("title"), str) else _title(history)
        mode = meta.get("mode") if meta.get("mode") in ("local", "swarm") else ""
        return Conversation(conversation_id, history, title, str(meta.get("model") or ""),
                            float(meta.get("created") or history_path.stat().st_mtime), stats, mode)

    def delete(self, conversation_id: str) -> None:
        for path in self._paths(conversation_id):
            path.unlink(missing_ok=True)

    def list(self) -> list[tuple[str, str]]:
        """(id, title) of every saved conversation, newest first; unreadable files are skipped."""
        if not self.folder.is_dir():
            return []
        items = []
        for path in self.folder.glob("*.json"):
            if path.name.endswith(".meta.json") or path.name.startswith("."):
                continue
            conversation_id = path.stem
            try:
                meta = json.loads((self.folder / f"{conversation_id}.meta.json").read_text(encoding="utf-8"))
                title = str(meta.get("title") or conversation_id)
            except (OSError, ValueError, AttributeError):
                title = conversation_id
            items.append((path.stat().st_mtime, conversation_id, title))
        return [(cid, title) for _, cid, title in sorted(items, reverse=True)]


def _title(history: ChatHistory) -> str:
    first = next((m["content"] for m in history.messages if m["role"] == "user"), "")
    return title_from(first)


def title_from(text: str) -> str:
    words = " ".join(text.split())
    return (words[:48] + "…") if len(words) > 48 else (words or "New chat")
