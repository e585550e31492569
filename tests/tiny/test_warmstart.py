import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from stapo.tiny import arithmetic_problems, warm_start
from stapo.tiny.warmstart import SFTExample, collate, encode_examples, with_bare_answers


def test_collate_masks_prompt_and_padding():
    # Row 0: prompt [5, 6], response [7, 2]; row 1: prompt [5], response [2]; pad id 0, L = 4.
    input_ids, attention_mask, labels = collate([SFTExample([5, 6], [7, 2]), SFTExample([5], [2])], pad_id=0)
    assert input_ids.tolist() == [[5, 6, 7, 2], [5, 2, 0, 0]]
    assert attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert labels.tolist() == [[-100, -100, 7, 2], [-100, 2, -100, -100]]


def test_response_is_solution_plus_eos(tiny_tokenizer):
    p = arithmetic_problems(1, seed=0)[0]
    (ex,) = encode_examples(tiny_tokenizer, [p])
    assert ex.response_ids[-1] == tiny_tokenizer.eos_token_id
    assert tiny_tokenizer.decode(ex.response_ids[:-1]) == p.solution


def test_small_budget_lowers_loss_and_saves_a_model(tiny_model_dir, tmp_path):
    problems = arithmetic_problems(64, seed=0, digits=1, terms=2)
    out = warm_start(tiny_model_dir, tmp_path / "ws", problems=problems, steps=12, lr=3e-3, batch_size=8,
                     progress=False)
    losses = json.loads((out / "warm_start.json").read_text())["losses"]
    assert len(losses) == 12
    assert sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3
    model = AutoModelForCausalLM.from_pretrained(str(out))
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    assert not torch.equal(model.model.embed_tokens.weight, base.model.embed_tokens.weight)


def test_deterministic_and_cached(tiny_model_dir):
    problems = arithmetic_problems(16, seed=0, digits=1, terms=2)
    kwargs = dict(problems=problems, steps=3, batch_size=4, progress=False)
    a = warm_start(tiny_model_dir, **kwargs)
    mtime = (a / "model.safetensors").stat().st_mtime_ns
    assert warm_start(tiny_model_dir, **kwargs) == a
    assert (a / "model.safetensors").stat().st_mtime_ns == mtime
    b = warm_start(tiny_model_dir, a.parent / "again", **kwargs)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert warm_start(tiny_model_dir, **{**kwargs, "seed": 1}) != a
    assert warm_start(tiny_model_dir, **{**kwargs, "bare_fraction": 0.5}) != a  # other targets, other entry


def test_bare_answers_replace_a_deterministic_fraction_of_solutions():
    problems = arithmetic_problems(1000, seed=3)
    assert with_bare_answers(problems, 0.0) == problems
    mixed = with_bare_answers(problems, 0.5)
    assert mixed == with_bare_answers(problems, 0.5)
    bare = [m for m in mixed if m.solution == f"\\boxed{{{m.answer}}}"]
    assert 400 <= len(bare) <= 600
    for p, m in zip(problems, mixed):
        assert (m.question, m.answer) == (p.question, p.answer)
        assert m.solution in (p.solution, f"\\boxed{{{p.answer}}}")
    with pytest.raises(ValueError, match="bare-answer fraction"):
        with_bare_answers(problems, 1.0)
