"""Tokenizer and chat template of a Hugging Face checkpoint folder (or of a GGUF file), without transformers.

The vocabulary and the encoding rules come from tokenizer.json (the `tokenizers` library); the special tokens and
the chat template from tokenizer_config.json (or chat_template.jinja beside it), rendered with jinja2 in a sandbox
with the helpers Hugging Face templates expect; the end-of-sequence ids from generation_config.json, config.json and
tokenizer_config.json. A GGUF carries all of that in its metadata: `load_tokenizer` takes either, the GGUF through
`Tokenizer.from_gguf` (gguf_tokenizer.py). `StreamDecoder` turns generated ids into text one token at a time for streaming.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _BackendTokenizer

from hivekeeper.planner.errors import InputError
from hivekeeper.planner.gguf_metadata import find_gguf, open_reader, require_gguf

from hivekeeper.core.runtime.gguf_tokenizer import tokenizer_parts

# The Unicode replacement character: what byte-level decoders print for an incomplete UTF-8 sequence.
_INCOMPLETE = "\ufffd"
# A UTF-8 character is at most 4 bytes, so at most 4 tokens: text still incomplete after more is invalid bytes
# (random or corrupt output) and is released rather than held back forever.
_MAX_PENDING_IDS = 6


def _read_json(path: Path) -> dict:
    """A JSON object from `path`, or {} when the file does not exist."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise InputError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict with "content"."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _as_id_list(value: Any) -> list[int]:
    """eos_token_id as configs write it: an int, a list of ints, or null."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _raise_from_template(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False) -> str:
    # jinja's own tojson escapes HTML characters; chat templates expect plain JSON
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str, origin: str = "chat template") -> jinja2.Template:
    """Compile a chat template the way Hugging Face renders them: sandboxed, trim_blocks and lstrip_blocks on,
    loop controls, with `raise_exception`, `strftime_now` and a plain `tojson` filter."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_from_template
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise InputError(f"{origin}: the chat template does not parse: {exc.message} (line {exc.lineno})") from None


def _check_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InputError("chat messages: expected a non-empty list of {'role': ..., 'content': ...}")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise InputError(f"chat messages[{i}]: expected a dict with a string 'role', got {message!r:.80}")
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise InputError(f"chat messages[{i}]: 'content' must be a string, got {type(content).__name__}")
        checked.append(dict(message))
    return checked


