"""The GGUF reader (core/runtime/gguf.py) on tiny files written here in tmp_path, fast enough to run per mutant:
every tensor type's dequantization against an independent decoder of its block layout (ggml_reference.py), the
Q/K row permutation, the checkpoint's lookups and errors, packed reading and packed blocks, the offload engine's
block reader. The real model's end-to-end checks are in test_gguf.py and test_gguf_packed.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf", reason="the gguf package (a test dependency) is not installed")

from gguf import GGMLQuantizationType as QT  # noqa: E402

from hivekeeper.core.runtime import gguf as reader  # noqa: E402
from hivekeeper.core.runtime.gguf import (PACKED_ENV, GGUFBlockReader, GGUFCheckpoint, dequantize,  # noqa: E402
                                          load_gguf_config, load_packed_block, packed_by_default,
                                          packed_linear, unpermute_qk)
from hivekeeper.core.runtime.block_tensors import expected_block_shapes  # noqa: E402
from hivekeeper.core.runtime.kernels.quant_kernels import QuantizedLinear  # noqa: E402
from hivekeeper.core.runtime.model import Block, RotaryTable  # noqa: E402
from hivekeeper.planner.errors import InputError  # noqa: E402
from hivekeeper.planner.gguf_metadata import gguf_sizes, open_reader  # noqa: E402

from . import ggml_reference  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

HIDDEN, FFN, HEADS, KV_HEADS = 64, 128, 4, 2  # head_dim 16: q [64, 64], k and v [32, 64]
BLOCK_TYPES = list(ggml_reference.LAYOUTS)


def write(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, QT]], layers: int = 1, **sizes) -> Path:
    """A GGUF file without a tokenizer: `tensors` maps GGUF names to (F32 values, or block bytes of the type);
    `sizes` overrides metadata (None leaves a key out)."""
    writer = gguf.GGUFWriter(str(path), arch)
    meta = {"block_count": layers, "embedding_length": HIDDEN, "feed_forward_length": FFN,
            "attention.head_count": HEADS, "attention.head_count_kv": KV_HEADS, "context_length": 128, **sizes}
    for key, value in meta.items():
        if value is not None:
            writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    if "token_embd.weight" not in tensors:
        writer.add_tensor("token_embd.weight", np.zeros((96, HIDDEN), np.float32))
    for name, (array, kind) in tensors.items():
        if kind == QT.F32:
            writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
        else:
            writer.add_tensor(name, np.ascontiguousarray(array), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def llama_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter (LlamaModel.permute): each head's rows from half-split to interleaved pairs."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def layer_tensors(kinds: dict[str, QT], arch: str = "llama", seed: int = 0, biases: bool = False) -> dict:
    """Layer 0's tensors: each linear (GGUF short name -> type) as random blocks of that type (or F32 values),
    norms in F32; returns GGUF name -> (array, type) and, under "_hf", the weights in Hugging Face order."""
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (HIDDEN // 2, HIDDEN), "attn_v": (HIDDEN // 2, HIDDEN),
              "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN),
              "ffn_down": (HIDDEN, FFN)}
    rng = np.random.default_rng(seed)
    out, hf = {}, {}
    for index, (short, shape) in enumerate(shapes.items()):
        kind = kinds.get(short, QT.F32)
        if kind == QT.F32:
            values = rng.normal(0, 0.2, shape).astype(np.float32)
            stored = values
        else:
            stored = ggml_reference.random_blocks(kind.name, *shape, seed=seed * 10 + index)
            values = ggml_reference.decode(kind.name, stored, shape).astype(np.float32)
        permuted = arch in ("llama", "mistral") and short in ("attn_q", "attn_k")
        if permuted:  # the file holds the converter's row order; Hugging Face's is the values
            heads = HEADS if short == "attn_q" else KV_HEADS
            stored = llama_permute(stored, heads)
        out[f"blk.0.{short}.weight"] = (stored, kind)
        hf[short] = values
    for norm in ("attn_norm", "ffn_norm"):
        out[f"blk.0.{norm}.weight"] = (rng.normal(1, 0.1, HIDDEN).astype(np.float32), QT.F32)
    if biases:
        for short in ("attn_q", "attn_k", "attn_v"):
            bias = rng.normal(0, 0.1, shapes[short][0]).astype(np.float32)
            out[f"blk.0.{short}.bias"] = (bias, QT.F32)
            hf[f"{short}.bias"] = bias
    return {**out, "_hf": hf}


def layer_file(tmp_path: Path, kinds: dict[str, QT], arch: str = "llama", sizes: dict | None = None,
               **kwargs) -> tuple[Path, dict]:
    tensors = layer_tensors(kinds, arch, **kwargs)
    hf = tensors.pop("_hf")
    return write(tmp_path / f"{arch}.gguf", arch, tensors, **(sizes or {})), hf


# ---------------------------------------------------------------------------------------------------------------
# Every tensor type, against the block layout's definition
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", BLOCK_TYPES)
def test_every_block_type_dequantizes_as_its_layout_says(tmp_path, kind):
    """Random block bytes (every quant bit, scales of both signs) read back as the format's definition decodes
    them, in float32 and torch order ([outs, cols], rows not mixed up)."""
    per_block = ggml_reference.LAYOUTS[kind][0]
    rows, cols = 3, 2 * per_block
    raw = ggml_reference.random_blocks(kind, rows, cols, seed=7)
    path = write(tmp_path / "m.gguf", "qwen2", {"blk.0.ffn_down.weight": (raw, QT[kind])})
    checkpoint = GGUFCheckpoint(path)
    got = checkpoint.read("model.layers.0.mlp.down_proj.weight")
    assert got.dtype == torch.float32 and tuple(got.shape) == (rows, cols)
    expected = ggml_reference.decode(kind, raw, (rows, cols))
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-6, atol=0)
    assert checkpoint.tensor_type("model.layers.0.mlp.down_proj.weight") == kind
    assert checkpoint.stored_bytes("model.layers.0.mlp.down_proj.weight") == raw.nbytes


@pytest.mark.parametrize("kind", [QT.F32, QT.F16])
def test_float_tensors_read_as_stored(tmp_path, kind):
    values = np.random.default_rng(3).normal(0, 1, (5, 32)).astype(np.float32)
    stored = values.astype(np.float16) if kind == QT.F16 else values
    writer_input = stored if kind == QT.F32 else stored.view(np.uint8)
    path = write(tmp_path / "m.gguf", "qwen2", {"blk.0.ffn_down.weight": (writer_input, kind)})
    got = GGUFCheckpoint(path).read("model.layers.0.mlp.down_proj.weight")
    assert got.dtype == torch.float32 and tuple(got.shape) == (5, 32)
    assert np.array_equal(got.numpy(), stored.astype(np.float32))


def test_a_read_tensor_is_a_writable_copy_of_the_file(tmp_path):
    """The memory map stays the file's: changing what `read` returned changes no later read."""
    values = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    path = write(tmp_path / "m.gguf", "qwen2", {"blk.0.ffn_down.weight": (values, QT.F32)})
    checkpoint = GGUFCheckpoint(path)
    first = checkpoint.read("model.layers.0.mlp.down_proj.weight")
    first.zero_()
    assert np.array_equal(checkpoint.read("model.layers.0.mlp.down_proj.weight").numpy(), values)


