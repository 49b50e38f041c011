"""``logprobs.content[].bytes`` is each token's own bytes: concatenated over a completion they
give its exact UTF-8 text, also where a multi-byte character is split across tokens (decoding
one token alone gives U+FFFD there)."""

from __future__ import annotations

import pytest

from asyncrl.models import load_tokenizer
from rollout_service.openai.token_bytes import token_bytes

TEXT = "é 漢字 🙂 naïve – ok"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("builtin:tiny")


def test_bytes_of_the_tokens_rebuild_the_text(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert b"".join(bytes(token_bytes(tok, i)) for i in ids) == TEXT.encode("utf-8")
    split = [i for i in ids if "\ufffd" in tok.decode([i])]
    assert split, "the text must contain characters split across tokens for this test to mean anything"
    for i in split:  # the old answer (the token decoded alone) was lossy exactly there
        assert bytes(token_bytes(tok, i)) != tok.decode([i]).encode("utf-8")


class Piece:
    def __init__(self, pieces):
        self.pieces = pieces

    def convert_ids_to_tokens(self, i):
        return self.pieces[i]


def test_sentencepiece_byte_fallback_and_word_pieces():
    tok = Piece(["<0xE2>", "<0x82>", "<0xAC>", "▁hello"])
    assert [b for i in range(3) for b in token_bytes(tok, i)] == list("€".encode())
    assert token_bytes(tok, 3) == list(b" hello")
