"""SamplingParams validation and the processed-distribution math (hand-computed values)."""

from __future__ import annotations

import math

import pytest
import torch

from stapo.rollout.sampling import SamplingParams, processed_logprobs, sample_with_uniforms, vllm_request_kwargs

# probabilities .5 / .3 / .2 as logits (log-probs are valid logits)
LOGITS = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.2)]])


def probs(**kw) -> list[float]:
    return processed_logprobs(LOGITS, **kw).exp()[0].tolist()


@pytest.mark.parametrize("kwargs", [
    {"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.5}, {"max_new_tokens": 0},
    {"stop_token_ids": (-1,)}, {"top_k": 2.5}, {"seed": "0"},
])
def test_sampling_params_rejects_invalid(kwargs):
    with pytest.raises(ValueError, match="SamplingParams"):
        SamplingParams(**kwargs)


def test_sampling_params_normalizes_stop_ids_and_greedy_flag():
    sp = SamplingParams(stop_token_ids=[3, 4], temperature=0.0)
    assert sp.stop_token_ids == (3, 4) and sp.greedy
    assert not SamplingParams().greedy


def test_no_processing_is_plain_softmax():
    assert probs() == pytest.approx([0.5, 0.3, 0.2], abs=1e-6)


def test_temperature_scales_logits():
    # T=2: p_i ∝ sqrt(p_i): .70711, .54772, .44721 (sum 1.70204) -> .41545, .32180, .26275
    assert probs(temperature=2.0) == pytest.approx([0.41545, 0.32180, 0.26275], abs=1e-4)


def test_top_k_renormalizes_over_kept_tokens():
    # keep .5 and .3 -> .5/.8 = .625, .3/.8 = .375
    assert probs(top_k=2) == pytest.approx([0.625, 0.375, 0.0], abs=1e-6)
    assert probs(top_k=0) == probs(top_k=-1) == probs(top_k=3)  # <=0 or >= V: off


def test_top_p_follows_vllm_rule():
    # ascending [.2, .3, .5], cumsum [.2, .5, 1.]; drop cumsum <= 1 - top_p
    assert probs(top_p=0.7) == pytest.approx([0.625, 0.375, 0.0], abs=1e-6)  # drop cum .2 <= .3
    assert probs(top_p=0.4) == pytest.approx([1.0, 0.0, 0.0], abs=1e-6)  # drop .2, .5 <= .6
    assert probs(top_p=1e-6) == pytest.approx([1.0, 0.0, 0.0], abs=1e-6)  # top token always kept


def test_top_k_is_applied_before_top_p():
    # top-k 2 -> [.625, .375]; then top_p .6: ascending cumsum [.375, 1.] drops .375 <= .4
    assert probs(top_k=2, top_p=0.6) == pytest.approx([1.0, 0.0, 0.0], abs=1e-6)
    # top_p .6 alone keeps .5 and .3 (cumsum .2 <= .4 dropped only)
    assert probs(top_p=0.6) == pytest.approx([0.625, 0.375, 0.0], abs=1e-6)


def test_processed_logprobs_is_fp32_for_half_inputs():
    assert processed_logprobs(LOGITS.to(torch.bfloat16)).dtype == torch.float32


def test_a_draw_is_the_inverse_cdf_of_its_uniform():
    lp = torch.log(torch.tensor([[0.5, 0.3, 0.2]] * 5))
    # cumulative .5 / .8 / 1.: u < .5 -> 0, .5 <= u < .8 -> 1, else 2
    tokens, token_lp = sample_with_uniforms(lp, torch.tensor([0.0, 0.49, 0.5, 0.79, 0.999999]))
    assert tokens.tolist() == [0, 0, 1, 1, 2]
    assert torch.equal(token_lp, lp.gather(1, tokens[:, None]).squeeze(1))
    # a filtered token is never drawn, even by a uniform at the very top
    top2 = processed_logprobs(LOGITS.expand(2, 3), top_k=2)  # .625 / .375 / 0
    assert sample_with_uniforms(top2, torch.tensor([1.0 - 1e-9, 0.9999999]))[0].tolist() == [1, 1]


def test_sampling_frequencies_match_processed_distribution():
    lp = processed_logprobs(LOGITS.expand(20000, 3), top_k=2)  # .625 / .375 / 0
    tokens, token_lp = sample_with_uniforms(lp, torch.rand(20000, generator=torch.Generator().manual_seed(0)))
    freq = torch.bincount(tokens, minlength=3).float() / 20000
    assert freq[2] == 0  # a filtered token is never drawn
    assert freq[0].item() == pytest.approx(0.625, abs=0.015)  # 4+ sigma: sqrt(.625*.375/2e4) = .0034
    assert torch.isfinite(token_lp).all()


def test_greedy_picks_argmax():
    lp = torch.log_softmax(torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 0.0]]), dim=-1)
    tokens, _ = sample_with_uniforms(lp, torch.zeros(2), greedy=True)
    assert tokens.tolist() == [1, 0]


def test_one_vllm_request_per_sample_with_the_processed_logprob():
    base = vllm_request_kwargs(SamplingParams(temperature=0.7, top_k=0, stop=("</tool_call>",), stop_token_ids=(5,),
                                              seed=9, max_new_tokens=3))
    assert base == {"n": 1, "temperature": 0.7, "top_p": 1.0, "top_k": -1, "stop_token_ids": [5], "logprobs": 0,
                    "skip_special_tokens": True, "stop": ["</tool_call>"],
                    "include_stop_str_in_output": True}  # seed and max_tokens: per request