def test_dequantize_refuses_a_type_it_does_not_know(tmp_path):
    """A Q2_K tensor handed to `dequantize` directly (the checkpoint refuses the file before): InputError naming
    the file, the tensor and the type."""
    path = tmp_path / "q2k.gguf"
    write(path, "qwen2", {"blk.0.ffn_up.weight": (np.zeros((4, 84), np.uint8), QT.Q2_K)})
    tensor = next(t for t in open_reader(path).tensors if t.name == "blk.0.ffn_up.weight")
    with pytest.raises(InputError) as error:
        dequantize(tensor, str(path))
    assert str(path) in str(error.value) and "Q2_K" in str(error.value)


# ---------------------------------------------------------------------------------------------------------------
# The Q/K permutation
# ---------------------------------------------------------------------------------------------------------------
def test_unpermute_puts_interleaved_rows_back_in_half_split_order():
    """One head of 4 rows: the converter stores HF rows (0, 1 | 2, 3) as the pairs (0, 2), (1, 3)."""
    stored = torch.tensor([0, 2, 1, 3])
    assert unpermute_qk(stored, 1).tolist() == [0, 1, 2, 3]
    # two heads of 8 rows, with columns: each head on its own, columns untouched
    hf = np.arange(16 * 3).reshape(16, 3)
    assert np.array_equal(unpermute_qk(torch.from_numpy(llama_permute(hf, 2)), 2).numpy(), hf)
    assert not np.array_equal(llama_permute(hf, 2), hf)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_q_and_k_come_back_in_hugging_face_order(tmp_path, arch):
    """llama: q rows unpermuted by the head count, k by the KV head count, v as stored; qwen2: nothing permuted."""
    path, hf = layer_file(tmp_path, {}, arch)
    checkpoint = GGUFCheckpoint(path)
    for short, name in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj")):
        got = checkpoint.read(f"model.layers.0.self_attn.{name}.weight")
        assert np.array_equal(got.numpy(), hf[short]), short
    heads = {name: checkpoint.permuted_heads(f"model.layers.0.self_attn.{name}.weight")
             for name in ("q_proj", "k_proj", "v_proj", "o_proj")}
    assert heads == ({"q_proj": HEADS, "k_proj": KV_HEADS, "v_proj": 0, "o_proj": 0} if arch == "llama"
                     else dict.fromkeys(heads, 0))


