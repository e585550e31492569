"""Rollout-engine registry: names, auto resolution, user engines, config choices."""

from __future__ import annotations

import pytest
import torch

from stapo.config import STAPOConfig
from stapo.config.loading import ConfigError
from stapo.rollout import HFEngine, registry
from stapo.rollout.registry import EngineOptions, build_engine, engine_choices, register_engine, resolve_engine


def test_builtin_names_and_auto(monkeypatch):
    assert engine_choices()[0] == "auto" and {"hf", "vllm"} <= set(engine_choices())
    # vLLM's CPU build installed, no GPU: auto stays on HF (vllm by name is allowed, see below)
    monkeypatch.setattr(registry, "vllm_installed", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_engine("auto") == "hf" and resolve_engine("vllm") == "vllm"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU and vllm: auto picks vLLM
    assert resolve_engine("auto") == "vllm"
    monkeypatch.setattr(registry, "vllm_installed", lambda: False)
    assert resolve_engine("auto") == "hf"
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"unknown rollout engine 'sglang'.*'auto', .*'hf'"):
        resolve_engine("sglang")


def test_hf_engine_is_built_from_options(tiny_model_dir, tiny_tokenizer):
    name, engine = build_engine("hf", tiny_model_dir, tiny_tokenizer, EngineOptions(device="cpu", max_batch_size=3))
    assert name == "hf" and isinstance(engine, HFEngine)


def test_vllm_not_installed_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(registry, "vllm_installed", lambda: False)
    with pytest.raises(ValueError, match="vllm rollout engine needs vLLM: .*CPU build"):
        build_engine("vllm", "unused", None)


def test_user_engine_registers_once_and_becomes_a_config_choice(monkeypatch):
    monkeypatch.setattr(registry, "_ENGINES", registry._ENGINES.copy())  # leave the real table alone
    seen = {}

    @register_engine("echo")
    def build_echo(model_path, tokenizer, opts):
        seen.update(path=model_path, seed=opts.seed)
        return "an engine"

    assert build_engine("echo", "m", None, EngineOptions(seed=7)) == ("echo", "an engine")
    assert seen == {"path": "m", "seed": 7}
    assert STAPOConfig.from_dict({}, ["rollout.engine=echo"]).rollout.engine == "echo"
    with pytest.raises(ValueError, match="already registered"):
        register_engine("echo")(lambda *a: None)
    with pytest.raises(ValueError, match="other than 'auto'"):
        register_engine("auto")


def test_config_rejects_unknown_engine_and_tp():
    with pytest.raises(ConfigError, match=r"rollout.engine must be one of \['auto', .*'hf'"):
        STAPOConfig.from_dict({}, ["rollout.engine=sglang"])
    with pytest.raises(ConfigError, match="tensor_parallel_size must be >= 1, got 0"):
        STAPOConfig.from_dict({}, ["rollout.tensor_parallel_size=0"])


def test_trainer_builds_its_engine_through_the_registry(monkeypatch):
    from stapo.trainer.components import build_rollout_engine

    monkeypatch.setattr(registry, "_ENGINES", registry._ENGINES.copy())
    got = {}
    registry._ENGINES["vllm"] = lambda path, tok, opts: got.setdefault("opts", opts)
    monkeypatch.setattr(registry, "_CHECKS", {})  # the stand-in needs no vLLM
    cfg = STAPOConfig.from_dict({}, ["rollout.engine=vllm", "trainer.seed=5",
                                     "data.max_prompt_length=100", "rollout.max_response_length=28",
                                     "rollout.gpu_memory_utilization=0.3", "model.dtype=bf16"])
    build_rollout_engine(cfg, "path", None, dist_rank=2)
    # the engine seed differs per rank: seedless requests must not draw the same stream on every rank
    assert got["opts"] == EngineOptions(dtype=torch.bfloat16, max_model_len=128, seed=7, max_batch_size=256,
                                        gpu_memory_utilization=0.3, tensor_parallel_size=1)


def test_engine_problem_is_the_message_build_engine_raises(monkeypatch):
    monkeypatch.setattr(registry, "vllm_installed", lambda: False)
    problem = registry.engine_problem("vllm")
    assert problem.startswith("the vllm rollout engine needs vLLM")
    with pytest.raises(ValueError) as raised:
        build_engine("vllm", "unused", None)
    assert str(raised.value) == problem
    assert registry.engine_problem("hf") is None and registry.engine_problem("auto") is None  # auto -> hf here
    monkeypatch.setattr(registry, "vllm_installed", lambda: True)
    assert registry.engine_problem("vllm") is None
