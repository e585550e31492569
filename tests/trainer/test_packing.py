"""Packed, padding-free teacher forcing equals the padded path; token-budget plans are balanced.

Packed rows put several sequences (prompt + response) in ONE row with per-sequence position ids
and no attention mask (transformers then keeps attention inside each sequence).
"""

from __future__ import annotations

import pytest
import torch

from _batches import ragged_rows
from stapo.trainer.microbatch import balanced_bins, bins_needed, plan_micro_batches
from stapo.distributed.policy import PackedInputs, PolicyInputs, response_token_stats, teacher_forced_inputs


def test_packed_layout_by_hand():
    # row 0: prompt [11 12] response [21 22 23]; row 1: prompt [13] response [24] (+ padding)
    prompt_ids = torch.tensor([[11, 12], [0, 13]])
    prompt_mask = torch.tensor([[True, True], [False, True]])
    response_ids = torch.tensor([[21, 22, 23], [24, 0, 0]])
    response_mask = torch.tensor([[True, True, True], [True, False, False]])
    packed = PackedInputs.from_parts(prompt_ids, prompt_mask, response_ids, response_mask)
    assert packed.input_ids.tolist() == [[11, 12, 21, 22, 23, 13, 24]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1]]
    # hidden state at column c predicts the token at c + 1: 21 <- col 1, 22 <- 2, 23 <- 3, 24 <- 5
    assert packed.target_index.tolist() == [1, 2, 3, 5]
    with pytest.raises(ValueError, match="at least one prompt token"):
        PackedInputs.from_parts(prompt_ids, torch.tensor([[True, True], [False, False]]), response_ids, response_mask)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_packed_stats_and_gradients_equal_the_padded_path(model, temperature):
    parts = ragged_rows([3, 5, 4, 6, 2, 5], [7, 2, 9, 5, 10, 1])
    results = {}
    for packed in (False, True):
        model.zero_grad()
        inputs = teacher_forced_inputs(*parts, packed=packed)
        assert isinstance(inputs, PackedInputs if packed else PolicyInputs)
        logprobs, entropy = response_token_stats(model, inputs, temperature=temperature, chunk_size=16)
        (logprobs * torch.linspace(-1, 1, logprobs.numel()).view_as(logprobs)).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[packed] = logprobs.detach(), entropy, grads
    (lp0, h0, g0), (lp1, h1, g1) = results[False], results[True]
    assert lp0.shape == lp1.shape == (6, 10)
    assert (lp0[~parts[3][:, :10]] == 0).all() and (lp1[~parts[3][:, :10]] == 0).all()  # zero on padding
    assert (lp0 - lp1).abs().max() <= 1e-5 and (h0 - h1).abs().max() <= 1e-5
    assert g0.keys() == g1.keys() and len(g0) > 10
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-4, atol=1e-5, msg=name)


def test_packed_sequences_do_not_see_each_other(model):
    # a sequence's stats are the same alone and packed after another sequence
    parts = ragged_rows([4, 3], [6, 5], seed=1)
    together = response_token_stats(model, teacher_forced_inputs(*parts, packed=True), temperature=1.0, chunk_size=16)
    alone = response_token_stats(model, teacher_forced_inputs(*(t[1:] for t in parts), packed=True),
                                 temperature=1.0, chunk_size=16)
    assert (together[0][1, :5] - alone[0][0, :5]).abs().max() <= 1e-5


def test_balanced_bins_by_hand():
    assert balanced_bins([5, 1, 4, 2], 2) == [[0, 1], [2, 3]]  # 6 and 6 tokens
    assert balanced_bins([3, 3, 3], 3) == [[0], [1], [2]]
    assert balanced_bins([0, 0, 7], 3) == [[2], [0], [1]]  # an empty row still fills a bin: no empty forward


def test_bins_needed_respects_the_budget():
    assert bins_needed([10, 7, 13, 11], 24) == 2  # 41 tokens: {13, 7} = 20 and {11, 10} = 21
    assert bins_needed([30, 2, 2], 24) == 2  # the over-long row alone, the rest together
    assert bins_needed([5] * 6, 10) == 3
    for lengths, budget in (([9, 8, 7, 6, 5, 4, 3], 12), ([1] * 50, 7), ([40, 1, 1, 1], 10)):
        bins = balanced_bins(lengths, bins_needed(lengths, budget))
        assert sorted(i for b in bins for i in b) == list(range(len(lengths)))  # every row once
        assert all(len(b) == 1 or sum(lengths[i] for i in b) <= budget for b in bins)


