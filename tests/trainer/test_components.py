"""The config → components step for the built-in synthetic task."""

import re

import pytest
import torch

from stapo.config import ConfigError, STAPOConfig
from stapo.losses.ops import DEFAULT_CHUNK_SIZE
from stapo.trainer.components import build_datasets, update_options


@pytest.mark.parametrize("terms", [3, 5])
def test_builtin_task_follows_tiny_terms(terms, tiny_tokenizer, tmp_path):
    cfg = STAPOConfig.from_yaml(None, [f"tiny.terms={terms}", "data.num_builtin_problems=64", "data.eval_size=32",
                                       "trainer.train_batch_size=8", "trainer.mini_batch_size=8",
                                       f"trainer.output_dir={tmp_path}"])
    train, evaluation = build_datasets(cfg, tiny_tokenizer)
    assert (len(train), len(evaluation)) == (64, 32)
    for example in list(train) + list(evaluation):
        expression = re.fullmatch(r"Compute (.+)\.", example.problem).group(1)
        assert len(re.findall(r"\d+", expression)) == terms, example.problem
        assert int(example.ground_truth) == eval(expression)  # + and - only: left to right = Python's order


def test_update_options_take_the_configured_chunk_size():
    # loss.chunk_size reaches the logprob/entropy op; its default is the tuned op default (128),
    # not a second constant of the update path
    assert STAPOConfig().loss.chunk_size == DEFAULT_CHUNK_SIZE
    assert update_options(STAPOConfig()).chunk_size == DEFAULT_CHUNK_SIZE
    assert update_options(STAPOConfig.from_yaml(None, ["loss.chunk_size=77"])).chunk_size == 77
    with pytest.raises(ConfigError, match="loss.chunk_size must be >= 1, got 0"):
        STAPOConfig.from_yaml(None, ["loss.chunk_size=0"])


def test_build_scorer_follows_reward_mode_function_and_reward_fn(tmp_path):
    from stapo.rewards import CallableScorer, FunctionScorer, MathVerifier
    from stapo.trainer.components import build_scorer

    scorer, close = build_scorer(STAPOConfig.from_yaml(None, ["reward.mode=dapo"]), None)
    assert isinstance(scorer, MathVerifier) and scorer.mode == "dapo"
    assert scorer(["Answer: 4"], ["4"]) == [1.0]  # callable like the old `score`
    close()
    user = tmp_path / "r.py"
    user.write_text("def half(response, ground_truth):\n    return 0.5\n")
    cfg = STAPOConfig.from_yaml(None, [f"reward.function={user}:half", "reward.failure_value=-3"])
    scorer, close = build_scorer(cfg, None)
    try:
        assert isinstance(scorer, FunctionScorer) and scorer.failure_value == -3.0
        assert scorer(["x", "y"], ["1", "2"], [{}, {}]) == [0.5, 0.5] and scorer.failures == 0
    finally:
        close()
    scorer, _ = build_scorer(cfg, lambda response, answer: 1 / 0)  # reward_fn wins, in-process
    assert isinstance(scorer, CallableScorer) and scorer(["x"], ["1"]) == [-3.0] and scorer.failures == 1


def _main_first_worker(out_dir, **_):
    import time
    from pathlib import Path

    from stapo.distributed.process_group import init_distributed
    from stapo.trainer.components import main_rank_first

    info = init_distributed()
    log = Path(out_dir) / "calls.txt"

    def build():
        with log.open("a") as f:
            f.write(f"start {info.rank}\n")
        time.sleep(0.5)  # rank 1 would start meanwhile if it did not wait
        with log.open("a") as f:
            f.write(f"end {info.rank}\n")
        return info.rank * 10

    return main_rank_first(info, build), log.read_text().split("\n")[:4] if info.rank == 1 else None


@pytest.mark.distributed
@pytest.mark.slow
def test_main_rank_first_builds_on_rank_0_before_the_others(tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from _dist_utils import run_ranks

    (r0, _), (r1, calls) = run_ranks(_main_first_worker, 2, tmp_path, timeout=400)
    assert (r0, r1) == (0, 10)  # each rank gets its own build's result
    assert calls == ["start 0", "end 0", "start 1", "end 1"]


def test_memory_knobs_reach_the_engine(monkeypatch, tiny_model_dir):
    # model.gradient_checkpointing and model.compile_layers are build_engine's; compiling marks every decoder
    # layer (compilation itself happens at the first forward: measured in bench/memory_knobs.py)
    from transformers import AutoModelForCausalLM

    from stapo.distributed import deepspeed_engine
    from stapo.trainer.components import build_deepspeed

    seen = {}
    monkeypatch.setattr(deepspeed_engine, "build_engine", lambda model, **kw: seen.update(kw))
    build_deepspeed(None, STAPOConfig.from_yaml(None, ["model.gradient_checkpointing=true",
                                                       "model.compile_layers=true"]), 1)
    assert seen["gradient_checkpointing"] is True and seen["compile_layers"] is True
    assert STAPOConfig().model.compile_layers is False
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    assert deepspeed_engine.compile_decoder_layers(model) == model.config.num_hidden_layers == 4
    assert all(layer._compiled_call_impl is not None for layer in model.model.layers)
    assert model.lm_head._compiled_call_impl is None and "model.layers.0.mlp.up_proj.weight" in model.state_dict()
    with pytest.raises(ValueError, match="model.compile_layers: Linear has no transformers decoder layers"):
        deepspeed_engine.compile_decoder_layers(torch.nn.Linear(2, 2))


def test_the_8b_and_14b_recipes_checkpoint_activations():
    from pathlib import Path

    recipes = [p for p in sorted((Path(__file__).resolve().parents[2] / "examples" / "recipes").glob("qwen3_*.yaml"))
               if "_8b" in p.name or "_14b" in p.name]
    assert len(recipes) >= 10
    for path in recipes:
        cfg = STAPOConfig.from_yaml(path)
        assert cfg.model.gradient_checkpointing and cfg.model.attn_implementation == "auto", path.name
