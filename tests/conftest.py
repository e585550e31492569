"""Session-wide fixtures: every tiny artifact goes to a temp cache; tiny model and task data."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

# The vLLM lane (tests/vllm_cpu, run by tests/vllm_cpu/run.sh) needs the real vLLM: where it is not
# installed the folder is not collected at all, so it is never reported as skipped tests.
collect_ignore = [] if importlib.util.find_spec("vllm") else ["vllm_cpu"]

# Tests run on 2-core CI boxes next to multi-process tests: one intra-op thread per process.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session", autouse=True)
def _tiny_cache(tmp_path_factory):
    """Point ``$STAPO_CACHE`` at a session temp dir so tests never touch ~/.cache."""
    with pytest.MonkeyPatch.context() as mp:
        root = tmp_path_factory.mktemp("stapo_cache")
        mp.setenv("STAPO_CACHE", str(root))
        yield root


@pytest.fixture(scope="session")
def tiny_model_dir(_tiny_cache):
    """A randomly initialized tiny Qwen3 model directory (with its tokenizer)."""
    from stapo.tiny import build_tiny_model

    return build_tiny_model()


@pytest.fixture(scope="session")
def tir_model_dir(_tiny_cache):
    """The tiny TIR demo's model (stapo/tiny/tir.py) after a 60-step warm start in which every prompt that
    offers the calculator calls it: it writes calls in Qwen3's format (not yet the right ones). ~25 s."""
    from stapo.tiny import build_tiny_model
    from stapo.tiny.tir import build_tir_tokenizer, tir_problems, tir_warm_start

    model = build_tiny_model(seed=0, tokenizer_dir=build_tir_tokenizer())
    return tir_warm_start(model, tir_problems(512, seed=1, easy_fraction=0.5), tool_fraction=1.0, steps=60,
                          lr=3e-3, seed=0, batch_size=16, progress=False)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.fixture(scope="session")
def prompts(tiny_tokenizer) -> list[list[int]]:
    """Three chat prompts of different lengths (so left padding is exercised)."""
    texts = ["Compute 1+2.", "Compute 47+38-12.", "Compute 3*4+5-6*7."]
    rendered = [tiny_tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                                   add_generation_prompt=True) for t in texts]
    ids = [tiny_tokenizer(r, add_special_tokens=False)["input_ids"] for r in rendered]
    assert len({len(i) for i in ids}) == 3
    return ids


@pytest.fixture(scope="session")
def arithmetic_jsonl(tmp_path_factory):
    """64 synthetic arithmetic prompts as a local jsonl (fields ``prompt`` / ``answer``)."""
    from stapo.tiny import arithmetic_problems

    path = tmp_path_factory.mktemp("data") / "arithmetic.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for p in arithmetic_problems(64, seed=5):
            f.write(json.dumps({"prompt": p.question, "answer": p.answer}) + "\n")
    return path