class Tokenizer:
    """The tokenizer of one checkpoint folder. Build it with `Tokenizer.from_folder(path)`."""

    def __init__(
        self,
        backend: _BackendTokenizer,
        *,
        source: str,
        bos_token: str | None = None,
        eos_token: str | None = None,
        unk_token: str | None = None,
        pad_token: str | None = None,
        eos_token_ids: Sequence[int] = (),
        add_bos_default: bool = False,
        chat_template: str | None = None,
        chat_template_origin: str = "",
        stop_strings: Sequence[str] = (),
    ):
        self.backend = backend
        self.source = source  # the folder, for error messages
        self.bos_token, self.eos_token, self.unk_token, self.pad_token = bos_token, eos_token, unk_token, pad_token
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        self.eos_token_ids = tuple(dict.fromkeys(eos_token_ids))
        self.add_bos_default = add_bos_default and self.bos_token_id is not None
        self.chat_template = chat_template
        self._chat_template_origin = chat_template_origin or source
        self.stop_strings = tuple(stop_strings)

    # ---- loading -------------------------------------------------------------------------------------------------
    @classmethod
    def from_folder(cls, path: str | Path) -> "Tokenizer":
        """Load tokenizer.json, tokenizer_config.json, generation_config.json and config.json from a folder.
        config.json is read first: a broken one is the folder's problem to name, before a missing tokenizer.json."""
        folder = Path(path)
        if not folder.is_dir():
            raise InputError(f"{folder}: no such checkpoint folder")
        model_config = _read_json(folder / "config.json")
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise InputError(
                f"{tokenizer_file}: missing. This checkpoint has no fast tokenizer; convert it once with transformers "
                "(AutoTokenizer.from_pretrained(...).save_pretrained(folder)) or download tokenizer.json from the "
                "model's hub page into the folder"
            )
        try:
            backend = _BackendTokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the Rust library raises plain Exception for a corrupt file
            raise InputError(f"{tokenizer_file}: not a valid tokenizer.json ({exc})") from None

        tok_config = _read_json(folder / "tokenizer_config.json")
        gen_config = _read_json(folder / "generation_config.json")

        bos = _token_text(tok_config.get("bos_token"))
        eos = _token_text(tok_config.get("eos_token"))
        unk = _token_text(tok_config.get("unk_token"))
        pad = _token_text(tok_config.get("pad_token"))
        # Without a word from tokenizer_config.json, take the ids of the model configs. A null there is meant:
        # Qwen2 has no BOS token although its generation_config.json names one.
        if "bos_token" not in tok_config:
            bos = _token_for_id(backend, gen_config.get("bos_token_id", model_config.get("bos_token_id")))
        if "eos_token" not in tok_config:
            eos = _token_for_id(backend, _first(_as_id_list(model_config.get("eos_token_id"))))

        eos_ids = _as_id_list(gen_config.get("eos_token_id")) + _as_id_list(model_config.get("eos_token_id"))
        if eos is not None and backend.token_to_id(eos) is not None:
            eos_ids.append(backend.token_to_id(eos))

        if isinstance(tok_config.get("add_bos_token"), bool):
            add_bos = tok_config["add_bos_token"]
        else:
            add_bos = _post_processor_adds(backend, bos)

        template, origin = _find_chat_template(folder, tok_config)
        stops = gen_config.get("stop_strings") or []
        if isinstance(stops, str):
            stops = [stops]
        return cls(
            backend,
            source=str(folder),
            bos_token=bos,
            eos_token=eos,
            unk_token=unk,
            pad_token=pad,
            eos_token_ids=eos_ids,
            add_bos_default=add_bos,
            chat_template=template,
            chat_template_origin=origin,
            stop_strings=[s for s in stops if isinstance(s, str) and s],
        )

    @classmethod
    def from_gguf(cls, path: str | Path) -> "Tokenizer":
        """The tokenizer and chat template in a GGUF file's metadata (or of the GGUF a folder holds)."""
        file = require_gguf(path)
        backend, options = tokenizer_parts(open_reader(file), str(file))
        return cls(backend, **options)

    # ---- ids <-> text --------------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`. add_bos=None follows the checkpoint's default (its post-processor or config)."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_bos is None:
            add_bos = self.add_bos_default
        if add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def stream_decoder(self, skip_special_tokens: bool = True) -> "StreamDecoder":
        return StreamDecoder(self, skip_special_tokens=skip_special_tokens)

    # ---- chat ------------------------------------------------------------------------------------------------------
    @cached_property
    def _compiled_template(self) -> jinja2.Template:
        if self.chat_template is None:
            raise InputError(
                f"{self.source}: the checkpoint has no chat template (no 'chat_template' in tokenizer_config.json "
                "and no chat_template.jinja); use a chat/instruct model, or generate from a plain prompt"
            )
        return compile_chat_template(self.chat_template, self._chat_template_origin)

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """The conversation as the model's chat template writes it, as text (special tokens spelled out)."""
        checked = _check_messages(messages)
        variables = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            "unk_token": self.unk_token or "",
            "pad_token": self.pad_token or "",
            **extra,
            "messages": checked,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self._compiled_template.render(**variables)
        except jinja2.exceptions.TemplateError as exc:
            raise InputError(f"{self._chat_template_origin}: the chat template refused the messages: {exc}") from None

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = True,
        **extra: Any,
    ) -> list[int] | str:
        """Render the conversation with the chat template; token ids (default) or the text when tokenize=False.

        The template writes the BOS token itself, so the text is encoded without adding another one.
        """
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt, **extra)
        if not tokenize:
            return text
        return self.backend.encode(text, add_special_tokens=False).ids


