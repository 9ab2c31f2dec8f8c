"""open_reader's fast GGUF reader (planner/gguf_metadata.py) against the gguf package's own GGUFReader, on small
files written here: every metadata field (a vocabulary of a few thousand tokens, merges, scores, token types, every
scalar type, bool, string and nested arrays), every tensor (Q8_0, Q4_0, Q4_1, F16, F32) and the header read the
same, in both byte orders; broken files give the one InputError naming the file. No timing is asserted (speed is a
benchmark figure, see the module docstring)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="the gguf package (a test dependency) is not installed")

from gguf import GGMLQuantizationType as QT  # noqa: E402
from gguf import GGUFEndian, GGUFValueType  # noqa: E402

from hivekeeper.planner.errors import InputError  # noqa: E402
from hivekeeper.planner.gguf_metadata import open_reader  # noqa: E402

VOCAB = 3000
TENSOR_TYPES = (QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.F16, QT.F32)


def vocabulary(rng: np.random.Generator) -> list[str]:
    """Tokens of 0 to 12 characters, ASCII and multi-byte UTF-8 (GPT-2's byte alphabet, CJK, emoji) mixed."""
    alphabet = list("abcdefghijklmnopqrstuvwxyz ĠĊ<>|") + ["é", "ß", "中", "文", "🙂", "\u0100"]
    tokens = ["".join(rng.choice(alphabet, size=rng.integers(0, 13))) for _ in range(VOCAB)]
    return [f"{i}{token}" if i % 7 else token for i, token in enumerate(tokens)]  # duplicates and "" kept


def write_file(path: Path, endianess: GGUFEndian = GGUFEndian.LITTLE) -> Path:
    """A llama-shaped GGUF holding every kind of metadata value and a tensor of each type in TENSOR_TYPES."""
    rng = np.random.default_rng(7)
    writer = gguf.GGUFWriter(str(path), "llama", endianess=endianess)
    tokens = vocabulary(rng)
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.merges", [f"{a} {b}" for a, b in zip(tokens[:-1], tokens[1:])])
    writer.add_array("tokenizer.ggml.scores", rng.standard_normal(VOCAB).astype(np.float32).tolist())
    writer.add_array("tokenizer.ggml.token_type", rng.integers(1, 7, VOCAB).tolist())
    writer.add_string("tokenizer.chat_template", "{% for m in messages %}{{ m['content'] }}{% endfor %} — ✓")
    for kind in (GGUFValueType.UINT8, GGUFValueType.INT8, GGUFValueType.UINT16, GGUFValueType.INT16,
                 GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.UINT64, GGUFValueType.INT64):
        writer.add_key_value(f"test.{kind.name.lower()}", 100, kind)
        writer.add_key_value(f"test.{kind.name.lower()}_array", [0, 1, 2, 127], GGUFValueType.ARRAY, sub_type=kind)
    writer.add_float32("test.float32", 1e-5)
    writer.add_float64("test.float64", -2.5e300)
    writer.add_key_value("test.float64_array", [0.1, -1e-300, 3.0], GGUFValueType.ARRAY, GGUFValueType.FLOAT64)
    writer.add_bool("test.bool", True)
    writer.add_array("test.bool_array", [True, False, False, True])
    writer.add_array("test.nested_ints", [[1, 2, 3], [4], [5, 6]])
    writer.add_array("test.nested_strings", [["a", "bé"], ["🙂"]])
    writer.add_array("test.one_string", ["only"])
    for index, kind in enumerate(TENSOR_TYPES):
        values = rng.standard_normal((4, 64)).astype(np.float32)
        if kind in (QT.F16, QT.F32):
            floats = values.astype(np.float16) if kind == QT.F16 else values
            writer.add_tensor(f"blk.{index}.attn_q.weight", floats)
        else:
            writer.add_tensor(f"blk.{index}.attn_q.weight", gguf.quants.quantize(values, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def same_parts(ours: list, theirs: list) -> bool:
    """Equal lists of numpy views: same dtypes (byte order included), shapes and values."""
    return len(ours) == len(theirs) and all(
        a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b) for a, b in zip(ours, theirs))


@pytest.fixture(scope="module", params=[GGUFEndian.LITTLE, GGUFEndian.BIG], ids=["little", "big"])
def both_readers(request, tmp_path_factory):
    path = write_file(tmp_path_factory.mktemp("gguf") / "model.gguf", request.param)
    return open_reader(path), gguf.GGUFReader(path), path


def test_every_field_reads_what_gguf_reader_reads(both_readers):
    ours, theirs, _ = both_readers
    assert isinstance(ours, gguf.GGUFReader)
    assert list(ours.fields) == list(theirs.fields) and len(ours.fields) > 30
    for key, expected in theirs.fields.items():
        field = ours.get_field(key)
        assert isinstance(field, gguf.ReaderField), key
        assert (field.offset, field.name, field.types) == (expected.offset, expected.name, expected.types), key
        assert field.contents() == expected.contents(), key
        if expected.types[0] == GGUFValueType.ARRAY:
            for index in (0, -1, slice(2, None), slice(None, None, -3)):
                assert field.contents(index) == expected.contents(index), (key, index)
        assert field.data == expected.data, key
        assert same_parts(field.parts, expected.parts), key
    assert len(ours.get_field("tokenizer.ggml.tokens").contents()) == VOCAB
    assert ours.get_field("test.nested_ints").contents() == [1, 2, 3, 4, 5, 6]  # GGUFReader flattens nested arrays


def test_every_tensor_reads_what_gguf_reader_reads(both_readers):
    ours, theirs, _ = both_readers
    assert (ours.data_offset, ours.alignment, ours.byte_order) == (theirs.data_offset, theirs.alignment,
                                                                    theirs.byte_order)
    assert [t.tensor_type for t in ours.tensors] == list(TENSOR_TYPES)
    for mine, expected in zip(ours.tensors, theirs.tensors, strict=True):
        assert (mine.name, mine.tensor_type, mine.n_elements, mine.n_bytes, mine.data_offset) == \
            (expected.name, expected.tensor_type, expected.n_elements, expected.n_bytes, expected.data_offset)
        assert np.array_equal(mine.shape, expected.shape)
        assert mine.data.dtype == expected.data.dtype and np.array_equal(mine.data, expected.data), mine.name
        assert same_parts(mine.field.parts, expected.field.parts) and mine.field.data == expected.field.data


@pytest.fixture(scope="module")
def file_bytes(tmp_path_factory) -> bytes:
    """The little-endian file's bytes, for tests that damage a copy."""
    return write_file(tmp_path_factory.mktemp("gguf") / "model.gguf").read_bytes()


@pytest.mark.parametrize("byte", [0xFF, 0x80], ids=["ff", "lone-continuation"])
def test_a_bad_string_fails_where_gguf_reader_fails(tmp_path, file_bytes, byte):
    path, data = tmp_path / "model.gguf", bytearray(file_bytes)
    data[data.index("中".encode())] = byte  # not UTF-8: the file opens, decoding the tokens fails
    path.write_bytes(bytes(data))
    with pytest.raises(UnicodeDecodeError):
        gguf.GGUFReader(path).get_field("tokenizer.ggml.tokens").contents()
    with pytest.raises(UnicodeDecodeError):
        open_reader(path).get_field("tokenizer.ggml.tokens").contents()


def array_count_offset(data: bytes, key: str) -> int:
    """Where the element count of the array under `key` lies (after the key, its type and the item type)."""
    return data.index(key.encode()) + len(key) + 8


@pytest.mark.parametrize("damage", ["cut in the tokens", "cut in the scores", "huge token count",
                                    "huge score count", "unknown item type"])
def test_a_broken_file_gives_one_input_error_naming_it(tmp_path, file_bytes, damage):
    path, data = tmp_path / "model.gguf", bytearray(file_bytes)
    tokens = array_count_offset(data, "tokenizer.ggml.tokens")
    scores = array_count_offset(data, "tokenizer.ggml.scores")
    count = tokens if "token" in damage else scores
    if damage.startswith("cut"):
        data = data[:count + 5000]
    elif damage.startswith("huge"):
        data[count:count + 8] = (2**40).to_bytes(8, "little")
    else:
        data[scores - 4:scores] = (99).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(InputError) as error:
        open_reader(path)
    message = str(error.value)
    assert "\n" not in message and message.startswith(str(path)) and "corrupt or truncated" in message, message
