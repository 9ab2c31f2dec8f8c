"""Tokenizer, chat template and streaming detokenizer, checked against transformers' AutoTokenizer."""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, normalizers

from hivekeeper.core.runtime.tokenizer import StreamDecoder, Tokenizer
from hivekeeper.planner.errors import InputError

TEXTS = [
    "Hello world",
    "The keeper of the hive listens to the bees.",
    "  two leading spaces, trailing space ",
    "Line one\nLine two\ttabbed",
    "Ünïcödé — café, 你好, and a bee 🐝!",
    "numbers 12345 and 3.14, don't stop",
    "a <|user|> token and </s> inside text",
    "",
]

CONVERSATION = [
    {"role": "system", "content": "You are a helpful beekeeper."},
    {"role": "user", "content": "How much honey does one hive make?"},
    {"role": "assistant", "content": "It depends on the weather."},
    {"role": "user", "content": "And in a good year? 🐝"},
]


@pytest.fixture(scope="module")
def ours(tiny_checkpoint) -> Tokenizer:
    return Tokenizer.from_folder(tiny_checkpoint)


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(tiny_checkpoint))


def _ids(result) -> list[int]:
    # transformers 5 returns a BatchEncoding from apply_chat_template, older versions a list
    return list(result["input_ids"]) if isinstance(result, Mapping) else list(result)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_and_decode_match_transformers(ours, reference, text):
    assert ours.encode(text) == reference(text).input_ids  # BOS by default, like the checkpoint's post-processor
    assert ours.encode(text, add_bos=True)[0] == ours.bos_token_id
    plain = ours.encode(text, add_bos=False)
    assert plain == reference(text, add_special_tokens=False).input_ids
    assert ours.decode(plain) == reference.decode(plain, skip_special_tokens=True)
    if "<|user|>" not in text:
        assert ours.decode(plain) == text  # byte-level BPE round-trips any text


def test_ordinary_english_encodes_into_word_sized_tokens(ours):
    text = "The keeper of the hive listens to the bees in the morning."
    assert len(ours.encode(text, add_bos=False)) < len(text.split()) * 2


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(ours, reference, add_generation_prompt):
    text = ours.apply_chat_template(CONVERSATION, add_generation_prompt=add_generation_prompt, tokenize=False)
    expected_text = reference.apply_chat_template(
        CONVERSATION, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert text == expected_text
    assert text.startswith("<s><|system|>\n") and text.endswith("<|assistant|>\n") == add_generation_prompt

    ids = ours.apply_chat_template(CONVERSATION, add_generation_prompt=add_generation_prompt)
    assert ids == _ids(reference.apply_chat_template(CONVERSATION, add_generation_prompt=add_generation_prompt))
    assert ids.count(ours.bos_token_id) == 1  # the template writes BOS; encoding must not add a second one
    assert ids.count(ours.token_to_id("<|user|>")) == 2


def test_special_tokens_and_eos(ours):
    assert (ours.bos_token, ours.eos_token, ours.unk_token) == ("<s>", "</s>", "<unk>")
    assert ours.bos_token_id == ours.token_to_id("<s>")
    assert ours.eos_token_ids == (ours.token_to_id("</s>"),)
    assert ours.vocab_size == 512


def test_template_raise_exception_becomes_input_error(ours):
    with pytest.raises(InputError, match="roles must be system, user or assistant, not tool"):
        ours.apply_chat_template([{"role": "tool", "content": "42"}])


@pytest.mark.parametrize("messages", [[], "hello", [{"content": "no role"}], [{"role": "user", "content": 3}]])
def test_malformed_messages_are_rejected(ours, messages):
    with pytest.raises(InputError, match="chat messages"):
        ours.apply_chat_template(messages)


def _copy(checkpoint, tmp_path):
    folder = tmp_path / "copy"
    shutil.copytree(checkpoint, folder)
    return folder


def _edit_json(path, **changes):
    data = json.loads(path.read_text()) if path.exists() else {}
    data.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        del data[key]
    path.write_text(json.dumps(data))


def test_eos_ids_and_stop_strings_from_generation_config(tiny_checkpoint, tmp_path):
    folder = _copy(tiny_checkpoint, tmp_path)
    _edit_json(folder / "generation_config.json", eos_token_id=[5, 2], stop_strings=["User:"])
    _edit_json(folder / "config.json", eos_token_id=4)
    tokenizer = Tokenizer.from_folder(folder)
    # generation_config first, then config.json, then the tokenizer's eos_token; duplicates dropped
    assert tokenizer.eos_token_ids == (5, 2, 4)
    assert tokenizer.stop_strings == ("User:",)


def test_template_from_jinja_file_with_hf_helpers(tiny_checkpoint, tmp_path):
    folder = _copy(tiny_checkpoint, tmp_path)
    _edit_json(folder / "tokenizer_config.json", chat_template=None)
    (folder / "chat_template.jinja").write_text(
        "{% set ns = namespace(n=0) %}"
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}{% set ns.n = ns.n + 1 %}{% endfor %}"
        "{{ ns.n }}|{{ messages[0] | tojson }}|{{ bos_token }}|{{ strftime_now('%Y') | length }}"
        "{% if add_generation_prompt %}|gen{% endif %}"
    )
    tokenizer = Tokenizer.from_folder(folder)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "<b>&</b>"}] * 3, tokenize=False)
    # loop controls work, tojson does not HTML-escape, the special-token variables and helpers are there
    assert text == '2|{"role": "user", "content": "<b>&</b>"}|<s>|4|gen'