# ---------------------------------------------------------------------------------------------------------------
# Lookups and errors
# ---------------------------------------------------------------------------------------------------------------
def test_lookups_name_the_file_and_the_missing_tensor(tmp_path):
    path, _ = layer_file(tmp_path, {"ffn_up": QT.Q8_0})
    checkpoint = GGUFCheckpoint(path)
    name = "model.layers.0.mlp.up_proj.weight"
    assert checkpoint.has(name) and not checkpoint.has("model.layers.1.mlp.up_proj.weight")
    assert checkpoint.files_for([name, "model.embed_tokens.weight"]) == [path.name]
    assert checkpoint.files_for([]) == []
    assert checkpoint.weight_map[name] == path.name
    assert checkpoint.stored_bytes(name) == FFN * HIDDEN // 32 * 34
    for call in (checkpoint.tensor_type, checkpoint.stored_bytes, checkpoint.read, checkpoint.packable,
                 lambda n: checkpoint.files_for([name, n])):
        with pytest.raises(InputError) as error:
            call("model.layers.3.mlp.up_proj.weight")
        message = str(error.value)
        assert str(path) in message and "'model.layers.3.mlp.up_proj.weight'" in message and "\n" not in message


def test_read_checks_the_shape_and_converts_the_dtype(tmp_path):
    path, hf = layer_file(tmp_path, {}, "qwen2")
    checkpoint = GGUFCheckpoint(path)
    name = "model.layers.0.mlp.down_proj.weight"
    with pytest.raises(InputError) as error:
        checkpoint.read(name, shape=(FFN, HIDDEN))
    assert all(word in str(error.value) for word in (str(path), "'blk.0.ffn_down.weight'", f"({HIDDEN}, {FFN})",
                                                     f"expected ({FFN}, {HIDDEN})"))
    assert checkpoint.read(name, shape=(HIDDEN, FFN)).shape == (HIDDEN, FFN)
    half = checkpoint.read(name, torch.bfloat16)
    assert half.dtype == torch.bfloat16
    assert torch.equal(half, torch.from_numpy(hf["ffn_down"]).to(torch.bfloat16))


def test_load_gguf_config_reads_the_sizes(tmp_path):
    path, _ = layer_file(tmp_path, {}, "qwen2")
    config = load_gguf_config(path)
    assert (config.num_layers, config.hidden_size, config.intermediate_size, config.num_heads,
            config.num_kv_heads, config.vocab_size) == (1, HIDDEN, FFN, HEADS, KV_HEADS, 96)
    assert config.family == "qwen2" and config.qkv_bias
    assert GGUFCheckpoint(path).config == config