def test_plan_by_rows_and_by_tokens():
    assert plan_micro_batches([4] * 5, max_rows=2) == [[0, 1], [2, 3], [4]]
    assert plan_micro_batches([4] * 9, max_rows=4) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]  # 3 even runs
    plan = plan_micro_batches([10, 7, 13, 11, 12, 6, 9, 12], max_tokens=24)
    assert len(plan) == 4 and all(sum([10, 7, 13, 11, 12, 6, 9, 12][i] for i in b) <= 24 for b in plan)
    with pytest.raises(ValueError, match="max_rows >= 1 or max_tokens"):
        plan_micro_batches([1, 2], max_rows=None)


def test_packed_rows_of_bounded_width_by_hand():
    # lengths 5 (2+3), 2 (1+1), 4 (2+2) into rows of width 5, first-fit-decreasing: seq 0 -> row 0,
    # seq 2 -> row 1 (1 left), seq 1 fits neither -> row 2; unused tails restart their positions
    prompt_ids = torch.tensor([[11, 12], [0, 13], [14, 15]])
    prompt_mask = torch.tensor([[True, True], [False, True], [True, True]])
    response_ids = torch.tensor([[21, 22, 23], [24, 0, 0], [25, 26, 0]])
    response_mask = torch.tensor([[True, True, True], [True, False, False], [True, True, False]])
    packed = PackedInputs.from_parts(prompt_ids, prompt_mask, response_ids, response_mask, row_width=5)
    assert packed.input_ids.tolist() == [[11, 12, 21, 22, 23], [14, 15, 25, 26, 0], [13, 24, 0, 0, 0]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 3, 0], [0, 1, 0, 1, 2]]
    # flat index = row * 5 + column; seq 0 -> 1, 2, 3; seq 1 -> 10; seq 2 -> 6, 7
    assert packed.target_index.tolist() == [1, 2, 3, 10, 6, 7]


def test_row_packed_stats_equal_one_row_and_padded(model):
    parts = ragged_rows([3, 5, 4, 6, 2, 5, 1], [7, 2, 9, 5, 10, 1, 3], seed=2)
    padded = response_token_stats(model, teacher_forced_inputs(*parts, packed=False), temperature=1.0, chunk_size=16)
    rows = teacher_forced_inputs(*parts, packed=True)
    one = teacher_forced_inputs(*parts, packed=True, one_row=True)
    assert rows.input_ids.shape[0] > 1 and one.input_ids.shape[0] == 1
    assert rows.input_ids.shape[1] == 13  # as wide as the longest sequence (4 + 9)
    for inputs in (rows, one):
        lp, h = response_token_stats(model, inputs, temperature=1.0, chunk_size=16)
        assert (lp - padded[0]).abs().max() <= 1e-5 and (h - padded[1]).abs().max() <= 1e-5


def test_padded_inputs_positions_by_hand():
    # row 1: prompt [pad, 5, 6] + response [12, pad]: positions count real tokens only
    prompt_ids = torch.tensor([[4, 5, 6], [0, 5, 6]])
    prompt_mask = torch.tensor([[True, True, True], [False, True, True]])
    response_ids = torch.tensor([[11, 2], [12, 0]])
    response_mask = torch.tensor([[True, True], [True, False]])
    inputs = PolicyInputs.from_parts(prompt_ids, prompt_mask, response_ids, response_mask)
    assert inputs.input_ids[1].tolist() == [0, 5, 6, 12, 0]
    assert inputs.attention_mask[1].tolist() == [0, 1, 1, 1, 0]
    assert inputs.position_ids[1].tolist() == [0, 0, 1, 2, 2]  # cumsum(mask) - 1, clamped at 0
    assert inputs.position_ids[0].tolist() == [0, 1, 2, 3, 4]
    assert inputs.prompt_length == 3  # hidden state at column 2 + t predicts response token t
    # all-padding columns are trimmed: left of every prompt, right of every response
    trimmed = PolicyInputs.from_parts(prompt_ids[1:], prompt_mask[1:], response_ids[1:], response_mask[1:])
    assert trimmed.input_ids.tolist() == [[5, 6, 12]] and trimmed.prompt_length == 2
