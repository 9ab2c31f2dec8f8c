"""Chat history: turns and system prompt, prompt tokens through the real chat template, fitting the context, and
JSON files written atomically with errors that name the file and field."""

from __future__ import annotations

import json
import os

import pytest

from hivekeeper.core.runtime.chat_history import ChatHistory
from hivekeeper.core.runtime.tokenizer import Tokenizer
from hivekeeper.planner.errors import InputError


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    return Tokenizer.from_folder(tiny_checkpoint)


def sample_history() -> ChatHistory:
    history = ChatHistory(system_prompt="Be brief.")
    history.add_user("Hello, who are you?")
    history.add_assistant("A small model.")
    history.add_user("What is bread made of?")
    return history


def test_prompt_uses_the_chat_template_with_the_system_prompt_first(tokenizer):
    history = sample_history()
    ids, dropped = history.prompt_ids(tokenizer)
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert dropped == 0
    assert text.index("<|system|>\nBe brief.") < text.index("Hello, who are you?") < text.index("bread made")
    assert text.endswith("<|assistant|>\n")  # the reply's turn is open
    assert ids == tokenizer.apply_chat_template(history.conversation())


def test_old_turns_are_left_out_when_the_context_is_short(tokenizer):
    history = sample_history()
    full, _ = history.prompt_ids(tokenizer)
    ids, dropped = history.prompt_ids(tokenizer, max_tokens=len(full) - 1)
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert dropped == 2 and "Hello, who are you?" not in text
    assert "Be brief." in text and "bread made" in text  # system prompt and the last message stay
    assert len(history.messages) == 3  # the history itself is untouched
    with pytest.raises(InputError, match=r"the limit is 5 tokens"):
        history.prompt_ids(tokenizer, max_tokens=5)


def test_reset_keeps_the_system_prompt():
    history = sample_history()
    history.reset()
    assert history.messages == [] and history.conversation() == [{"role": "system", "content": "Be brief."}]
    with pytest.raises(InputError, match="role must be one of"):
        history.add("system", "no")


def test_save_and_load_round_trip_atomically(tmp_path):
    path = tmp_path / "chats" / "one.json"
    history = sample_history()
    history.save(path)
    assert ChatHistory.load(path) == history
    assert json.loads(path.read_text())["version"] == 1
    history.add_assistant("Flour, water, salt.")
    history.save(path)  # replaces the old file
    assert ChatHistory.load(path).messages[-1]["content"] == "Flour, water, salt."
    assert sorted(os.listdir(path.parent)) == ["one.json"]  # no temporary file left


def test_a_failed_save_keeps_the_old_file(tmp_path):
    path = tmp_path / "h.json"
    sample_history().save(path)
    before = path.read_text()
    broken = sample_history()
    broken.messages.append({"role": "user", "content": object()})  # not JSON-serializable
    with pytest.raises(TypeError):
        broken.save(path)
    assert path.read_text() == before and sorted(os.listdir(tmp_path)) == ["h.json"]


@pytest.mark.parametrize("content, match", [
    ("{not json", "not a valid chat history JSON"),
    ("[]", "expected a JSON object"),
    ('{"version": 9}', "field 'version' is 9"),
    ('{"system_prompt": 3}', "field 'system_prompt' must be a string"),
    ('{"messages": {}}', "field 'messages' must be a list"),
    ('{"messages": [{"role": "robot", "content": "x"}]}', r"messages\[0\] must be"),
])
def test_bad_files_name_the_file_and_field(tmp_path, content, match):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(InputError, match=match) as info:
        ChatHistory.load(path)
    assert str(path) in str(info.value)
    with pytest.raises(InputError, match="no such chat history file"):
        ChatHistory.load(tmp_path / "missing.json")
