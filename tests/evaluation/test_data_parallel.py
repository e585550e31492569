"""`stapo eval` under torchrun: each rank samples every world_size-th chunk with its own engine (the
real HF engine here, 2 gloo ranks) and the ranks exchange chunks, so the report equals the
one-process run's, response for response; rank 0 alone writes it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

ARGS = ["--engine", "hf", "--samples", "2", "--max-new-tokens", "6", "--settings", "train", "--batch-rows", "6",
        "--seed", "4"]  # 3 problems per call: 10 problems -> 4 chunks, 2 per rank


def _eval(model, data, out, launcher=()):
    cmd = [*launcher, "-m", "stapo.cli", "eval", str(model), "--data", data, "--out", str(out), *ARGS]
    done = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_two_ranks_report_what_one_process_reports(tiny_model_dir, write_jsonl, tmp_path):
    from stapo.tiny import arithmetic_problems

    data = write_jsonl(tmp_path / "arith.jsonl", [{"problem": p.question, "answer": p.answer}
                                                  for p in arithmetic_problems(10, seed=8)])
    _eval(tiny_model_dir, data, tmp_path / "one")
    ranks = _eval(tiny_model_dir, data, tmp_path / "two",
                  launcher=("-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"))
    assert ranks.stdout.count("written: ") == 1  # rank 0 prints and writes, rank 1 only samples
    assert "(rank 0: 6/6)" in ranks.stderr and "(rank 1: 4/4)" in ranks.stderr  # chunks 0, 2 and 1, 3
    one = [json.loads(line) for line in (tmp_path / "one" / "samples.jsonl").open()]
    two = [json.loads(line) for line in (tmp_path / "two" / "samples.jsonl").open()]
    assert len(one) == 10 and one == two and len({str(r["responses"]) for r in one}) == 10
    one, two = (json.loads((tmp_path / d / "results.json").read_text()) for d in ("one", "two"))
    assert one["results"] == two["results"] and one["average"] == two["average"]


def test_tensor_parallel_needs_vllm_and_one_process(tiny_model_dir, arithmetic_file, tmp_path, monkeypatch):
    from stapo.evaluation import evaluate_model, local_benchmark
    from stapo.evaluation.runner import _join_ranks

    with pytest.raises(ValueError, match="tensor_parallel_size 2 needs the vllm engine, got hf"):
        evaluate_model(tiny_model_dir, [local_benchmark(arithmetic_file)], engine="hf", tensor_parallel_size=2,
                       num_samples=1, max_new_tokens=2)
    monkeypatch.setenv("WORLD_SIZE", "2")  # as under torchrun: refused before any process group is joined
    with pytest.raises(ValueError, match="tensor_parallel_size 2 under a launcher with 2 ranks.*not both"):
        _join_ranks(2)