def test_template_is_sandboxed(tiny_checkpoint, tmp_path):
    folder = _copy(tiny_checkpoint, tmp_path)
    _edit_json(folder / "tokenizer_config.json", chat_template="{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(InputError, match="tokenizer_config.json"):
        Tokenizer.from_folder(folder).apply_chat_template(CONVERSATION)


def test_missing_chat_template_is_a_clear_error(tiny_checkpoint, tmp_path):
    folder = _copy(tiny_checkpoint, tmp_path)
    _edit_json(folder / "tokenizer_config.json", chat_template=None)
    tokenizer = Tokenizer.from_folder(folder)
    assert tokenizer.encode("still encodes") == Tokenizer.from_folder(tiny_checkpoint).encode("still encodes")
    with pytest.raises(InputError, match="no chat template"):
        tokenizer.apply_chat_template(CONVERSATION)


def test_missing_or_corrupt_tokenizer_json(tiny_checkpoint, tmp_path):
    folder = _copy(tiny_checkpoint, tmp_path)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(InputError, match=r"tokenizer\.json: missing.*save_pretrained"):
        Tokenizer.from_folder(folder)
    (folder / "tokenizer.json").write_text('{"model": ')
    with pytest.raises(InputError, match=r"tokenizer\.json: not a valid"):
        Tokenizer.from_folder(folder)
    with pytest.raises(InputError, match="no such checkpoint folder"):
        Tokenizer.from_folder(tmp_path / "nowhere")


# ---- streaming ---------------------------------------------------------------------------------------------------
def _stream(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    decoder = tokenizer.stream_decoder()
    pieces = [decoder.feed(i) for i in ids]
    pieces.append(decoder.flush())
    return pieces


def _assert_stable_stream(tokenizer: Tokenizer, ids: list[int], expected: str) -> list[str]:
    pieces = _stream(tokenizer, ids)
    assert "".join(pieces) == tokenizer.decode(ids) == expected
    assert not any("\ufffd" in piece for piece in pieces)  # never a broken character on screen
    return pieces


def test_stream_decoder_byte_level_multibyte(ours):
    text = "Bees 🐝 buzz — café 你好, the keeper said."
    ids = ours.encode(text, add_bos=False)
    pieces = _assert_stable_stream(ours, ids, text)
    # the emoji and CJK characters are split over several byte tokens, so some steps must hold text back
    assert pieces.count("") >= 3
    naive = "".join(ours.decode([i]) for i in ids)
    assert "\ufffd" in naive  # what token-by-token decoding would have shown


def test_stream_decoder_skips_special_tokens_and_keeps_going(ours):
    ids = ours.encode("Hello there", add_bos=True) + [ours.eos_token_ids[0]]
    decoder = StreamDecoder(ours)
    assert "".join(decoder.feed(i) for i in ids) == "Hello there"
    assert decoder.feed(ours.eos_token_ids[0]) == ""


def test_stream_decoder_flush_releases_an_unfinished_character(ours):
    ids = ours.encode("ok 🐝", add_bos=False)
    decoder = ours.stream_decoder()
    shown = "".join(decoder.feed(i) for i in ids[:-1])  # stop one byte short of the emoji
    assert shown == "ok "
    assert decoder.flush() == ours.decode(ids[:-1])[len(shown):]
    assert decoder.flush() == ""


@pytest.fixture(scope="module")
def sentencepiece_style(tmp_path_factory) -> Tokenizer:
    """A Llama-2-style tokenizer: "▁" marks spaces, unknown characters fall back to <0xNN> byte tokens, and the
    decoder strips the leading space of whatever it decodes."""
    specials = ["<unk>", "<s>", "</s>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    chars = ["▁"] + [chr(c) for c in range(33, 127)]
    words = ["▁Hello", "▁world", "▁the", "▁hive", "▁keeper", "▁bees"]
    merges, merged = [], []
    for word in words:
        for end in range(2, len(word) + 1):
            left, right = word[: end - 1], word[end - 1]
            if (left, right) not in merges:
                merges.append((left, right))
                merged.append(word[:end])
    vocab = {token: i for i, token in enumerate(dict.fromkeys(specials + byte_tokens + chars + merged))}
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    backend.add_special_tokens(specials)
    folder = tmp_path_factory.mktemp("sp-style")
    backend.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer.from_folder(folder)


def test_stream_decoder_sentencepiece_spaces_and_byte_fallback(sentencepiece_style):
    tokenizer = sentencepiece_style
    text = "Hello world, the hive é 🐝 bees"
    ids = tokenizer.encode(text, add_bos=False)
    assert "▁world" in [tokenizer.id_to_token(i) for i in ids]
    assert "<0xC3>" in [tokenizer.id_to_token(i) for i in ids]  # é is not in the vocabulary: byte fallback
    _assert_stable_stream(tokenizer, ids, text)
    naive = "".join(tokenizer.decode([i]) for i in ids)
    assert "Helloworld" in naive  # decoding tokens one by one loses the "▁" spaces


def test_sentencepiece_style_defaults(sentencepiece_style):
    # no post-processor adding BOS and no add_bos_token in the config: encode adds no BOS unless asked
    assert sentencepiece_style.encode("Hello")[0] != sentencepiece_style.bos_token_id
    assert sentencepiece_style.encode("Hello", add_bos=True)[0] == sentencepiece_style.bos_token_id
    assert sentencepiece_style.eos_token_ids == (sentencepiece_style.token_to_id("</s>"),)


def test_bos_null_in_tokenizer_config_wins_over_model_configs(tiny_checkpoint, tmp_path):
    # Qwen2-style: no BOS token, although generation_config.json names a bos_token_id
    folder = _copy(tiny_checkpoint, tmp_path)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(bos_token=None, add_bos_token=None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer.from_folder(folder)
    assert tokenizer.bos_token is None and tokenizer.bos_token_id is None
    assert tokenizer.encode("Hello", add_bos=True) == tokenizer.encode("Hello", add_bos=False)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False).startswith("<|user|>")


def test_without_tokenizer_config_the_model_configs_name_bos_and_eos(tiny_checkpoint, tmp_path):
    folder = _copy(tiny_checkpoint, tmp_path)
    (folder / "tokenizer_config.json").unlink()
    tokenizer = Tokenizer.from_folder(folder)
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<s>", "</s>")
    assert tokenizer.encode("Hello")[0] == tokenizer.bos_token_id  # tokenizer.json's post-processor adds it
    assert tokenizer.chat_template is None


def test_stream_decoder_does_not_hold_invalid_bytes_forever(ours):
    # a random model can emit stray UTF-8 continuation bytes that never form a character
    stray = next(i for i in range(ours.vocab_size) if ours.decode([i]) == "\ufffd")
    ids = [stray] * 20
    pieces = _stream(ours, ids)
    assert "".join(pieces) == ours.decode(ids)
    assert pieces[:10].count("") < 10  # released after a few ids, not only at the end
