"""The tokenizer of a GGUF file, rebuilt from its metadata with the `tokenizers` library.

A GGUF has no tokenizer.json: llama.cpp stores the vocabulary (`tokenizer.ggml.tokens`), the token types, the
merges or scores, the special token ids and the chat template as metadata. Two vocabulary kinds cover the
supported families (`tokenizer.ggml.model`):

- "gpt2": byte-level BPE (SmolLM2, Qwen2, Llama 3): tokens and merges as given; text is split first by the
  regex llama.cpp uses for the file's `tokenizer.ggml.pre` (unknown ones fall back to GPT-2's);
- "llama": SentencePiece-style BPE (Llama 2, Mistral, TinyLlama): tokens and scores, merges recovered from the
  scores, "▁" for spaces and byte fallback (`<0x0A>`) for characters outside the vocabulary.

Control tokens become special added tokens (kept whole, dropped when decoding); user-defined ones plain added
tokens. `tokenizer_parts` gives the `tokenizers` backend and the options of tokenizer.Tokenizer, which
`Tokenizer.from_gguf` builds: the same Tokenizer a checkpoint folder gives, so the rest of the app does not care.
The file's architecture is checked first, as the checkpoint and the planner check it: `generate` and `chat` read the
tokenizer before the weights, and a file the runtime cannot run must get that one error, not a tokenizer's.
"""

from __future__ import annotations

import logging
from functools import lru_cache

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from hivekeeper.planner.errors import InputError
from hivekeeper.planner.gguf_metadata import architecture, field

