"""The token-weighting masks in the trainer: ``stare`` and ``clip_cov`` train, and a run stopped and
resumed from its checkpoint logs the same steps as an uninterrupted one (STARE's adaptive W / M and
gate are in the checkpoint; Clip-Cov's draws are seeded from the step)."""

from __future__ import annotations

import pytest

from stapo.config import STAPOConfig
from stapo.run_dir import read_metrics

from _rewards import digit_one_reward

pytestmark = pytest.mark.slow

# target entropy far above the tiny model's: the gate is on every step and W climbs by alpha per step
MASKS = {"stare": "{variant: C2, top_p_ratio: 0.5, adaptive: true, alpha: 0.1, target_entropy: 100.0}",
         "clip_cov": "{ratio: 0.05, lb: -100.0, ub: 100.0}"}
COMPARED = ("loss", "grad_norm", "entropy_mean", "silenced_frac", "upweighted_frac", "downweighted_frac",
            "weight_mean", "mask_gate")


def _config(out, model_dir, data, mask: str, steps: int) -> STAPOConfig:
    return STAPOConfig.from_yaml(None, [
        f"model.path={model_dir}", f"data.source={data}", f"trainer.output_dir={out}",
        "trainer.train_batch_size=4", "trainer.mini_batch_size=2", "trainer.micro_batch_size=2",
        "rollout.group_size=4", "rollout.max_response_length=12", f"trainer.total_steps={steps}",
        "trainer.save_every=1", "optim.lr=1e-3", "optim.warmup_steps=0", "logging.progress=false",
        "logging.tensorboard=false", "trainer.export_hf=false", "logging.plot=false",
        f"mask.name={mask}", f"mask.params={MASKS[mask]}",
    ])


def _steps(out) -> dict[int, dict]:
    return {int(r["step"]): r for r in read_metrics(out / "metrics.jsonl") if "loss" in r}


@pytest.mark.parametrize("mask", list(MASKS))
def test_weighting_mask_trains_and_resumes_exactly(mask, tmp_path, tiny_model_dir, arithmetic_jsonl):
    from stapo import STAPOTrainer

    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    STAPOTrainer(_config(straight, tiny_model_dir, arithmetic_jsonl, mask, 4), reward_fn=digit_one_reward).train()
    STAPOTrainer(_config(stopped, tiny_model_dir, arithmetic_jsonl, mask, 2), reward_fn=digit_one_reward).train()
    resumed = STAPOTrainer(_config(stopped, tiny_model_dir, arithmetic_jsonl, mask, 4), reward_fn=digit_one_reward)
    assert resumed.step_count == 2
    if mask == "stare":  # the checkpoint restored the schedule: W = 1.1 + 2 x 0.1, M = 0.9 - 2 x 0.1
        assert resumed.mask.state_dict()["reweight_w"] == pytest.approx(1.3)
        assert resumed.mask.state_dict()["reweight_m"] == pytest.approx(0.7)
    resumed.train()
    expected, got = _steps(straight), _steps(stopped)
    assert sorted(got) == sorted(expected) == [1, 2, 3, 4]
    for step in expected:
        for key in COMPARED:
            if key in expected[step]:
                assert got[step][key] == pytest.approx(expected[step][key], rel=1e-6, abs=1e-9), (step, key)
    rows = [expected[s] for s in sorted(expected)]
    if mask == "stare":
        assert all(r["mask_gate"] == 1.0 for r in rows), rows
        # a step whose groups all tie (A = 0 everywhere) re-weights nothing; the others do
        assert any(r["upweighted_frac"] > 0 for r in rows) and any(r["downweighted_frac"] > 0 for r in rows), rows
    else:
        assert all("mask_gate" not in r for r in rows)  # clip_cov has no gate
        assert all(r["weight_mean"] == pytest.approx(r["keep_frac"]) for r in rows)  # weights 0 / 1
        assert any(r["silenced_frac"] > 0 for r in rows), rows


def test_rollout_entropy_is_the_token_mean_over_response_tokens():
    import torch

    from stapo.trainer.update import TrainBatch, rollout_entropy

    mask = torch.tensor([[True, True, False], [True, False, False]])
    entropy = torch.tensor([[0.2, 0.4, 9.0], [0.6, 9.0, 9.0]])  # 9.0 on padding: ignored
    batch = TrainBatch(torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1, dtype=torch.bool),
                       torch.zeros(2, 3, dtype=torch.long), mask, torch.zeros(2), torch.zeros(2, 3), entropy)
    assert rollout_entropy(batch) == pytest.approx((0.2 + 0.4 + 0.6) / 3)
    empty = TrainBatch(batch.prompt_ids, batch.prompt_mask, batch.response_ids, torch.zeros_like(mask),
                       batch.advantages, batch.old_logprobs, entropy)
    assert rollout_entropy(empty) != rollout_entropy(empty)  # NaN: STARE keeps its last gate
