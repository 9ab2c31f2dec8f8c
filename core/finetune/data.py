"""A fine-tuning data file: JSON lines, each a chat or a prompt/completion pair, as token ids and a loss start.

    {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}
    {"prompt": "The capital of Zorblaxia is", "completion": " Quenthor."}

A chat is rendered with the model's chat template; the loss counts only its last message, which must be the
assistant's (so training teaches replies, not questions). A pair is encoded as plain text; the loss counts the
completion. Blank lines are skipped. The file is UTF-8 (with or without a BOM). Anything else (bytes that are not
UTF-8, a line that is not JSON, a missing field, an empty file, an example longer than the context leaves after the
trained prompt tokens) is one InputError naming the file and line.
"""

from __future__ import annotations

import codecs
import json
import random
from dataclasses import dataclass
from pathlib import Path

from hivekeeper.planner.errors import InputError


@dataclass(frozen=True)
class Example:
    ids: tuple[int, ...]  # the whole sequence
    target_start: int  # the first position whose token the loss counts (>= 1)
    line: int  # where it came from (1-based)


def read_examples(path: str | Path, tokenizer, max_tokens: int) -> list[Example]:
    """Every example of the file, tokenized; max_tokens: the longest sequence allowed (context - prompt tokens)."""
    path = Path(path)
    examples = [_example(path, number, text, tokenizer, max_tokens)
                for number, text in enumerate(_lines(path), 1) if text.strip()]
    if not examples:
        raise InputError(f"{path}: the data file is empty (it needs JSON lines of 'messages' or "
                         f"'prompt'/'completion')")
    return examples


def _lines(path: Path) -> list[str]:
    """The file's lines: UTF-8 (a BOM at the start, as Windows Notepad writes, is skipped), split at "\n" alone
    (JSON strings may hold U+2028 and other characters str.splitlines() splits at); bytes that are not UTF-8 are
    one error naming the line."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise InputError(f"{path}: cannot read the data file ({exc.strerror or exc})") from None
    if raw.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        raise InputError(f"{path}:1: UTF-16 text: the data file must be UTF-8")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:  # exc.object: the bytes after the BOM, which hold no newline
        line = exc.object.count(b"\n", 0, exc.start) + 1
        raise InputError(f"{path}:{line}: byte 0x{exc.object[exc.start]:02x} is not UTF-8: the data file must be "
                         "UTF-8") from None
    return [line.removesuffix("\r") for line in text.split("\n")]


def _example(path: Path, number: int, text: str, tokenizer, max_tokens: int) -> Example:
    where = f"{path}:{number}"
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{where}: not a JSON line ({exc.msg} at column {exc.colno})") from None
    if not isinstance(record, dict):
        raise InputError(f"{where}: a line must be a JSON object with 'messages' or 'prompt'/'completion'")
    if "messages" in record:
        ids, start = _chat_ids(where, record["messages"], tokenizer)
    elif "prompt" in record and "completion" in record:
        ids, start = _pair_ids(where, record["prompt"], record["completion"], tokenizer)
    else:
        raise InputError(f"{where}: a line needs 'messages' or both 'prompt' and 'completion'")
    if len(ids) > max_tokens:
        raise InputError(f"{where}: the example has {len(ids)} tokens; the model's context leaves {max_tokens} "
                         f"after the trained prompt tokens")
    return Example(tuple(ids), start, number)


def _chat_ids(where: str, messages, tokenizer) -> tuple[list[int], int]:
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("content"), str) and isinstance(m.get("role"), str)
            for m in messages):
        raise InputError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} strings")
    if messages[-1]["role"] != "assistant":
        raise InputError(f"{where}: the last message must be the assistant's (the reply to learn)")
    try:
        context = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True)
        whole = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    except InputError as exc:
        raise InputError(f"{where}: {exc}") from None
    if list(whole[: len(context)]) != list(context) or len(whole) <= len(context):
        raise InputError(f"{where}: the chat template does not render the reply after the conversation")
    return list(whole), max(1, len(context))


def _pair_ids(where: str, prompt, completion, tokenizer) -> tuple[list[int], int]:
    if not isinstance(prompt, str) or not isinstance(completion, str) or not completion:
        raise InputError(f"{where}: 'prompt' and 'completion' must be strings, the completion not empty")
    head = tokenizer.encode(prompt)
    tail = tokenizer.encode(completion, add_bos=False)
    if not tail:
        raise InputError(f"{where}: the completion encodes to no tokens")
    return head + tail, max(1, len(head))


def batches(examples: list[Example], batch: int, step: int, seed: int = 0) -> list[Example]:
    """The examples of training step `step` (0-based): epochs in a shuffled order fixed by the seed, so that a
    resumed run sees the same batches as an uninterrupted one."""
    per_epoch = len(examples)
    first = step * batch
    chosen = []
    for index in range(first, first + batch):
        epoch, offset = divmod(index, per_epoch)
        order = list(range(per_epoch))
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
        chosen.append(examples[order[offset]])
    return chosen
