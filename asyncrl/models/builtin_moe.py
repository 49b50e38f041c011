"""The ``builtin:tiny-moe`` model: ``builtin:tiny``'s shape (and shipped tokenizer) with a Qwen3-MoE
config, for routing replay on the CPU (issue 53): every layer's MLP a mixture of
``TINY_MOE_EXPERTS`` experts, ``TINY_MOE_TOP_K`` routed per token (normalised top-k
probabilities), transformers' own Qwen3-MoE modelling, an output layer of its own (as the published Qwen3-MoE
models: SGLang's Qwen3-MoE never ties it to the embeddings); about 1.8 M parameters.

A module of its own: ``asyncrl.models.builtin`` is part of what determines the demo's shipped
policy (``recipes.demo.warmup.recipe_key`` hashes it), and this model is not.
"""

from __future__ import annotations

from asyncrl.models.builtin import build_tiny_config

TINY_MOE_EXPERTS = 8
TINY_MOE_TOP_K = 2
TINY_MOE_INTERMEDIATE = 96
SHARED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")
"""What ``builtin:tiny-moe`` takes from ``builtin:tiny``'s config: its shape and special tokens."""


def build_tiny_moe_config():
    """The ``Qwen3MoeConfig`` of ``builtin:tiny-moe``: ``builtin:tiny``'s shape with every
    layer's MLP a mixture of ``TINY_MOE_EXPERTS`` experts, ``TINY_MOE_TOP_K`` routed per token."""
    from transformers import Qwen3MoeConfig

    tiny = build_tiny_config()
    return Qwen3MoeConfig(
        **{k: getattr(tiny, k) for k in SHARED},
        moe_intermediate_size=TINY_MOE_INTERMEDIATE,
        head_dim=tiny.hidden_size // tiny.num_attention_heads,
        num_experts=TINY_MOE_EXPERTS,
        num_experts_per_tok=TINY_MOE_TOP_K,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        tie_word_embeddings=False,  # as the published Qwen3-MoE models: SGLang's Qwen3-MoE never ties its lm_head
        rope_theta=10000.0,
        architectures=["Qwen3MoeForCausalLM"],
        attn_implementation="sdpa",
    )