@pytest.mark.parametrize(("arch", "sizes", "words"), [
    ("falcon", {}, ("'falcon'", "not supported")),
    ("llama", {"feed_forward_length": None}, ("no llama.feed_forward_length",)),
    ("llama", {"attention.head_count": HIDDEN, "attention.head_count_kv": HIDDEN}, ("head_dim 1", "even"))],
    ids=["architecture", "missing-size", "odd-head-dim"])
def test_config_errors_name_the_file(tmp_path, arch, sizes, words):
    path = write(tmp_path / "bad.gguf", arch, {}, **sizes)
    for load in (load_gguf_config, GGUFCheckpoint):
        with pytest.raises(InputError) as error:
            load(path)
        message = str(error.value)
        assert message.startswith(f"{path}:") and "\n" not in message and all(w in message for w in words), message


@pytest.mark.parametrize(("value", "packed"), [("0", False), ("1", True), ("off", False), ("False", False),
                                              ("NO", False), ("yes", True), (None, True)])
def test_the_variable_turns_packed_blocks_on_and_off(monkeypatch, value, packed):
    """Packed unless the variable says 0, off, false or no (any case, spaces around)."""
    if value is None:
        monkeypatch.delenv(PACKED_ENV, raising=False)
        assert packed_by_default() is packed
        return
    monkeypatch.setenv(PACKED_ENV, value)
    assert packed_by_default() is packed
    monkeypatch.setenv(PACKED_ENV, f" {value} ")
    assert packed_by_default() is packed


# ---------------------------------------------------------------------------------------------------------------
# Packed reading
# ---------------------------------------------------------------------------------------------------------------
def test_which_types_stay_packed(tmp_path):
    kinds = {"attn_q": QT.Q8_0, "attn_k": QT.Q4_0, "attn_v": QT.Q4_1, "attn_output": QT.Q5_0, "ffn_gate": QT.Q5_1}
    path, _ = layer_file(tmp_path, kinds)
    checkpoint = GGUFCheckpoint(path)
    packable = {name: checkpoint.packable(f"model.layers.0.{name}.weight")
                for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                             "mlp.gate_proj", "mlp.up_proj")}
    assert packable == {"self_attn.q_proj": True, "self_attn.k_proj": True, "self_attn.v_proj": True,
                        "self_attn.o_proj": False, "mlp.gate_proj": False, "mlp.up_proj": False}


