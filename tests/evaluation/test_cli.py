"""`stapo eval` end to end on the tiny model + a local file, and its one-line user errors."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest

from stapo.evaluation import add_arguments, run_cli
from stapo.rewards import math_reward


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="stapo eval")
    add_arguments(parser)
    return parser.parse_args(argv)


def test_run_cli_writes_markdown_and_json(tiny_model_dir, arithmetic_file, tmp_path, capsys):
    model = shutil.copytree(tiny_model_dir, tmp_path / "model")  # results go to MODEL/eval by default
    args = parse([str(model), "--data", arithmetic_file, "--samples", "2", "--max-new-tokens", "6",
                  "--engine", "hf", "--settings", "train", "--pass-k", "1", "2", "--cache-dir", str(tmp_path / "hf")])
    assert run_cli(args) == 0
    printed = capsys.readouterr().out
    out = model / "eval"
    table = (out / "results.md").read_text()
    assert table in printed
    assert "| arith | 2 | 4 |" in table and "**average**" in table and "pass@2" in table

    data = json.loads((out / "results.json").read_text())
    assert data["model"] == str(model) and data["engine"] == "hf" and data["max_new_tokens"] == 6
    assert data["settings"] == [{"name": "train", "temperature": 1.0, "top_p": 1.0}]
    (result,) = data["results"]
    assert result["num_samples"] == 2 and result["num_problems"] == 4
    # per-problem counts, avg@N and pass@1 equal a direct count of the written generations, re-scored
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [s["index"] for s in samples] == [0, 1, 2, 3]
    counts = [sum(math_reward(r, s["ground_truth"]) == 1.0 for r in s["responses"]) for s in samples]
    assert [p["correct"] for p in result["per_problem"]] == counts
    assert result["avg_at_n"] == pytest.approx(sum(counts) / 8)
    assert result["pass_at_k"]["1"] == pytest.approx(result["avg_at_n"])
    assert data["average"]["train"]["avg_at_n"] == pytest.approx(result["avg_at_n"])
    assert all(len(s["responses"]) == 2 for s in samples)


def test_stapo_parser_wires_eval():
    from stapo.cli import build_parser

    args = build_parser().parse_args(["eval", "m", "--benchmark", "aime24", "--samples", "3", "--settings", "justrl"])
    assert (args.model, args.benchmark, args.samples, args.settings) == ("m", ["aime24"], 3, "justrl")


@pytest.mark.parametrize("argv, error, pattern", [
    (["{missing}"], FileNotFoundError, "no such model directory"),
    (["{model}", "--benchmark", "gsm8k"], ValueError, "unknown benchmark 'gsm8k'; available: aime24, aime25"),
    (["{model}", "--data", "nope=x.jsonl"], ValueError, "unknown benchmark 'nope'"),
    (["{model}", "--data", "{tmp}/absent.jsonl"], FileNotFoundError, "--data: no such file"),
    (["{model}", "--prompt-field", "q"], ValueError, "apply to --data files"),
    (["{model}", "--samples", "0"], ValueError, "--samples must be >= 1"),
    (["{model}", "--data", "{data}", "--answer-field", "solution"], ValueError, "missing column 'solution'"),
    (["{model}", "--data", "{data}", "--tools", "calculator,web"], ValueError, "unknown tool 'web'.*calculator"),
    (["{model}", "--data", "{data}", "--tools", "calculator", "--tool-parser", "xml"], ValueError, "'xml'"),
    (["{model}", "--data", "{data}", "--tools", "calculator", "--max-turns", "0"], ValueError, "--max-turns must be"),
])
def test_user_mistakes_are_one_line(argv, error, pattern, tiny_model_dir, arithmetic_file, tmp_path):
    fill = {"missing": str(tmp_path / "no_model"), "model": str(tiny_model_dir), "tmp": str(tmp_path),
            "data": arithmetic_file}
    args = parse([a.format(**fill) for a in argv] + ["--cache-dir", str(tmp_path / "hf"), "--out", str(tmp_path)])
    with pytest.raises(error, match=pattern) as err:
        run_cli(args)
    assert "\n" not in str(err.value)


def test_offline_hub_preset_via_run_cli(monkeypatch, tiny_model_dir, tmp_path):
    import datasets

    def offline(path, *args, **kwargs):
        raise ConnectionError(f"Couldn't reach '{path}' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(ValueError) as err:
        run_cli(parse([str(tiny_model_dir), "--benchmark", "math500", "--out", str(tmp_path)]))
    assert str(err.value).startswith("could not load HuggingFaceH4/MATH-500 (offline?): pass a local file "
                                     "with --data math500=FILE")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "results.json").exists()


def test_vllm_engine_without_vllm_is_a_clear_error(tiny_model_dir, arithmetic_file, tmp_path, monkeypatch):
    from stapo.rollout import registry

    monkeypatch.setattr(registry, "vllm_installed", lambda: False)
    args = parse([str(tiny_model_dir), "--data", arithmetic_file, "--engine", "vllm", "--out", str(tmp_path),
                  "--cache-dir", str(tmp_path / "hf")])
    with pytest.raises(ValueError, match="vllm rollout engine needs vLLM"):
        run_cli(args)


def test_reward_options_parse_and_are_checked(tiny_model_dir, tmp_path):
    args = parse(["m", "--reward-function", "my.py:score", "--reward-function-batched", "--reward-timeout", "2"])
    assert (args.reward_function, args.reward_function_batched, args.reward_timeout) == ("my.py:score", True, 2.0)
    assert parse(["m", "--reward-mode", "dapo_boxed"]).reward_mode == "dapo_boxed"
    with pytest.raises(SystemExit):
        parse(["m", "--reward-mode", "bogus"])
    with pytest.raises(ValueError, match="--reward-function-batched needs --reward-function"):
        run_cli(parse([str(tiny_model_dir), "--reward-function-batched", "--out", str(tmp_path)]))


def test_dry_run_checks_and_plans_without_sampling(tiny_model_dir, arithmetic_file, tmp_path, capsys):
    model = shutil.copytree(tiny_model_dir, tmp_path / "model")
    args = parse([str(model), "--benchmark", "aime24", "--data", arithmetic_file, "--samples", "2",
                  "--engine", "hf", "--settings", "train", "--dry-run"])
    assert run_cli(args) == 0
    out = capsys.readouterr().out
    assert "aime24: HuggingFaceH4/aime_2024 (hub dataset, downloaded at start), N = 2" in out
    assert f"arith: {arithmetic_file} (local file), N = 2" in out and "engine: hf\n" in out
    assert not (model / "eval").exists()  # nothing sampled, nothing written
    with pytest.raises(ValueError, match="unknown benchmark 'gsm8k'"):
        run_cli(parse([str(model), "--benchmark", "gsm8k", "--dry-run"]))
    example = Path(__file__).resolve().parents[2] / "examples" / "reward_function.py"
    with pytest.raises(ValueError, match="could not be loaded: .*has no attribute 'nope'"):
        run_cli(parse([str(model), "--reward-function", f"{example}:nope", "--dry-run"]))


def test_tool_episodes_are_judged_on_their_final_turn_with_the_tool_metrics_beside(tir_model_dir, write_jsonl,
                                                                                   tmp_path, capsys):
    """`stapo eval --tools`: the trainer's episodes (prompts offering the tools, the calculator run, the final
    turn judged) on the tiny TIR model, with tool calls and errors per episode in the table and the JSON."""
    from stapo.tiny.tir import tir_problems

    data = write_jsonl(tmp_path / "tir.jsonl", [{"problem": p.question, "answer": p.answer}
                                                for p in tir_problems(6, seed=5)])
    model = shutil.copytree(tir_model_dir, tmp_path / "model")
    assert run_cli(parse([str(model), "--data", data, "--tools", "calculator", "--max-turns", "2", "--settings",
                          "greedy", "--samples", "1", "--max-new-tokens", "64", "--engine", "hf",
                          "--cache-dir", str(tmp_path / "hf")])) == 0
    assert "| tool calls / episode | tool errors / episode |" in capsys.readouterr().out
    (result,) = json.loads((model / "eval" / "results.json").read_text())["results"]
    samples = [json.loads(line) for line in (model / "eval" / "samples.jsonl").read_text().splitlines()]
    called = [s for s in samples if "<tool_response>" in s["responses"][0]]
    assert called and result["tool_calls_mean"] >= len(called) / 6 and "tool_errors_mean" in result
    for s in called:  # the whole episode is written; the verdict is the final turn's (after the tool turn)
        final = s["responses"][0].rsplit("assistant\n", 1)[-1]
        assert s["correct"] == [math_reward(final, s["ground_truth"]) == 1.0]
