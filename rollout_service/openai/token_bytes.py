"""The exact UTF-8 bytes of a single token, for ``logprobs.content[].bytes``.

Decoding one token to text is lossy: a multi-byte character split across tokens decodes to
U+FFFD on each side. The bytes are the token's own instead:

- byte-level BPE (GPT-2, Llama 3, SmolLM, Qwen: the token string spells bytes with the GPT-2
  byte-to-character table): each character maps back to its byte;
- SentencePiece byte fallback (``<0xE2>``): that byte;
- otherwise (SentencePiece word pieces): the piece's text with ``▁`` as a space, in UTF-8.

So the bytes of a completion's tokens, concatenated, are exactly the completion's UTF-8 text
(tested on byte-level tokenizers), which is what OpenAI's ``bytes`` field promises.
"""

from __future__ import annotations

import re
from functools import lru_cache

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@lru_cache(maxsize=1)
def _char_to_byte() -> dict[str, int]:
    """The inverse of GPT-2's byte-to-character table (printable bytes map to themselves, the
    other 68 to the characters from U+0100 on, in byte order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def token_bytes(tok, token_id: int) -> list[int]:
    """The token's own bytes (module docstring)."""
    piece = tok.convert_ids_to_tokens(int(token_id))
    if piece is None:
        return []
    m = _BYTE_FALLBACK.match(piece)
    if m:
        return [int(m.group(1), 16)]
    table = _char_to_byte()
    if all(c in table for c in piece):
        return [table[c] for c in piece]
    return list(piece.replace("▁", " ").encode("utf-8"))
