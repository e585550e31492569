"""Rollout dataclass: validation, padding helpers, select / concat / trim, teacher-forced view."""

from __future__ import annotations

import pytest
import torch

from stapo.rollout import Rollout
from stapo.rollout.batch import EpisodeInfo, left_pad, right_pad, row_lengths

PAD = 0


def make_rollout(prompts, responses, group_size, logprob=-1.0, reasons=None) -> Rollout:
    """Rollout from token lists (responses already per row)."""
    prompt_ids, prompt_mask = left_pad(prompts, PAD)
    response_ids = right_pad(responses, PAD, torch.long)
    response_mask = right_pad([[1] * len(r) for r in responses], 0, torch.long).bool()
    return Rollout(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids, response_mask=response_mask,
        sampling_logprobs=torch.where(response_mask, logprob, 0.0),
        finish_reason=reasons or ["stop"] * len(responses), response_text=[str(r) for r in responses],
        group_index=torch.arange(len(prompts)) // group_size, group_size=group_size, pad_token_id=PAD)


@pytest.fixture
def rollout() -> Rollout:
    # P=2 prompts x G=2: prompt A = [5, 6], prompt B = [7, 8, 9]
    return make_rollout([[5, 6], [5, 6], [7, 8, 9], [7, 8, 9]], [[11, 2], [12], [13, 14, 2], [15]], 2)


def test_left_and_right_pad():
    ids, mask = left_pad([[1, 2], [3]], pad_id=9)
    assert ids.tolist() == [[1, 2], [9, 3]] and mask.tolist() == [[True, True], [False, True]]
    assert right_pad([[1.5], [2.0, 3.0]], 0.0, torch.float32).tolist() == [[1.5, 0.0], [2.0, 3.0]]


def test_sizes(rollout):
    assert len(rollout) == 4 and rollout.num_prompts == 2
    assert rollout.response_lengths.tolist() == [2, 1, 3, 1]
    assert rollout.prompt_ids.tolist() == [[0, 5, 6], [0, 5, 6], [7, 8, 9], [7, 8, 9]]


def test_validation_names_the_bad_field(rollout):
    with pytest.raises(ValueError, match="sampling_logprobs"):
        Rollout(**{**rollout.__dict__, "sampling_logprobs": torch.zeros(4, 2)})
    with pytest.raises(ValueError, match="finish_reason"):
        Rollout(**{**rollout.__dict__, "finish_reason": ["stop"]})
    with pytest.raises(ValueError, match="ground_truth"):
        Rollout(**{**rollout.__dict__, "ground_truth": ["1", "2"]})
    with pytest.raises(ValueError, match="bool"):
        Rollout(**{**rollout.__dict__, "response_mask": rollout.response_mask.long()})


def test_with_ground_truth_repeats_per_group(rollout):
    r = rollout.with_ground_truth(["4", "x"]).with_prompt_text(["A", "B"])
    assert r.ground_truth == ["4", "4", "x", "x"] and r.prompt_text == ["A", "A", "B", "B"]
    assert rollout.ground_truth == []  # copies, not in-place
    with pytest.raises(ValueError, match="2 prompts"):
        rollout.with_ground_truth(["only one"])


def test_select_slice_mask_and_index(rollout):
    r = rollout.with_ground_truth(["4", "x"])
    sub = r.select(slice(2, 4))
    assert sub.response_ids.tolist() == [[13, 14, 2], [15, 0, 0]]
    assert sub.group_index.tolist() == [1, 1] and sub.ground_truth == ["x", "x"] and sub.num_prompts == 1
    assert r.select(torch.tensor([True, False, False, True])).response_text == ["[11, 2]", "[15]"]
    assert r.select([3, 0]).group_index.tolist() == [1, 0]


def test_concat_repads_and_offsets_groups(rollout):
    other = make_rollout([[1, 2, 3, 4], [1, 2, 3, 4]], [[20, 21, 22, 23], [24]], 2)
    both = Rollout.concat([rollout, other])
    assert both.prompt_ids.shape == (6, 4) and both.response_ids.shape == (6, 4)
    assert both.prompt_ids[0].tolist() == [0, 0, 5, 6]  # left-padded further
    assert both.prompt_mask[0].tolist() == [False, False, True, True]
    assert both.response_ids[2].tolist() == [13, 14, 2, 0]  # right-padded further
    assert both.sampling_logprobs[2].tolist() == [-1.0, -1.0, -1.0, 0.0]
    assert both.group_index.tolist() == [0, 0, 1, 1, 2, 2]
    assert both.response_text[4] == "[20, 21, 22, 23]"
    with pytest.raises(ValueError, match="group sizes"):
        Rollout.concat([rollout, make_rollout([[1]], [[2]], 1)])
    with pytest.raises(ValueError, match="ground_truth"):
        Rollout.concat([rollout.with_ground_truth(["a", "b"]), other])


def _episode(rollout: Rollout) -> Rollout:
    """Row 0 as an episode: policy token 11, one context token 30, policy token 2 (EOS)."""
    ids = torch.nn.functional.pad(rollout.response_ids, (0, 1))
    ids[0, :3] = torch.tensor([11, 30, 2])
    response_mask = torch.nn.functional.pad(rollout.response_mask, (0, 1))
    response_mask[0, :3] = torch.tensor([True, False, True])
    context = torch.zeros_like(response_mask)
    context[0, 1] = True
    info = EpisodeInfo(turns=torch.tensor([2, 1, 1, 1]), tool_calls=torch.tensor([1, 0, 0, 0]),
                       tool_errors=torch.tensor([0, 0, 0, 0]), tool_seconds=torch.zeros(4, dtype=torch.float64),
                       final_text=["a", "b", "c", "d"], tool_wait_s=0.5)
    return Rollout(**{**rollout.__dict__, "response_ids": ids, "response_mask": response_mask,
                      "sampling_logprobs": torch.where(response_mask, -1.0, 0.0), "context_mask": context,
                      "episodes": info})


def test_context_tokens_are_real_but_not_generated(rollout):
    assert not rollout.context_mask.any() and rollout.context_mask.shape == rollout.response_mask.shape
    ep = _episode(rollout)
    assert ep.response_lengths.tolist() == [2, 1, 3, 1]  # the policy's tokens
    assert ep.real_mask.sum(dim=1).tolist() == [3, 1, 3, 1]
    assert row_lengths(ep) == [2 + 3, 2 + 1, 3 + 3, 3 + 1]  # prompt + policy + context
    assert ep.answer_text == ["a", "b", "c", "d"] and rollout.answer_text == rollout.response_text
    sub = ep.select([2, 0])
    assert sub.context_mask[1].tolist() == [False, True, False, False] and sub.episodes.turns.tolist() == [1, 2]
    both = Rollout.concat([ep, ep])
    assert both.context_mask.sum() == 2 and both.episodes.final_text[4] == "a"
    assert both.episodes.tool_wait_s == 1.0
    with pytest.raises(ValueError, match="episodes is set on some parts only"):
        Rollout.concat([ep, rollout])
    with pytest.raises(ValueError, match="context_mask is True on tokens"):
        Rollout(**{**ep.__dict__, "context_mask": ep.response_mask.clone()})
