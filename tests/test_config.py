"""Strict config loading, validation, overrides, round trip and the generated reference page."""

import dataclasses
from pathlib import Path

import pytest
import yaml

from stapo.config import ConfigError, STAPOConfig
from stapo.config.docs import config_reference_markdown, field_docs

ROOT = Path(__file__).resolve().parents[1]


def test_defaults_are_the_papers_table6():
    cfg = STAPOConfig()
    assert cfg.trainer.train_batch_size == 256 and cfg.trainer.mini_batch_size == 64
    assert cfg.num_mini_batches == 4  # 256 / 64: four updates per rollout (paper §5.1)
    assert cfg.rollout.group_size == 8
    assert cfg.optim.lr == 1e-6 and cfg.optim.warmup_steps == 10 and cfg.optim.grad_clip == 1.0
    assert (1 - cfg.loss.clip_low, 1 + cfg.loss.clip_high) == (0.8, 1.28)
    assert cfg.loss.kl_coef == 0.0
    assert cfg.rollout.temperature == 1.0 and cfg.rollout.top_p == 1.0
    assert cfg.data.max_prompt_length == 1024
    assert cfg.mask.name == "stapo" and cfg.loss.agg == "token-mean"


def test_overrides_are_typed():
    cfg = STAPOConfig.from_yaml(None, ["optim.lr=2e-6", "rollout.group_size=4", "logging.tensorboard=false",
                                       "mask.params={tau_p: 0.001}", "loss.clip_c=3"])
    assert cfg.optim.lr == 2e-6 and isinstance(cfg.optim.lr, float)  # YAML reads 2e-6 as a string
    assert cfg.rollout.group_size == 4
    assert cfg.logging.tensorboard is False
    assert cfg.mask.params == {"tau_p": 0.001}
    assert cfg.loss.clip_c == 3.0


def test_unknown_key_names_the_closest_valid_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  learning_rate: 1.0e-6\n")
    with pytest.raises(ConfigError, match="optim.learning_rate"):
        STAPOConfig.from_yaml(path)
    with pytest.raises(ConfigError, match="did you mean 'rollout.group_size'"):
        STAPOConfig.from_yaml(None, ["rollout.group_sizee=8"])
    with pytest.raises(ConfigError, match="did you mean 'trainer'"):
        STAPOConfig.from_yaml(None, ["trainr.seed=1"])


@pytest.mark.parametrize(
    "override, message",
    [
        ("rollout.group_size=1", "group_size"),
        ("optim.lr=0", "optim.lr must be > 0"),
        ("optim.lr=-1e-6", "optim.lr must be > 0"),
        ("loss.clip_low=-0.1", "clip_low"),
        ("loss.clip_low=1.0", "clip_low"),
        ("loss.clip_high=-0.01", "clip_high"),
        ("loss.clip_c=0.5", "clip_c"),
        ("trainer.mini_batch_size=100", "must divide"),
        ("loss.agg=mean", "loss.agg must be one of"),
        ("mask.stats_source=stale", "mask.stats_source"),
        ("inspect.record_minibatches=some", "inspect.record_minibatches must be one of"),
        ("rollout.top_p=0", "top_p"),
        ("rollout.group_size=2.5", "expected an integer"),
        ("optim.lr=fast", "expected a number"),
        ("logging.tensorboard=maybe", "true/false"),
        ("tiny.warm_start_bare_fraction=1.0", "warm_start_bare_fraction must be in"),
    ],
)
def test_invalid_values_are_rejected_with_the_field_name(override, message):
    with pytest.raises(ConfigError, match=message):
        STAPOConfig.from_yaml(None, [override])


