"""Token texts a person can read, for the token records (``stapo inspect``).

A byte-level BPE splits a multi-byte character over several tokens, each decoded alone ``\\ufffd``; so a token
is decoded with its neighbours, and shows its bytes escaped (``\\xe4``) when they do not complete a character.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence

__all__ = ["REPLACEMENT", "piece_text", "row_token_texts"]

REPLACEMENT = "\ufffd"
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte fallback
_WINDOW = 4  # a UTF-8 character has at most 4 bytes


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable-character alphabet -> byte (what byte-level BPE vocabularies are written in)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


def _token_bytes(tokenizer, token_id: int) -> bytes | None:
    """The raw bytes of a byte-level token (GPT-2 alphabet or ``<0xNN>``), None for other vocabularies."""
    token = tokenizer.convert_ids_to_tokens(int(token_id))
    if not isinstance(token, str):
        return None
    match = _BYTE_TOKEN.fullmatch(token)
    if match:
        return bytes([int(match.group(1), 16)])
    decoder = _byte_decoder()
    return bytes(decoder[ch] for ch in token) if token and all(ch in decoder for ch in token) else None


def piece_text(tokenizer, token_id: int) -> str:
    """One token decoded alone; an incomplete UTF-8 piece as its escaped bytes (``\\xe4``), never ``�``."""
    text = tokenizer.decode([int(token_id)])
    if REPLACEMENT not in text:
        return text
    raw = _token_bytes(tokenizer, token_id)
    if raw is None:
        return text.replace(REPLACEMENT, "\\ufffd")
    return raw.decode("utf-8", errors="backslashreplace")


def row_token_texts(tokenizer, ids: Sequence[int], alone: dict[int, str] | None = None) -> list[str]:
    """The text of each token of one response: decoded alone, or with the neighbours that complete
    its character (see the module docstring). ``alone`` caches :func:`piece_text` by id."""
    alone = {} if alone is None else alone
    ids = [int(i) for i in ids]
    texts = []
    for i, token_id in enumerate(ids):
        if token_id not in alone:
            alone[token_id] = piece_text(tokenizer, token_id)
        whole = alone[token_id] == tokenizer.decode([token_id])  # decoded alone without a broken piece
        texts.append(alone[token_id] if whole else _completed(tokenizer, ids, i) or alone[token_id])
    return texts


def _completed(tokenizer, ids: list[int], i: int) -> str | None:
    """The shortest run of tokens around ``i`` that decodes to whole characters, or None."""
    for width in range(2, _WINDOW + 1):
        for start in range(max(0, i - width + 1), min(i, len(ids) - width) + 1):
            text = tokenizer.decode(ids[start:start + width])
            if REPLACEMENT not in text:
                return text
    return None
