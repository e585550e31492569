"""Config fields of the GRPO options (dynamic sampling, overlong shaping, reward functions, entropy
bonus): validation names the field, and the defaults and every shipped recipe leave them off
(the paper: "dynamic sampling is not applied to any of the baselines", no entropy bonus)."""

from pathlib import Path

import pytest

from stapo.config import ConfigError, STAPOConfig

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "examples" / "recipes").glob("*.yaml"))


def options_off(cfg: STAPOConfig) -> bool:
    return (not cfg.rollout.dynamic_sampling and cfg.reward.overlong_buffer == 0 and cfg.reward.function is None
            and not cfg.loss.mask_truncated and cfg.loss.entropy_coef == 0.0)


def test_defaults_are_off():
    cfg = STAPOConfig()
    assert options_off(cfg)
    assert (cfg.rollout.max_sampling_rounds, cfg.reward.overlong_penalty, cfg.reward.failure_value) == (3, 1.0, -1.0)
    assert cfg.reward.scorer_mode == "math" and cfg.reward.function_batched is False


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipes_leave_every_option_off(recipe):
    assert options_off(STAPOConfig.from_yaml(recipe))


def test_a_dapo_style_run_parses():
    cfg = STAPOConfig.from_yaml(None, ["rollout.dynamic_sampling=true", "rollout.max_sampling_rounds=5",
                                       "rollout.max_response_length=20480", "reward.overlong_buffer=4096",
                                       "loss.mask_truncated=true", "loss.entropy_coef=0.001"])
    assert cfg.rollout.dynamic_sampling and cfg.rollout.max_sampling_rounds == 5
    assert cfg.reward.overlong_buffer == 4096 and cfg.loss.mask_truncated and cfg.loss.entropy_coef == 0.001


@pytest.mark.parametrize("overrides, message", [
    (["rollout.max_sampling_rounds=0"], "rollout.max_sampling_rounds must be >= 1"),
    (["rollout.max_response_length=100", "reward.overlong_buffer=101"], "reward.overlong_buffer must be in"),
    (["reward.overlong_buffer=-1"], "reward.overlong_buffer must be in"),
    (["reward.overlong_penalty=-0.5"], "reward.overlong_penalty must be >= 0"),
    (["reward.failure_value=.nan"], "reward.failure_value must be finite"),
    (["reward.mode=function"], "reward.mode 'function' needs reward.function"),
    (["reward.mode=dapo", "reward.function=pkg.mod:fn"], "reward.function replaces the verifier"),
    (["reward.function=pkg.mod"], "reward.function must look like"),
    (["reward.function=not a module:fn"], "is not a module path"),
    (["loss.entropy_coef=.inf"], "loss.entropy_coef must be finite"),
    (["loss.mask_truncated=sometimes"], "true/false"),
])
def test_invalid_values_name_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        STAPOConfig.from_yaml(None, overrides)