def test_bad_files_give_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        STAPOConfig.from_yaml(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim: [1, 2]\n")
    with pytest.raises(ConfigError, match="optim: expected a mapping"):
        STAPOConfig.from_yaml(bad)
    with pytest.raises(ConfigError, match="section.key=value"):
        STAPOConfig.from_yaml(None, ["optim.lr"])


def test_yaml_round_trip(tmp_path):
    cfg = STAPOConfig.from_yaml(None, ["mask.name=entropy_top", "loss.clip_c=3.0", "trainer.seed=7"])
    path = tmp_path / "cfg.yaml"
    cfg.to_yaml(path)
    assert STAPOConfig.from_yaml(path) == cfg
    assert STAPOConfig.from_dict(yaml.safe_load(cfg.to_yaml())) == cfg


def test_every_field_has_a_docstring():
    for section in dataclasses.fields(STAPOConfig):
        docs = field_docs(section.type if isinstance(section.type, type) else type(getattr(STAPOConfig(), section.name)))
        names = [f.name for f in dataclasses.fields(getattr(STAPOConfig(), section.name))]
        missing = [n for n in names if n not in docs]
        assert not missing, f"{section.name}: fields without a docstring: {missing}"


def test_configuration_reference_is_up_to_date():
    page = ROOT / "docs" / "configuration.md"
    assert page.read_text(encoding="utf-8") == config_reference_markdown() + "\n", (
        "docs/configuration.md is stale: regenerate with "
        "`python -m stapo.config.docs > docs/configuration.md`"
    )


# ---- switching masks: a recipe's mask.params belong to its mask --------------------------------

TINY_RECIPE = ROOT / "examples" / "recipes" / "tiny_cpu.yaml"  # mask stapo, {tau_p: 0.002, entropy_quantile: 0.8}


def _load_custom_mask_example():
    """Import examples/custom_mask.py as `stapo train --import` does (registers low_confidence_positive)."""
    from stapo.cli.common import load_user_modules

    load_user_modules([str(ROOT / "examples" / "custom_mask.py")])


@pytest.mark.parametrize("name, built", [
    ("none", {}),
    ("entropy_top", {"entropy_quantile": 0.8}),  # the mask's own default, not the recipe's value
    ("low_confidence_positive", {"quantile": 0.01}),
])
def test_overriding_mask_name_gives_the_new_mask_its_defaults(name, built, caplog):
    from stapo.losses import build_mask

    _load_custom_mask_example()
    with caplog.at_level("INFO", logger="stapo.config"):
        cfg = STAPOConfig.from_yaml(TINY_RECIPE, [f"mask.name={name}"])
    assert cfg.mask.name == name and cfg.mask.params == {}
    mask = build_mask(cfg.mask.name, **cfg.mask.params)
    assert {k: getattr(mask, k) for k in built} == built
    lines = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(lines) == 1 and "['entropy_quantile', 'tau_p']" in lines[0] and "'stapo'" in lines[0], lines


def test_params_given_with_the_new_name_apply_and_the_rest_are_dropped():
    cfg = STAPOConfig.from_yaml(TINY_RECIPE, ["mask.name=prob_only", "mask.params.tau_p=0.01"])
    assert cfg.mask.params == {"tau_p": 0.01}
    cfg = STAPOConfig.from_yaml(TINY_RECIPE, ["mask.name=entropy_top", "mask.params={entropy_quantile: 0.7}"])
    assert cfg.mask.params == {"entropy_quantile": 0.7}
    # the same name (or no name) keeps the recipe's params and merges the override
    cfg = STAPOConfig.from_yaml(TINY_RECIPE, ["mask.name=stapo", "mask.params.tau_p=0.01"])
    assert cfg.mask.params == {"tau_p": 0.01, "entropy_quantile": 0.8}
    assert STAPOConfig.from_yaml(TINY_RECIPE, ["mask.params.tau_p=0.01"]).mask.params["entropy_quantile"] == 0.8


def test_from_dict_switches_masks_like_the_command_line():
    recipe = yaml.safe_load(TINY_RECIPE.read_text())
    cfg = STAPOConfig.from_dict(recipe, ["mask.name=none"])
    assert cfg.mask.params == {}
    assert recipe["mask"]["params"] == {"tau_p": 0.002, "entropy_quantile": 0.8}  # the caller's dict untouched


@pytest.mark.parametrize("data, overrides, message", [
    (None, ["mask.name=none", "mask.params.tau_p=0.01"], r"mask.params: unknown parameter\(s\) \['tau_p'\] for mask 'none'"),
    ({"mask": {"name": "none", "params": {"tau_p": 0.01}}}, [], r"unknown parameter\(s\) \['tau_p'\] for mask 'none'"),
    (None, ["mask.name=entropy_top", "mask.params.tau_p=0.01"], r"\['tau_p'\] for mask 'entropy_top'"),
    (None, ["mask.params.entropy_quantile=1.5"], "entropy_quantile must be in"),
    (None, ["mask.name=nonexistent"], "mask.name: unknown mask 'nonexistent'; available: .*entropy_top, high_entropy_low_prob"),
])
def test_a_param_the_chosen_mask_lacks_given_explicitly_is_an_error(data, overrides, message):
    with pytest.raises(ConfigError, match=message):
        if data is None:
            STAPOConfig.from_yaml(TINY_RECIPE, overrides)
        else:
            STAPOConfig.from_dict(data, overrides)


def test_rollout_sleep_level_is_checked_and_reaches_the_engine_options(monkeypatch):
    import stapo.rollout.registry as registry
    from stapo.trainer.components import build_rollout_engine

    with pytest.raises(ConfigError, match="rollout.sleep_level must be 1 or 2, got 3"):
        STAPOConfig.from_dict({}, ["rollout.sleep_level=3"])
    seen = {}
    monkeypatch.setattr(registry, "build_engine", lambda name, path, tok, opts: (name, seen.setdefault("opts", opts)))
    build_rollout_engine(STAPOConfig.from_dict({}, ["rollout.sleep_level=2"]), "unused", None)
    assert seen["opts"].sleep_level == 2


@pytest.mark.parametrize("overrides, message", [
    (["rollout.mode=server", "rollout.server.addresses=[127.0.0.1:8000]"], "offload_training_state is for colocated engines"),
    (["trainer.zero_stage=0", "model.dtype=fp32"], "offload_training_state needs trainer.zero_stage >= 1"),
    (["trainer.offload=true"], "offload_training_state and trainer.offload"),
    (["model.lora.enabled=true"], "offload_training_state has nothing worth moving with model.lora.enabled"),
])
def test_offload_training_state_names_what_it_cannot_go_with(overrides, message):
    assert STAPOConfig.from_dict({}, ["rollout.offload_training_state=true"]).rollout.offload_training_state
    with pytest.raises(ConfigError, match=message):
        STAPOConfig.from_dict({}, ["rollout.offload_training_state=true", *overrides])


@pytest.mark.parametrize("old, new", [("rollout.request_retries=3", "rollout.server.request_retries"),
                                      ("rollout.servers=[127.0.0.1:8000]", "rollout.server.addresses"),
                                      ("rollout.server_token_file=/tmp/t", "rollout.server.token_file"),
                                      ("rollout.server_down_after_s=9", "rollout.server.down_after_s"),
                                      ("rollout.sync=delta", "rollout.server.sync")])
def test_a_flat_server_key_fails_naming_its_new_key(old, new, tmp_path):
    key, value = old.split("=")
    with pytest.raises(ConfigError) as override:
        STAPOConfig.from_yaml(None, [old])
    path = tmp_path / "c.yaml"
    path.write_text(f"rollout:\n  {key.split('.')[1]}: {value}\n")
    with pytest.raises(ConfigError) as written:
        STAPOConfig.from_yaml(path)
    assert str(override.value) == str(written.value) == f"{key} moved: use {new}"
    field, server_mode = new.split(".")[2], ["rollout.mode=server", "rollout.server.addresses=[127.0.0.1:8000]"]
    moved = yaml.safe_load(f"rollout:\n  server:\n    {field}: {value}\n")  # as a file holds it
    for cfg in (STAPOConfig.from_dict(moved, server_mode), STAPOConfig.from_dict({}, [*server_mode, f"{new}={value}"])):
        assert getattr(cfg.rollout.server, field) == yaml.safe_load(value)


def test_a_run_directory_config_from_before_the_server_section_still_loads():
    """Its config.yaml holds every flat key at its default (`to_dict`): read as nothing, like a removed key."""
    from stapo.config.rollout_sections import MOVED_TO_SERVER, ServerConfig

    old = {"rollout": {k: getattr(ServerConfig(), new) for k, new in MOVED_TO_SERVER.items()}}
    assert STAPOConfig.from_dict(old).to_dict() == STAPOConfig().to_dict()