@pytest.mark.parametrize("kind", [QT.Q8_0, QT.Q4_0, QT.Q4_1])
def test_read_packed_keeps_the_blocks_in_hugging_face_row_order(tmp_path, kind):
    """The packed q (permuted in the file) and v (not) stand for exactly the dequantized weights, and are copies
    that own their bytes (the memory map is read-only)."""
    path, hf = layer_file(tmp_path, {"attn_q": kind, "attn_k": kind, "attn_v": kind})
    checkpoint = GGUFCheckpoint(path)
    for short, name, shape in (("attn_q", "q_proj", (HIDDEN, HIDDEN)), ("attn_k", "k_proj", (HIDDEN // 2, HIDDEN)),
                               ("attn_v", "v_proj", (HIDDEN // 2, HIDDEN))):
        matrix = checkpoint.read_packed(f"model.layers.0.self_attn.{name}.weight", shape)
        assert matrix.fmt.ggml_type == int(kind) and (matrix.outs, matrix.cols) == shape
        assert np.array_equal(matrix.dequantize(), hf[short]), short
        assert matrix.packed.flags.owndata and matrix.packed.flags.writeable


def test_packed_linear_fuses_pieces_of_one_packed_type_only(tmp_path):
    kinds = {"attn_q": QT.Q8_0, "attn_k": QT.Q8_0, "attn_v": QT.Q8_0, "attn_output": QT.Q4_0,
             "ffn_gate": QT.Q4_0, "ffn_up": QT.Q4_1, "ffn_down": QT.Q5_0}
    path, hf = layer_file(tmp_path, kinds)
    checkpoint = GGUFCheckpoint(path)
    shapes = expected_block_shapes(checkpoint.config)
    qkv = packed_linear(checkpoint, 0, reader.FUSED_LINEARS["self_attn.qkv_proj"], shapes)
    assert (qkv.outs, qkv.cols) == (2 * HIDDEN, HIDDEN) and qkv.fmt.name == "q8_0"
    assert np.array_equal(qkv.dequantize(), np.concatenate([hf["attn_q"], hf["attn_k"], hf["attn_v"]]))
    single = packed_linear(checkpoint, 0, ("self_attn.o_proj",), shapes)
    assert single.fmt.name == "q4_0" and np.array_equal(single.dequantize(), hf["attn_output"])
    assert packed_linear(checkpoint, 0, ("mlp.gate_proj", "mlp.up_proj"), shapes) is None  # two packed types
    assert packed_linear(checkpoint, 0, ("mlp.down_proj",), shapes) is None  # Q5_0: not packable


# ---------------------------------------------------------------------------------------------------------------
# Packed blocks and the engine's block reader
# ---------------------------------------------------------------------------------------------------------------
def reference_block(checkpoint: GGUFCheckpoint, layer: int = 0) -> Block:
    """The layer dequantized to fp32, as the offload engine's reader fills a block."""
    block = Block(checkpoint.config, layer)
    block.load_state_dict(checkpoint.read_block(layer, torch.float32), strict=True)
    return block.requires_grad_(False)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_packed_block_computes_what_the_dequantized_block_does(tmp_path, arch):
    """Packed Q8_0 q/k/v (fused), Q4_0 o, Q4_1 gate/up, and an F32 down that stays a plain linear; qwen2's q/k/v
    biases fused into the packed layer. The block's output is the dequantized block's within the kernels'
    activation rounding, and the packed weights are exactly the file's."""
    kinds = {"attn_q": QT.Q8_0, "attn_k": QT.Q8_0, "attn_v": QT.Q8_0, "attn_output": QT.Q4_0,
             "ffn_gate": QT.Q4_1, "ffn_up": QT.Q4_1}
    path, hf = layer_file(tmp_path, kinds, arch, biases=arch == "qwen2")
    checkpoint = GGUFCheckpoint(path)
    rotary = RotaryTable(checkpoint.config)
    block = load_packed_block(checkpoint, 0, rotary)
    assert block.rotary is rotary and block.layer_index == 0  # the span's shared table
    attn, mlp = block.self_attn, block.mlp
    assert isinstance(attn.qkv_proj, QuantizedLinear) and isinstance(attn.o_proj, QuantizedLinear)
    assert isinstance(mlp.gate_up_proj, QuantizedLinear) and not isinstance(mlp.down_proj, QuantizedLinear)
    assert np.array_equal(attn.qkv_proj.matrix.dequantize(),
                          np.concatenate([hf["attn_q"], hf["attn_k"], hf["attn_v"]]))
    assert np.array_equal(mlp.gate_up_proj.matrix.dequantize(), np.concatenate([hf["ffn_gate"], hf["ffn_up"]]))
    if arch == "qwen2":
        assert np.array_equal(attn.qkv_proj.bias.numpy(),
                              np.concatenate([hf["attn_q.bias"], hf["attn_k.bias"], hf["attn_v.bias"]]))
    else:
        assert attn.qkv_proj.bias is None
    assert not any(p.requires_grad for p in block.parameters())
    hidden = torch.from_numpy(np.random.default_rng(5).normal(0, 1, (1, 3, HIDDEN)).astype(np.float32))
    with torch.inference_mode():
        expected, got = reference_block(checkpoint)(hidden), block(hidden)
    expected, got = (t[0] if isinstance(t, tuple) else t for t in (expected, got))
    assert (got - expected).abs().max() <= 0.02 * expected.abs().max()


def test_a_packed_block_needs_every_tensor(tmp_path):
    tensors = layer_tensors({"attn_q": QT.Q8_0})
    tensors.pop("_hf")
    del tensors["blk.0.ffn_norm.weight"]
    path = write(tmp_path / "m.gguf", "llama", tensors)
    with pytest.raises(InputError) as error:
        load_packed_block(GGUFCheckpoint(path), 0)
    assert "post_attention_layernorm" in str(error.value) and str(path) in str(error.value)
    with pytest.raises(InputError):
        GGUFBlockReader(GGUFCheckpoint(path)).check_layer(0)


def test_the_block_reader_fills_a_block_and_counts_the_stored_bytes(tmp_path):
    kinds = {"attn_q": QT.Q5_1, "ffn_up": QT.Q8_0}
    tensors = layer_tensors(kinds, "qwen2", biases=True)
    tensors.pop("_hf")
    second = {name.replace("blk.0.", "blk.1."): value
              for name, value in layer_tensors({}, "qwen2", seed=1, biases=True).items() if name != "_hf"}
    path = write(tmp_path / "m.gguf", "qwen2", {**tensors, **second}, layers=2)
    checkpoint = GGUFCheckpoint(path)
    block_reader = GGUFBlockReader(checkpoint)
    block_reader.check_layer(1)
    block = Block(checkpoint.config, 0)
    block.self_attn.window = 5
    stored = block_reader.fill(block, 1)
    prefix = "model.layers.1."
    names = [name for name in checkpoint.tensors if name.startswith(prefix)]
    assert stored == sum(checkpoint.stored_bytes(name) for name in names) == 4 * sum(
        int(np.prod(shape)) for shape in (t[0].shape for t in second.values()))
    assert block.layer_index == 1 and block.self_attn.window == checkpoint.config.window_of(1)
    assert torch.equal(block.input_layernorm.weight, checkpoint.read(prefix + "input_layernorm.weight"))
    first = block_reader.fill(block, 0)
    assert first < stored  # layer 0 holds two quantized tensors
    assert block_reader.bytes_read == stored + first
    reference = reference_block(checkpoint, 0)
    for (name, value), (_, expected) in zip(block.state_dict().items(), reference.state_dict().items()):
        assert torch.equal(value, expected), name


def test_a_sliding_window_reaches_filled_and_packed_blocks(tmp_path):
    """A Mistral file with a 16-token window (q/k permuted as for llama): the engine's reader sets the window of
    the layer it fills, a packed block is built with it."""
    path, hf = layer_file(tmp_path, {"attn_q": QT.Q8_0, "attn_k": QT.Q8_0, "attn_v": QT.Q8_0}, "mistral",
                          sizes={"attention.sliding_window": 16})
    checkpoint = GGUFCheckpoint(path)
    assert checkpoint.config.window_of(0) == 16
    assert np.array_equal(checkpoint.read("model.layers.0.self_attn.k_proj.weight").numpy(), hf["attn_k"])
    block = Block(checkpoint.config, 0)
    block.self_attn.window = None
    GGUFBlockReader(checkpoint).fill(block, 0)
    assert block.self_attn.window == 16
    assert load_packed_block(checkpoint, 0).self_attn.window == 16


def test_a_file_without_a_tokenizer_says_so(tmp_path):
    path, _ = layer_file(tmp_path, {})
    with pytest.raises(InputError) as error:
        GGUFCheckpoint(path).tokenizer()
    assert str(path) in str(error.value) and "no tokenizer" in str(error.value)


def held_bytes(module: torch.nn.Module) -> int:
    """Bytes of the distinct storages behind a module's parameters and buffers."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in list(module.parameters()) + list(module.buffers())}
    return sum(storages.values())


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_packed_block_bytes_are_what_a_packed_block_holds(tmp_path, arch):
    """What the planner is told a packed block takes: the packed linears' stored bytes, fp32 for the rest
    (a linear of another type, two pieces of one fused linear in different packed types, which the loader
    dequantizes, norms, biases): the one count (gguf_sizes) that local and swarm plans read."""
    kinds = {"attn_q": QT.Q8_0, "attn_k": QT.Q8_0, "attn_v": QT.Q8_0, "attn_output": QT.Q5_0,
             "ffn_gate": QT.Q4_0, "ffn_up": QT.Q4_1, "ffn_down": QT.Q4_0}
    path, _ = layer_file(tmp_path, kinds, arch, biases=arch == "qwen2")
    checkpoint = GGUFCheckpoint(path)
    expected = (HIDDEN * 2 * HIDDEN // 32 * 34 + HIDDEN * FFN // 32 * 18  # q/k/v Q8_0, down Q4_0
                + 4 * (HIDDEN * HIDDEN + 2 * FFN * HIDDEN + 2 * HIDDEN)  # o, gate, up (dequantized), two norms
                + (4 * 2 * HIDDEN if arch == "qwen2" else 0))  # q/k/v biases
    assert held_bytes(load_packed_block(checkpoint, 0)) == expected
    assert gguf_sizes(path).packed_block_bytes == (expected,)  # the planner's count is the same one (issue 16)


@pytest.mark.parametrize(("tensor", "kind"), [("blk.0.ffn_norm.weight", QT.F32), ("blk.0.attn_output.weight", QT.F32),
                                              ("blk.0.attn_output.weight", QT.Q8_0), ("blk.0.attn_k.bias", QT.F32)])
def test_a_packed_block_names_a_tensor_of_the_wrong_shape(tmp_path, tensor, kind):
    """A norm, a plain linear, a packed linear or a bias of another shape than the config says: InputError naming
    the file and the tensor, before the block is built."""
    tensors = layer_tensors({"attn_q": QT.Q8_0, "attn_k": QT.Q8_0, "attn_v": QT.Q8_0,
                             "attn_output": kind}, "qwen2", biases=True)
    tensors.pop("_hf")
    array, _ = tensors[tensor]
    tensors[tensor] = (array[: array.shape[0] // 2], kind)  # half the rows
    path = write(tmp_path / "m.gguf", "qwen2", tensors)
    with pytest.raises(InputError) as error:
        load_packed_block(GGUFCheckpoint(path), 0)
    message = str(error.value)
    assert str(path) in message and f"'{tensor}'" in message and "\n" not in message, message


def test_read_block_reads_in_the_dtype_asked(tmp_path):
    path, hf = layer_file(tmp_path, {"ffn_up": QT.Q4_0}, "qwen2", biases=True)
    tensors = GGUFCheckpoint(path).read_block(0, torch.bfloat16)
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert torch.equal(tensors["mlp.up_proj.weight"], torch.from_numpy(hf["ffn_up"]).to(torch.bfloat16))
    assert torch.equal(tensors["self_attn.k_proj.bias"], torch.from_numpy(hf["attn_k.bias"]).to(torch.bfloat16))


def test_a_checkpoint_is_packed_only_when_asked(tmp_path):
    path, _ = layer_file(tmp_path, {})
    assert GGUFCheckpoint(path).packed is False
    assert GGUFCheckpoint(path, packed=True).packed is True and GGUFCheckpoint(path, packed=1).packed is True


def test_load_packed_head_takes_a_packable_matrix_only(tmp_path):
    """The LM head's Q8_0 bytes as a QuantizedLinear after the final norm (tied: the given weight kept for
    lookups); None for a matrix stored in another type."""
    from hivekeeper.core.runtime.gguf import PackedHead, load_packed_head

    path, hf = layer_file(tmp_path, {"ffn_up": QT.Q8_0, "ffn_down": QT.Q5_0})
    checkpoint = GGUFCheckpoint(path)
    norm = torch.linspace(0.5, 1.5, HIDDEN)
    tied = torch.nn.Parameter(torch.zeros(3), requires_grad=False)
    assert load_packed_head(checkpoint, "model.layers.0.mlp.down_proj.weight", norm, None) is None
    # a [FFN, HIDDEN] matrix read as if it were the head: vocabulary FFN is what the config's head would need
    checkpoint.config = dataclasses.replace(checkpoint.config, vocab_size=FFN)
    head = load_packed_head(checkpoint, "model.layers.0.mlp.up_proj.weight", norm, tied)
    assert isinstance(head, PackedHead) and head.weight is tied and torch.equal(head.norm.weight, norm)
    assert np.array_equal(head.lm_head.matrix.dequantize(), hf["ffn_up"])
    assert not any(p.requires_grad for p in head.parameters())
    hidden = torch.randn(1, 2, HIDDEN, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        got = head(hidden)
        normed = head.norm(hidden)
    expected = normed.double() @ torch.from_numpy(hf["ffn_up"]).double().T
    assert got.shape == (1, 2, FFN) and (got.double() - expected).abs().max() <= 0.01 * expected.abs().max()
