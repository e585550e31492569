"""Token texts of the records: byte-level pieces of a multi-byte character never show as U+FFFD."""

from __future__ import annotations

from stapo.inspect.token_text import REPLACEMENT, piece_text, row_token_texts


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_pieces_completed_by_their_neighbours_show_the_character(tiny_tokenizer):
    ids = _ids(tiny_tokenizer, "x 中 y")  # 中 is 3 UTF-8 bytes: 3 byte-level tokens in the tiny vocabulary
    alone = [tiny_tokenizer.decode([i]) for i in ids]
    assert alone.count(REPLACEMENT) == 3  # what the records held before: three unreadable tokens
    texts = row_token_texts(tiny_tokenizer, ids)
    assert texts == [t if t != REPLACEMENT else "中" for t in alone]


def test_a_stray_piece_shows_its_escaped_bytes(tiny_tokenizer):
    first_byte = _ids(tiny_tokenizer, "中")[0]  # 0xE4 on its own: no character to complete
    assert piece_text(tiny_tokenizer, first_byte) == "\\xe4"
    assert row_token_texts(tiny_tokenizer, [first_byte, *_ids(tiny_tokenizer, "a")]) == ["\\xe4", "a"]
    assert piece_text(tiny_tokenizer, _ids(tiny_tokenizer, "7")[0]) == "7"  # whole tokens unchanged
