"""The Hugging Face names and shapes of a decoder block's tensors: what every checkpoint format is read into.

A safetensors checkpoint (checkpoint.py) stores these names; a GGUF (gguf.py) is renamed to them. Both loaders, the
offload engine's block readers and the shard selection of hub downloads check a block against these two tables.
"""

from __future__ import annotations

from hivekeeper.core.runtime.model import ModelConfig


def block_tensor_names(config: ModelConfig, layer: int) -> list[str]:
    """The HF names of every tensor of decoder layer `layer`."""
    prefix = f"model.layers.{layer}."
    names = ["input_layernorm.weight", "post_attention_layernorm.weight"]
    names += [f"self_attn.{p}_proj.weight" for p in "qkvo"]
    names += [f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    if config.qkv_bias:
        names += [f"self_attn.{p}_proj.bias" for p in "qkv"]
    if config.o_bias:
        names.append("self_attn.o_proj.bias")
    if config.mlp_bias:
        names += [f"mlp.{p}_proj.bias" for p in ("gate", "up", "down")]
    return [prefix + name for name in names]


def expected_block_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name inside a block (`self_attn.q_proj.weight`, ...) -> the shape the model needs, biases included."""
    h, i, q, kv = config.hidden_size, config.intermediate_size, config.q_dim, config.kv_dim
    return {
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i),
        "self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,),
        "self_attn.o_proj.bias": (h,), "mlp.gate_proj.bias": (i,), "mlp.up_proj.bias": (i,), "mlp.down_proj.bias": (h,),
    }


def read_block_tensors(checkpoint, layer: int, dtype) -> dict:
    """Every tensor of one layer from an open checkpoint of either format (its `read` and `files_for`), keyed by
    its name inside the block, each checked against its expected shape."""
    names = block_tensor_names(checkpoint.config, layer)
    checkpoint.files_for(names)  # fail on a missing tensor before reading anything
    expected = expected_block_shapes(checkpoint.config)
    prefix = f"model.layers.{layer}."
    return {name[len(prefix):]: checkpoint.read(name, dtype, expected[name[len(prefix):]]) for name in names}