log = logging.getLogger(__name__)

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types (gguf.TokenType)

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the regexes llama.cpp splits text with, applied in turn (llama-vocab.cpp)
PRE_TOKENIZER_SPLITS = {
    "default": (_GPT2_SPLIT,), "gpt2": (_GPT2_SPLIT,),
    "smollm": (r"\p{N}", _GPT2_SPLIT),
    "llama-bpe": (_LLAMA3_SPLIT,), "llama3": (_LLAMA3_SPLIT,), "llama-v3": (_LLAMA3_SPLIT,),
    "smaug-bpe": (_LLAMA3_SPLIT,), "falcon3": (_LLAMA3_SPLIT,),
    "qwen2": (_QWEN2_SPLIT,), "deepseek-r1-qwen": (_QWEN2_SPLIT,),
}
# llama.cpp merges a word found whole in the vocabulary without applying merges, for these
_IGNORE_MERGES = ("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "falcon3")


def tokenizer_parts(reader, source: str) -> tuple[BackendTokenizer, dict]:
    """The tokenizer described by an open GGUFReader's metadata: the backend and the keyword arguments of
    tokenizer.Tokenizer (special tokens, stop ids, add-BOS rule, chat template); `source` names the file in errors.
    An architecture the runtime does not run is refused first (gguf_metadata.architecture's error)."""
    architecture(reader, source)
    kind = field(reader, "tokenizer.ggml.model")
    tokens = field(reader, "tokenizer.ggml.tokens")
    if kind is None or not tokens:
        raise InputError(f"{source}: the GGUF file has no tokenizer (no tokenizer.ggml.model / tokens metadata)")
    types = field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind == "gpt2":
        backend = _byte_level(reader, tokens, source)
    elif kind == "llama":
        backend = _sentencepiece(reader, tokens, source)
    else:
        raise InputError(f"{source}: GGUF tokenizer {kind!r} is not supported; supported: gpt2, llama")
    _add_special_tokens(backend, tokens, types)
    return backend, _options(reader, backend, tokens, kind, source)


def _byte_level(reader, tokens: list[str], source: str) -> BackendTokenizer:
    merges = field(reader, "tokenizer.ggml.merges")
    if not merges:
        raise InputError(f"{source}: byte-level BPE tokenizer without tokenizer.ggml.merges")
    pre = field(reader, "tokenizer.ggml.pre", "default")
    splits = PRE_TOKENIZER_SPLITS.get(pre)
    if splits is None:
        log.warning("%s: pre-tokenizer %r is unknown here; splitting text as GPT-2 does", source, pre)
        splits = PRE_TOKENIZER_SPLITS["default"]
    alphabet = _byte_alphabet()
    vocab = {}
    for index, token in enumerate(tokens):  # a token outside the byte alphabet (a mislabel) is spelled in it
        vocab.setdefault(token if set(token) <= alphabet.keys() else _byte_spell(token), index)
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = BackendTokenizer(models.BPE(vocab, pairs, fuse_unk=False, ignore_merges=pre in _IGNORE_MERGES))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[str, int]:
    """GPT-2's printable spelling of the 256 bytes (character -> byte): printable Latin-1 bytes stand for
    themselves, the others for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


def _byte_spell(token: str) -> str:
    spelling = {byte: char for char, byte in _byte_alphabet().items()}
    return "".join(spelling[b] for b in token.encode("utf-8"))


def _sentencepiece(reader, tokens: list[str], source: str) -> BackendTokenizer:
    scores = field(reader, "tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise InputError(f"{source}: SentencePiece tokenizer without one tokenizer.ggml.scores value per token")
    vocab = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
    unk_id = field(reader, "tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < len(tokens) else None
    backend = BackendTokenizer(models.BPE(vocab, _merges_from_scores(vocab, tokens, scores), unk_token=unk,
                                          fuse_unk=True, byte_fallback=True))
    prefix = bool(field(reader, "tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first" if prefix else "never",
                                                     split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return backend


def _merges_from_scores(vocab: dict[str, int], tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges a SentencePiece vocabulary implies: every split of a token into two tokens, the merge ranked by
    the joined token's score (higher first), ties by the pieces' lengths (as transformers' generate_merges)."""
    found = []
    for token, score in zip(tokens, scores):
        local = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        local.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        found += [(score, len(left), len(right), left, right) for left, right in local]
    found.sort(key=lambda m: (m[0], m[1], m[2]), reverse=True)  # stable: equal keys keep the order above
    return [(m[3], m[4]) for m in found]


def _add_special_tokens(backend: BackendTokenizer, tokens: list[str], types: list[int]) -> None:
    """Control tokens (<|im_start|>, </s>) as special added tokens, user-defined ones as plain added tokens: both
    are matched whole in text, as llama.cpp does."""
    vocab = backend.get_vocab()
    control = [AddedToken(t, special=True, normalized=False) for t, kind in zip(tokens, types)
               if kind == CONTROL and t in vocab]
    user = [AddedToken(t, special=False, normalized=False) for t, kind in zip(tokens, types)
            if kind == USER_DEFINED and t in vocab]
    if control:
        backend.add_special_tokens(control)
    if user:
        backend.add_tokens(user)


def _token(tokens: list[str], token_id) -> str | None:
    if isinstance(token_id, int) and not isinstance(token_id, bool) and 0 <= token_id < len(tokens):
        return tokens[token_id]
    return None


def _options(reader, backend: BackendTokenizer, tokens: list[str], kind: str, source: str) -> dict:
    """Tokenizer's keyword arguments: special tokens, end-of-generation ids, add-BOS rule and chat template."""
    bos = _token(tokens, field(reader, "tokenizer.ggml.bos_token_id"))
    eos = _token(tokens, field(reader, "tokenizer.ggml.eos_token_id"))
    # llama.cpp stops at EOS and at the end-of-turn / end-of-message tokens (Llama 3's <|eot_id|>, <|eom_id|>)
    stop_ids = [field(reader, f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom")]
    stop_ids = [i for i in stop_ids if _token(tokens, i) is not None]
    # SentencePiece files without the flag get a BOS (llama.cpp's and transformers' rule); byte-level ones do not
    add_bos = bool(field(reader, "tokenizer.ggml.add_bos_token", kind == "llama"))
    bos_id = backend.token_to_id(bos) if bos else None
    if add_bos and bos_id is not None:  # so a plain backend.encode agrees with Tokenizer.encode
        backend.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                               special_tokens=[(bos, bos_id)])
    template = field(reader, "tokenizer.chat_template")
    return dict(
        source=source, bos_token=bos, eos_token=eos,
        unk_token=_token(tokens, field(reader, "tokenizer.ggml.unknown_token_id")),
        pad_token=_token(tokens, field(reader, "tokenizer.ggml.padding_token_id")),
        eos_token_ids=stop_ids, add_bos_default=add_bos,
        chat_template=template if isinstance(template, str) and template.strip() else None,
        chat_template_origin=f"{source} (tokenizer.chat_template)",
    )
