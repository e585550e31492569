"""The lane's log-prob bounds (_bounds.py) against what they must tell apart, on a real `stapo serve`: the served
log-probs of the weights the trainer holds, moved by a CPU-like offset (3e-5, above the largest CPU figure
measured), pass; those of a stale weight sync (the server one real AdamW step at the lane's lr behind) fail,
offset or not. The margin of every bound in the lane is thus checked in every run, on the CPU it draws."""

from __future__ import annotations

import sys

import pytest
import torch
from _bounds import FP32_LOGPROB_BOUND, STALE_SYNC_MIN, assert_fp32_noise, assert_like_colocated, report
from conftest import HERE, LANE_TOKEN

from stapo.rollout import SamplingParams, generate
from stapo.servers.engine import ServerEngine
from stapo.sync.buckets import sync_weights

sys.path.insert(0, str(HERE.parent / "rollout"))
from _rollout_utils import teacher_forced  # noqa: E402

pytestmark = pytest.mark.timeout(900)
CPU_OFFSET = 3e-5  # the Xeon (AVX-512 + AMX) measured up to 2.3e-5 per step (_bounds.py)


def one_update(model, rollout, lr: float = 2e-4):
    """A copy of ``model`` after one AdamW step (the lane's lr, test_train.COMMON) raising the log-probs of
    ``rollout``'s responses: what the trainer holds when a sync did not reach the server."""
    import copy

    updated = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(updated.parameters(), lr=lr)
    (-teacher_forced(updated, rollout, grad=True)[rollout.response_mask].mean()).backward()
    optimizer.step()
    return updated


def test_a_cpu_offset_passes_and_a_stale_sync_fails_the_bounds(servers, warm_model_dir, prompts):
    from transformers import AutoModelForCausalLM

    servers[0].ensure_running()
    engine = ServerEngine([servers[0].address], pad_token_id=0, token=LANE_TOKEN)
    model = AutoModelForCausalLM.from_pretrained(str(warm_model_dir), dtype=torch.float32).eval()
    sync_weights(model, engine, bucket_bytes=2**20, version=0)
    rollout = generate(engine, prompts, 8, SamplingParams(temperature=1.0, max_new_tokens=40, seed=17))
    mask = rollout.response_mask
    signs = torch.randint(0, 2, rollout.sampling_logprobs.shape, generator=torch.Generator().manual_seed(0)) * 2 - 1
    served = rollout.sampling_logprobs + CPU_OFFSET * signs  # a CPU whose kernels differ by 3e-5 more
    fresh = float((served - teacher_forced(model, rollout))[mask].abs().max())
    stale = float((served - teacher_forced(one_update(model, rollout), rollout))[mask].abs().max())
    report("bounds check: served log-probs + 3e-5 offset vs the trainer, weights synced", fresh)
    report("bounds check: served log-probs + 3e-5 offset vs the trainer, one update not synced", stale)
    assert_fp32_noise(fresh, "the synced weights with a 3e-5 CPU offset")
    assert stale >= STALE_SYNC_MIN, stale  # the figure the bounds were placed under (_bounds.py)
    with pytest.raises(AssertionError, match="log-prob mismatch"):
        assert_fp32_noise(stale, "a stale sync")
    # the server path against the colocated engine: the CPU's offset is in both (one CPU, the same kernels);
    # a stale server against a synced colocated engine is caught
    assert_like_colocated(fresh, fresh, "the synced weights, offset in both")
    with pytest.raises(AssertionError, match="the server path's mismatch"):
        assert_like_colocated(stale, fresh, "a stale server")
    assert fresh <= FP32_LOGPROB_BOUND < stale
    engine.close()
