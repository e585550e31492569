"""The token statistics the monitors add to the step metrics: exact counts by hand, split-invariant."""

from __future__ import annotations

import math

import pytest
import torch

from stapo.health import control_token_sums, repeated_ngram_tokens


def test_repeated_ngrams_by_hand():
    ids = torch.tensor([
        [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 0, 0],  # 4-grams at 0..8: 1234 2341 3412 4123, then 5 repeats
        [5, 6, 7, 8, 9, 1, 2, 3, 4, 5, 0, 0, 0, 0],  # no 4-gram twice
        [7, 7, 7, 7, 7, 7, 0, 0, 0, 0, 0, 0, 0, 0],  # 7777 at 0, 1, 2: two repeats
    ])
    mask = ids > 0
    assert repeated_ngram_tokens(ids, mask).tolist() == [5, 0, 2]
    context = mask.clone()
    context[0, 4] = False  # a context token (a tool's output) breaks every 4-gram through position 4
    # left: 1234 at 0 and, from 5 on, 2341 3412 4123 1234: only the last was seen before
    assert repeated_ngram_tokens(ids, context).tolist()[0] == 1
    assert repeated_ngram_tokens(ids[:, :3], mask[:, :3]).tolist() == [0, 0, 0]  # shorter than one n-gram
    assert repeated_ngram_tokens(ids, torch.zeros_like(mask)).tolist() == [0, 0, 0]


def test_repeated_ngrams_do_not_depend_on_the_split():
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 6, (12, 40), generator=gen)
    mask = torch.arange(40)[None, :] < torch.randint(5, 41, (12, 1), generator=gen)
    whole = repeated_ngram_tokens(ids, mask)
    parts = torch.cat([repeated_ngram_tokens(ids[i:i + 5], mask[i:i + 5]) for i in range(0, 12, 5)])
    assert torch.equal(whole, parts)
    assert torch.equal(whole, torch.tensor([_by_tuples(r[m].tolist()) for r, m in zip(ids, mask)]))


def _by_tuples(tokens: list[int], n: int = 4) -> int:
    seen, repeats = set(), 0
    for i in range(len(tokens) - n + 1):
        gram = tuple(tokens[i:i + n])
        repeats += gram in seen
        seen.add(gram)
    return repeats


def test_control_token_sums_by_hand():
    ids = torch.tensor([[10, 3, 4, 11, 0], [10, 10, 5, 6, 7]])
    mask = torch.tensor([[True, True, True, True, False], [True, False, True, True, True]])  # [1, 1]: context
    logprobs = torch.log(torch.tensor([[0.9, 0.5, 0.5, 0.8, 1.0], [0.6, 0.1, 0.5, 0.5, 0.5]]))
    sums = control_token_sums(ids, mask, logprobs, torch.tensor([10, 11]))
    assert int(sums["control_tokens"]) == 3  # 10 and 11 in row 0, the first 10 of row 1 (the second is context)
    assert float(sums["control_prob_sum"]) == pytest.approx(0.9 + 0.8 + 0.6)
    assert math.isclose(float(control_token_sums(ids, mask, logprobs, torch.tensor([99]))["control_prob_sum"]), 0.0)
