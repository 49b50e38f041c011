"""The ``builtin:tiny-moe`` model: ``builtin:tiny``'s shape (and shipped tokenizer) with a Qwen3-MoE
config, for routing replay on the CPU (issue 53): every layer's MLP a mixture of
``TINY_MOE_EXPERTS`` experts, ``TINY_MOE_TOP_K`` routed per token (normalised top-k
probabilities), transformers' own Qwen3-MoE modelling, an output layer of its own (as the published Qwen3-MoE
models: SGLang's Qwen3-MoE never ties it to the embeddings); about 1.8 M parameters.

A module of its own: ``asyncrl.models.builtin`` is part of what determines the demo's shipped
policy (``recipes.demo.warmup.recipe_key`` hashes it), and this model is not.
"""

from __future__ import annotations

from asyncrl.models.builtin import (
    _TOKENIZER_JSON,
    TINY_HEADS,
    TINY_HIDDEN,
    TINY_INTERMEDIATE,
    TINY_KV_HEADS,
    TINY_LAYERS,
    TINY_MAX_POSITIONS,
    _tokenizer_vocab_size,
)

TINY_MOE_EXPERTS = 8
TINY_MOE_TOP_K = 2
TINY_MOE_INTERMEDIATE = 96


def build_tiny_moe_config():
    """The ``Qwen3MoeConfig`` of ``builtin:tiny-moe``: ``builtin:tiny``'s shape with every
    layer's MLP a mixture of ``TINY_MOE_EXPERTS`` experts, ``TINY_MOE_TOP_K`` routed per token."""
    from tokenizers import Tokenizer
    from transformers import Qwen3MoeConfig

    tok = Tokenizer.from_file(str(_TOKENIZER_JSON))
    return Qwen3MoeConfig(
        vocab_size=_tokenizer_vocab_size(),
        hidden_size=TINY_HIDDEN,
        intermediate_size=TINY_INTERMEDIATE,
        moe_intermediate_size=TINY_MOE_INTERMEDIATE,
        num_hidden_layers=TINY_LAYERS,
        num_attention_heads=TINY_HEADS,
        num_key_value_heads=TINY_KV_HEADS,
        head_dim=TINY_HIDDEN // TINY_HEADS,
        num_experts=TINY_MOE_EXPERTS,
        num_experts_per_tok=TINY_MOE_TOP_K,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=TINY_MAX_POSITIONS,
        tie_word_embeddings=False,  # as the published Qwen3-MoE models: SGLang's Qwen3-MoE never ties its lm_head
        rope_theta=10000.0,
        bos_token_id=None,
        eos_token_id=tok.token_to_id("<|im_end|>"),
        pad_token_id=tok.token_to_id("<|endoftext|>"),
        architectures=["Qwen3MoeForCausalLM"],
        attn_implementation="sdpa",
    )
