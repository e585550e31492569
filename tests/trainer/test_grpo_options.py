"""The GRPO options reach the trainer (docs/grpo_options.md): each one changes what a real step does.

The module-level maths (penalty values at the buffer edges, the refill loop, worker time limits,
the entropy gradient) is tested beside each module; here the tiny model trains one step with each
option switched on through the config, as a user would.
"""

from __future__ import annotations

import json

import pytest

from test_trainer import tiny_config

pytestmark = pytest.mark.slow


def parity_reward(response: str, ground_truth: str) -> float:
    return 1.0 if len(response) % 2 else -1.0


def test_dynamic_sampling_trains_only_on_informative_groups(tmp_path, tiny_model_dir, arithmetic_jsonl):
    from stapo import STAPOTrainer

    # groups of prompts whose text has an even length are constant (all -1): dropped and refilled
    def reward(response, ground_truth):
        return -1.0 if len(ground_truth) % 2 == 0 else parity_reward(response, ground_truth)

    cfg = tiny_config(tmp_path, tiny_model_dir, arithmetic_jsonl, "rollout.dynamic_sampling=true",
                      "rollout.max_sampling_rounds=6", "trainer.total_steps=1")
    trainer = STAPOTrainer(cfg, reward_fn=reward)
    before = trainer.sampler.state_dict()
    metrics = trainer.step()
    # 4 prompts per step, about half of them constant: a second round refills the batch (6 allowed)
    assert metrics["groups_dropped"] >= 1 and metrics["sampling_rounds"] >= 2
    assert metrics["sampling_capped"] == 0.0
    assert metrics["groups_kept"] == 4 and metrics["zero_std_group_frac"] == 0.0  # only informative groups
    drawn = trainer.sampler.state_dict()
    assert drawn != before  # the extra draws advanced the sampler (its state is what a checkpoint saves)


def test_reward_function_from_the_config_sees_extra_columns(tmp_path, tiny_model_dir):
    from stapo import STAPOTrainer

    data = tmp_path / "rows.jsonl"
    with open(data, "w", encoding="utf-8") as f:
        for i in range(16):
            f.write(json.dumps({"prompt": f"Compute {i}+1.", "answer": str(i + 1), "difficulty": i % 3}) + "\n")
    seen = tmp_path / "seen.txt"
    user = tmp_path / "my_reward.py"
    user.write_text(
        "def reward(responses, ground_truths, difficulty, **fields):\n"
        f"    open({str(seen)!r}, 'a').write(' '.join(map(str, difficulty)) + '\\n')\n"
        "    return [1.0 if len(r) % 2 else -1.0 for r in responses]\n")
    cfg = tiny_config(tmp_path, tiny_model_dir, data, f"reward.function={user}:reward", "reward.function_batched=true",
                      "trainer.total_steps=1")
    metrics = STAPOTrainer(cfg).step()
    assert metrics["reward_failures"] == 0.0
    values = {int(v) for line in seen.read_text().split("\n") if line for v in line.split()}
    assert values <= {0, 1, 2} and len(values) >= 2  # the dataset's extra column reached the function
    assert 0.0 < metrics["accuracy"] < 1.0


def test_overlong_penalty_and_mask_truncated(tmp_path, tiny_model_dir, arithmetic_jsonl):
    from stapo import STAPOTrainer

    # the random tiny model rarely stops within 4 tokens: most responses are cut at the maximum
    short = ("rollout.max_response_length=4", "trainer.total_steps=1")
    plain = STAPOTrainer(tiny_config(tmp_path / "a", tiny_model_dir, arithmetic_jsonl, *short),
                         reward_fn=parity_reward).step()
    assert plain["response_clip_ratio"] > 0.5 and plain["overlong_penalty_mean"] == 0.0
    shaped = STAPOTrainer(tiny_config(tmp_path / "b", tiny_model_dir, arithmetic_jsonl, *short,
                                      "reward.overlong_buffer=2", "reward.overlong_penalty=0.5"),
                          reward_fn=parity_reward).step()
    # a response of exactly L_max = 4 tokens with buffer 2: ((4 - 2) - 4) / 2 * 0.5 = -0.5
    assert shaped["response_clip_ratio"] == 1.0  # every response is exactly 4 tokens long
    assert shaped["overlong_penalty_mean"] == pytest.approx(-0.5)
    assert shaped["accuracy"] == plain["accuracy"]  # accuracy counts the scorer's verdicts, not the penalty
    masked = STAPOTrainer(tiny_config(tmp_path / "c", tiny_model_dir, arithmetic_jsonl, *short,
                                      "loss.mask_truncated=true"), reward_fn=parity_reward).step()
    # same samples (same seed); at 4 tokens every response is cut, so with mask_truncated nothing is
    # left in the loss (a partly truncated batch: tests/trainer/test_contracts.py, by hand)
    assert masked["response_clip_ratio"] == plain["response_clip_ratio"] == 1.0
    assert plain["grad_norm"] > 0 and abs(plain["loss"]) > 0
    assert masked["loss"] == 0.0 and masked["grad_norm"] == 0.0 and masked["keep_frac"] == 0.0


def test_entropy_bonus_is_logged_and_moves_the_loss(tmp_path, tiny_model_dir, arithmetic_jsonl):
    from stapo import STAPOTrainer

    base = STAPOTrainer(tiny_config(tmp_path / "a", tiny_model_dir, arithmetic_jsonl, "trainer.total_steps=1"),
                        reward_fn=parity_reward).step()
    bonus = STAPOTrainer(tiny_config(tmp_path / "b", tiny_model_dir, arithmetic_jsonl, "trainer.total_steps=1",
                                     "loss.entropy_coef=0.01"), reward_fn=parity_reward).step()
    assert "entropy_bonus" not in base
    # the bonus is 0.01 x the mean entropy of kept tokens (~ log V = log 344 ~ 5.8 on a random model)
    assert 0.01 * 4.0 < bonus["entropy_bonus"] < 0.01 * 6.0
    assert bonus["loss"] == pytest.approx(base["loss"] - bonus["entropy_bonus"], abs=1e-3)