def _first(values: list[int]) -> int | None:
    return values[0] if values else None


def _token_for_id(backend: _BackendTokenizer, token_id: Any) -> str | None:
    if isinstance(token_id, int) and not isinstance(token_id, bool):
        return backend.id_to_token(token_id)
    return None


def _post_processor_adds(backend: _BackendTokenizer, bos: str | None) -> bool:
    """Whether tokenizer.json's post-processor puts the BOS token in front of a plain encode."""
    bos_id = backend.token_to_id(bos) if bos else None
    if bos_id is None:
        return False
    probe = backend.encode("a", add_special_tokens=True).ids
    return bool(probe) and probe[0] == bos_id


def _find_chat_template(folder: Path, tok_config: dict) -> tuple[str | None, str]:
    """The default chat template and the file it came from: tokenizer_config.json's "chat_template" (a string, or
    a list of named templates), else chat_template.jinja, else chat_template.json."""
    config_file = folder / "tokenizer_config.json"
    template = tok_config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default") or next(iter(named.values()), None)
    if isinstance(template, str):
        return template, str(config_file)
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8"), str(jinja_file)
    json_file = folder / "chat_template.json"
    template = _read_json(json_file).get("chat_template")
    if isinstance(template, str):
        return template, str(json_file)
    return None, str(config_file)


class StreamDecoder:
    """Incremental detokenizer: feed generated ids one at a time and get back only text that is final.

    Decoding one token alone is wrong in two ways: a byte-level token can hold part of a multi-byte character
    (the decoder prints U+FFFD until the rest arrives), and SentencePiece-style decoders drop the leading "▁"
    space of the first token of whatever they decode. So each step decodes a short window of recent ids twice,
    with and without the new ones, and emits the difference; a window ending in an incomplete character waits
    (for a few ids at most). The pieces joined equal `tokenizer.decode(all ids)`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self.ids: list[int] = []
        self._prefix_start = 0  # the window starts here: ids already emitted, kept as context
        self._read_end = 0  # ids before this are emitted
        self.text = ""  # everything emitted so far

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def feed(self, token_id: int) -> str:
        """Add one id; return the new final text (often "", e.g. inside a multi-byte character)."""
        self.ids.append(int(token_id))
        prefix_text = self._decode(self.ids[self._prefix_start : self._read_end])
        window_text = self._decode(self.ids[self._prefix_start :])
        pending = len(self.ids) - self._read_end
        if len(window_text) <= len(prefix_text):
            return ""
        if window_text.endswith(_INCOMPLETE) and pending < _MAX_PENDING_IDS:
            return ""  # wait for the rest of the character; past a few ids it is broken data, shown as it is
        piece = window_text[len(prefix_text) :]
        self._prefix_start, self._read_end = self._read_end, len(self.ids)
        self.text += piece
        return piece

    def feed_many(self, token_ids: Iterable[int]) -> str:
        return "".join(self.feed(t) for t in token_ids)

    def flush(self) -> str:
        """At the end of generation: whatever is still held back (an incomplete character prints as U+FFFD)."""
        prefix_text = self._decode(self.ids[self._prefix_start : self._read_end])
        window_text = self._decode(self.ids[self._prefix_start :])
        piece = window_text[len(prefix_text) :]
        self._prefix_start, self._read_end = self._read_end, len(self.ids)
        self.text += piece
        return piece


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of a checkpoint folder (`Tokenizer.from_folder`) or of a GGUF file or a folder holding one
    (rebuilt from the GGUF metadata, gguf_tokenizer.py)."""
    return Tokenizer.from_folder(path) if find_gguf(path) is None else Tokenizer.from_gguf(path)
