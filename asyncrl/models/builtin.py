"""The ``builtin:tiny`` model: a Qwen2-style config and the shipped tokenizer.

The config is small enough to train on two CPU cores (about 1 M parameters) and keeps the
features that matter for RL plumbing: grouped-query attention, RoPE, tied embeddings, a
real BPE vocabulary with ChatML and tool-call special tokens.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

BUILTIN_PREFIX = "builtin:"
_ASSETS = Path(__file__).parent
_TOKENIZER_JSON = _ASSETS / "assets" / "tiny_tokenizer.json"
_CHAT_TEMPLATE = _ASSETS / "chat_template.jinja"

TINY_HIDDEN = 128
TINY_LAYERS = 4
TINY_HEADS = 4
TINY_KV_HEADS = 2
TINY_INTERMEDIATE = 384
TINY_MAX_POSITIONS = 4096


@lru_cache(maxsize=1)
def _tokenizer_vocab_size() -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(_TOKENIZER_JSON)).get_vocab_size()


def chat_template() -> str:
    """The Jinja chat template shipped with the builtin models (ChatML + Hermes tools)."""
    return _CHAT_TEMPLATE.read_text()


def load_tiny_tokenizer():
    """A transformers fast tokenizer over the shipped BPE, with the chat template set.

    EOS is ``<|im_end|>`` (the end of an assistant turn), pad is ``<|endoftext|>``.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_file(str(_TOKENIZER_JSON)),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        model_max_length=TINY_MAX_POSITIONS,
    )
    tok.chat_template = chat_template()
    return tok


def build_tiny_config():
    """The ``Qwen2Config`` of ``builtin:tiny`` (vocabulary size from the shipped tokenizer)."""
    from tokenizers import Tokenizer
    from transformers import Qwen2Config

    tok = Tokenizer.from_file(str(_TOKENIZER_JSON))
    return Qwen2Config(
        vocab_size=_tokenizer_vocab_size(),
        hidden_size=TINY_HIDDEN,
        intermediate_size=TINY_INTERMEDIATE,
        num_hidden_layers=TINY_LAYERS,
        num_attention_heads=TINY_HEADS,
        num_key_value_heads=TINY_KV_HEADS,
        max_position_embeddings=TINY_MAX_POSITIONS,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        bos_token_id=None,
        eos_token_id=tok.token_to_id("<|im_end|>"),
        pad_token_id=tok.token_to_id("<|endoftext|>"),
        architectures=["Qwen2ForCausalLM"],
        attn_implementation="sdpa",
    )
