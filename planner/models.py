"""Model specs: the shape of a transformer, read from a Hugging Face config.json, and its parameter counts.

One ModelSpec describes every supported family (Llama 1/2/3/3.1/3.2, Mistral, Mixtral, Qwen2, Falcon, BLOOM, OPT)
by a few shape numbers and structural flags; the cost model needs nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass

# where a model's context length is written: what an error about it names (a newcomer, session 26: the built-in
# model, a GGUF file, was said to have a config.json)
CONTEXT_FIELDS = "max_position_embeddings in a config.json, <architecture>.context_length in a GGUF"


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a decoder-only transformer. Counts are exact for the families listed in the module doc."""

    name: str  # hub id or folder name
    family: str  # "llama", "mistral", "mixtral", "qwen2", "falcon", "bloom", "opt"
    num_layers: int
    hidden_size: int
    intermediate_size: int  # per expert for mixture-of-experts models
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    num_experts: int = 1  # 1 for dense models
    experts_per_token: int = 1
    gated_mlp: bool = True  # SwiGLU (3 matrices) vs plain 2-matrix MLP
    linear_bias: bool = False  # biases on every attention and MLP linear (BLOOM, OPT, Falcon with bias=true)
    qkv_bias: bool = False  # biases on q, k, v (Qwen2; Llama with attention_bias=true)
    out_bias: bool = False  # bias on the attention output projection (Llama with attention_bias=true)
    mlp_bias: bool = False  # biases on the MLP linears (Llama with mlp_bias=true)
    norm_has_bias: bool = False  # LayerNorm (weight + bias) vs RMSNorm (weight only)
    norms_per_block: int = 2
    learned_positions: int = 0  # rows of a learned position table (OPT: max_position_embeddings + 2)
    embedding_norm: bool = False  # a LayerNorm right after the embedding (BLOOM)
    embed_proj_dim: int = 0  # OPT's word_embed_proj_dim when it differs from hidden_size (project_in/out); else 0
    final_norm: bool = True  # a norm before the LM head (absent in OPT-350m, which normalizes after each block)
    torch_dtype: str = "bf16"  # dtype the checkpoint is published in

    # ---- parameter counts -------------------------------------------------------------------------------------
    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def attention_params(self) -> int:
        h = self.hidden_size
        weights = h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h
        if self.linear_bias or self.qkv_bias:
            weights += self.q_dim + 2 * self.kv_dim
        if self.linear_bias or self.out_bias:
            weights += h
        return weights

    def expert_params(self) -> int:
        """Parameters of one MLP (one expert of a mixture-of-experts layer)."""
        h, i = self.hidden_size, self.intermediate_size
        weights = (3 if self.gated_mlp else 2) * h * i
        if self.linear_bias or self.mlp_bias:
            weights += (2 * i if self.gated_mlp else i) + h
        return weights

    def router_params(self) -> int:
        return self.hidden_size * self.num_experts if self.num_experts > 1 else 0

    def norm_params(self) -> int:
        return self.norms_per_block * self.hidden_size * (2 if self.norm_has_bias else 1)

    def block_params(self) -> int:
        """All parameters of one transformer block (every expert included)."""
        return self.attention_params() + self.num_experts * self.expert_params() + self.router_params() + self.norm_params()

    def active_block_params(self) -> int:
        """Parameters one token touches in a block (only experts_per_token experts of a MoE layer)."""
        experts = min(self.experts_per_token, self.num_experts)
        return self.attention_params() + experts * self.expert_params() + self.router_params() + self.norm_params()

    @property
    def embedding_dim(self) -> int:
        """Width of the token embedding (and of a tied LM head): hidden_size unless OPT projects it."""
        return self.embed_proj_dim or self.hidden_size

    def embedding_params(self) -> int:
        """Token table, learned positions, the embedding norm (BLOOM) and OPT's project_in."""
        h = self.hidden_size
        norm = 2 * h if self.embedding_norm else 0
        project_in = h * self.embed_proj_dim if self.embed_proj_dim else 0
        return self.vocab_size * self.embedding_dim + self.learned_positions * h + norm + project_in

    def head_params(self) -> int:
        """Final norm, OPT's project_out and the LM head (zero extra matrix when tied to the embedding)."""
        h = self.hidden_size
        final_norm = h * (2 if self.norm_has_bias else 1) if self.final_norm else 0
        project_out = h * self.embed_proj_dim if self.embed_proj_dim else 0
        head = 0 if self.tie_word_embeddings else self.vocab_size * self.embedding_dim
        return final_norm + project_out + head

    def outside_block_params(self) -> int:
        return self.embedding_params() + self.head_params()

    def total_params(self) -> int:
        return self.num_layers * self.block_params() + self.outside_block_params()

    # ---- per-token quantities ---------------------------------------------------------------------------------
    def kv_bytes_per_token_per_block(self, bytes_per_value: float = 2.0) -> float:
        """KV cache for one token in one block: 2 (K and V) × kv_heads × head_dim × bytes."""
        return 2 * self.num_kv_heads * self.head_dim * bytes_per_value

    def block_matmul_flops_per_token(self) -> float:
        """FLOPs of the linear layers of one block for one token (2 per multiply-add; active experts only)."""
        h = self.hidden_size
        attn = 2 * (h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h)
        mlp = 2 * min(self.experts_per_token, self.num_experts) * (3 if self.gated_mlp else 2) * h * self.intermediate_size
        return attn + mlp + 2 * self.router_params()

    def block_attention_flops_per_token(self, context_len: int) -> float:
        """FLOPs of scores and weighted sum for one new token attending to context_len positions."""
        return 2 * 2 * self.num_heads * self.head_dim * context_len
