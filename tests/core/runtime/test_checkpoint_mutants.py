"""Checkpoint loading (core/runtime/checkpoint.py) where mutation runs found it untested: when a GGUF block loads
packed (CPU, fp32, no bitsandbytes quantization) and when it does not, the span's packed switch, the config of either
format, the block range and device checks at their limits, and the dtype quantized blocks compute in. Tiny GGUF
files are written here (test_gguf_reader.py's writer); fast enough to run per mutant."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("gguf", reason="the gguf package (a test dependency) is not installed")

from gguf import GGMLQuantizationType as QT  # noqa: E402

from hivekeeper.core.runtime.checkpoint import (check_device, load_block, load_config, load_span,  # noqa: E402
                                                open_checkpoint, parse_dtype, quant_compute_dtype)
from hivekeeper.core.runtime.gguf import PACKED_ENV, GGUFCheckpoint  # noqa: E402
from hivekeeper.core.runtime.kernels.quant_kernels import QuantizedLinear  # noqa: E402
from hivekeeper.planner.errors import InputError  # noqa: E402

from .test_gguf_reader import FFN, HIDDEN, layer_file  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PACKABLE = {"attn_q": QT.Q8_0, "attn_k": QT.Q8_0, "attn_v": QT.Q8_0, "attn_output": QT.Q4_0, "ffn_gate": QT.Q4_1,
            "ffn_up": QT.Q4_1, "ffn_down": QT.Q8_0}


def packed_layers(module: torch.nn.Module) -> int:
    return sum(isinstance(m, QuantizedLinear) for m in module.modules())


@pytest.fixture(params=["0", "portable"])
def decode_path(request, monkeypatch):
    """Decode through numpy ("0": HIVEKEEPER_NATIVE=0) or the native kernels (their portable build), whatever this
    machine has: the layout the runtime stores tall fp32 matrices in follows it (cpu_matmul.tall_by_column)."""
    from hivekeeper.core.runtime.kernels import native_kernels

    monkeypatch.setenv(native_kernels.VARIANT_ENV, request.param)
    native_kernels.forget()
    if request.param != "0" and native_kernels.library() is None:
        pytest.skip(f"the native kernels cannot be built here: {native_kernels.status()}")
    yield request.param
    monkeypatch.undo()
    native_kernels.forget()  # the suite's build again after the test


@pytest.fixture
def gguf_file(tmp_path):
    return layer_file(tmp_path, PACKABLE)[0]


def test_a_gguf_block_loads_packed_only_on_the_cpu_in_fp32_without_quant(gguf_file):
    packed = open_checkpoint(gguf_file, packed=True)
    assert isinstance(packed, GGUFCheckpoint) and packed.packed
    block = load_block(packed, 0)
    assert packed_layers(block) == 4  # qkv, o, gate_up, down
    assert not any(p.requires_grad for p in block.parameters())
    assert packed_layers(load_block(packed, 0, dtype=torch.bfloat16)) == 0
    assert load_block(packed, 0, dtype="bf16").input_layernorm.weight.dtype == torch.bfloat16
    assert packed_layers(load_block(open_checkpoint(gguf_file), 0)) == 0  # packed=False: dequantized
    assert not open_checkpoint(gguf_file).packed


@pytest.mark.parametrize(("packed", "env", "expected"), [(True, "0", 4), (False, "1", 0), (None, "0", 0),
                                                         (None, "1", 4)])
def test_the_span_packs_as_asked_or_as_the_variable_says(gguf_file, monkeypatch, packed, env, expected):
    monkeypatch.setenv(PACKED_ENV, env)
    span = load_span(gguf_file, 0, 1, packed=packed)
    assert packed_layers(span) == expected and (span.start, span.end) == (0, 1)


def test_a_bf16_span_of_a_gguf_is_dequantized(gguf_file, monkeypatch):
    monkeypatch.setenv(PACKED_ENV, "1")
    span = load_span(gguf_file, 0, 1, dtype="bf16")
    assert packed_layers(span) == 0 and next(span.parameters()).dtype == torch.bfloat16


@pytest.mark.parametrize(("start", "end"), [(-1, 1), (0, 2), (1, 1), (1, 0), (0.0, 1), (0, True + 0.5)])
def test_a_block_range_outside_the_model_is_named(gguf_file, start, end):
    with pytest.raises(InputError) as error:
        load_span(gguf_file, start, end)
    assert f"[{start}, {end})" in str(error.value) and "1 blocks" in str(error.value)


def test_load_config_of_either_format(gguf_file, tmp_path):
    config = load_config(gguf_file)
    assert (config.num_layers, config.hidden_size, config.intermediate_size) == (1, HIDDEN, FFN)
    assert config == load_config(gguf_file.parent)  # the folder holding it
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(
        '{"model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3, '
        '"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 50, "max_position_embeddings": 32}')
    hf = load_config(folder)
    assert (hf.num_layers, hf.intermediate_size, hf.vocab_size) == (3, 96, 50)


def test_devices_are_checked():
    assert check_device("cpu") == torch.device("cpu") and check_device(torch.device("cpu")).type == "cpu"
    assert check_device("cpu:0") == torch.device("cpu:0")
    with pytest.raises(InputError, match="unknown device 'gpu'"):
        check_device("gpu")
    if not torch.cuda.is_available():
        for name in ("cuda", "cuda:1"):
            with pytest.raises(InputError, match=f"device {name} requested but CUDA is not available"):
                check_device(name)


def test_dtypes_by_name_and_the_dtype_quantized_blocks_compute_in():
    for names, dtype in ((("fp32", "float32", "FP32"), torch.float32), (("bf16", "bfloat16"), torch.bfloat16),
                         (("fp16", "Float16"), torch.float16)):
        assert all(parse_dtype(name) is dtype for name in names)
    assert parse_dtype(torch.float16) is torch.float16
    with pytest.raises(InputError, match="unknown dtype 'int8'; choose fp32, bf16 or fp16"):
        parse_dtype("int8")
    assert quant_compute_dtype(torch.float32, "cpu") is torch.float32  # fp32 norms on a CPU
    assert quant_compute_dtype(torch.float32, "cuda") is torch.float16  # bitsandbytes' 16-bit math on a GPU
    assert quant_compute_dtype(torch.bfloat16, "cuda") is torch.bfloat16
    assert quant_compute_dtype(torch.float16, torch.device("cpu")) is torch.float16


def head_file(tmp_path, rows: int = 160):
    """A GGUF file with an untied F32 LM head of `rows` rows (the vocabulary is the embedding's 160: a tall matrix)."""
    from .test_gguf_reader import layer_tensors, write

    tensors = layer_tensors({})
    tensors.pop("_hf")
    tensors["output_norm.weight"] = (torch.linspace(0.5, 1.5, HIDDEN).numpy(), QT.F32)
    tensors["output.weight"] = (torch.randn(rows, HIDDEN).numpy(), QT.F32)
    tensors["token_embd.weight"] = (torch.zeros(160, HIDDEN).numpy(), QT.F32)
    return write(tmp_path / "head.gguf", "llama", tensors)


def test_an_untied_head_in_the_dtype_asked_and_in_decodes_layout(tmp_path, decode_path):
    """fp32: the tall matrix column-major where decode takes numpy's path (HIVEKEEPER_NATIVE=0: OpenBLAS's gemv reads
    it faster so), row-major where the native kernels decode (theirs read it faster so; cpu_matmul.store_for_decode),
    and as it is when asked not to re-store it; bf16: norm and matrix in bf16."""
    from hivekeeper.core.runtime.checkpoint import load_head

    native = decode_path
    path = head_file(tmp_path)
    head = load_head(path)
    assert head.weight.is_contiguous() == (native != "0") and head.weight.t().is_contiguous() == (native == "0")
    assert head.weight.shape == (160, HIDDEN)
    assert load_head(path, decode_layout=False).weight.is_contiguous()
    half = load_head(path, dtype="bf16")
    assert half.norm.weight.dtype == torch.bfloat16 and half.weight.dtype == torch.bfloat16


def test_an_untied_head_of_another_shape_is_named(tmp_path):
    from hivekeeper.core.runtime.checkpoint import load_head

    path = head_file(tmp_path, rows=80)
    with pytest.raises(InputError) as error:
        load_head(path)
    assert str(path) in str(error.value) and "'output.weight'" in str(error.value) and "(160, 64)" in str(error.value)


def packed_head_file(tmp_path, tied: bool):
    """Q8_0 head bytes: an untied `output.weight`, or (tied) the embedding itself; vocabulary 160."""
    from .test_gguf_reader import layer_tensors, write
    from .ggml_reference import random_blocks

    tensors = layer_tensors({})
    tensors.pop("_hf")
    tensors["output_norm.weight"] = (torch.linspace(0.5, 1.5, HIDDEN).numpy(), QT.F32)
    matrix = random_blocks("Q8_0", 160, HIDDEN, seed=4)
    tensors["token_embd.weight"] = (matrix, QT.Q8_0) if tied else (torch.zeros(160, HIDDEN).numpy(), QT.F32)
    if not tied:
        tensors["output.weight"] = (matrix, QT.Q8_0)
    return write(tmp_path / "packed-head.gguf", "llama", tensors)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_packed_head_computes_what_the_dequantized_head_does(tmp_path, tied):
    """packed=True on the CPU in fp32: the head's matrix stays as the file's Q8_0 bytes (of the LM head, or of the
    tied embedding, whose loaded weight it keeps for lookups) and gives the dequantized head's logits within the
    kernels' activation rounding; packed=False, bf16, or an F32 head: a plain head."""
    from hivekeeper.core.runtime.checkpoint import load_embedding, load_head
    from hivekeeper.core.runtime.gguf import PackedHead

    path = packed_head_file(tmp_path, tied)
    embedding = load_embedding(path) if tied else None
    packed = load_head(path, packed=True, embedding=embedding)
    plain = load_head(path, packed=False, embedding=embedding)
    assert isinstance(packed, PackedHead) and isinstance(packed.lm_head, QuantizedLinear)
    assert not isinstance(plain, PackedHead) and packed.lm_head.matrix.fmt.name == "q8_0"
    assert (packed.weight is embedding.weight) if tied else packed.weight is None
    assert torch.equal(packed.norm.weight, plain.norm.weight)
    hidden = torch.randn(1, 2, HIDDEN, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        got, expected = packed(hidden), plain(hidden)
    assert got.shape == expected.shape == (1, 2, 160)
    assert (got - expected).abs().max() <= 0.01 * expected.abs().max()
    assert not isinstance(load_head(path, packed=True, dtype="bf16", embedding=embedding), PackedHead)
    assert not isinstance(load_head(head_file(tmp_path), packed=True), PackedHead)  # an F32 head


def tall_weights(block: torch.nn.Module) -> list[torch.Tensor]:
    return [m.weight for m in block.modules()
            if isinstance(m, torch.nn.Linear) and m.weight.shape[0] >= 2 * m.weight.shape[1]]


def test_a_span_s_blocks_know_their_layer_share_one_rotary_table_and_store_tall_linears_for_decode(
        tiny_checkpoint, gguf_file, decode_path):
    """What load_span takes from load_block: each block's layer index (its attention window and cache slot follow
    from it), the span's one rotary table rather than a copy per block (packed GGUF blocks too), and on a CPU in
    fp32 the tall linears in decode's layout (re-stored column-major where decode takes numpy's path, row-major for
    the native kernels; bf16 blocks keep them as read), all the span's weights then packed into one buffer."""
    from hivekeeper.core.runtime.model import RotaryTable

    span = load_span(tiny_checkpoint, 0, 2)
    assert [block.layer_index for block in span.blocks] == [0, 1]
    assert span.blocks[0].rotary is span.blocks[1].rotary is span.rotary
    tall = tall_weights(span.blocks[1])
    by_column = decode_path == "0"
    assert tall and all(w.t().is_contiguous() == by_column and w.is_contiguous() != by_column for w in tall)
    half = tall_weights(load_span(tiny_checkpoint, 1, 2, dtype="bf16").blocks[0])
    assert half and all(w.is_contiguous() for w in half)
    assert len({p.untyped_storage().data_ptr() for p in span.parameters()}) == 1  # one buffer, in reading order
    packed = open_checkpoint(gguf_file, packed=True)
    table = RotaryTable(packed.config)
    assert load_block(packed, 0, rotary=table).rotary is table
    assert load_block(open_checkpoint(gguf_file), 0, rotary=table).rotary is table


def test_a_folder_without_safetensors_weights_says_what_it_found(tiny_checkpoint, tmp_path):
    """Only safetensors weights load; the error lists up to three other weight files (.bin first, then .pt*)."""
    import shutil

    folder = tmp_path / "other"
    folder.mkdir()
    shutil.copy(tiny_checkpoint / "config.json", folder)
    with pytest.raises(InputError) as nothing:
        open_checkpoint(folder)
    assert str(nothing.value) == f"{folder}: no model.safetensors or model.safetensors.index.json"
    for name in ("b.bin", "a.bin", "model.pth", "weights.pt"):
        (folder / name).write_bytes(b"")
    with pytest.raises(InputError) as others:
        open_checkpoint(folder)
    assert str(others.value).endswith("(found a.bin, b.bin, model.pth: only safetensors weights are supported)")
