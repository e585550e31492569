"""bench/gpu_window.sh on CPU: its plan, a part cut at its budget while the next still runs, and the summaries."""

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import _gpu_window as window  # noqa: E402
from _gpu_window import Part, run_part, run_window, summarize_pytest, summarize_step, summarize_train  # noqa: E402


def _plan(*args):
    return subprocess.run(["bash", str(ROOT / "bench" / "gpu_window.sh"), "--plan", *args], capture_output=True,
                          text=True, timeout=60, env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"})


def test_plan_lists_every_part_within_nine_minutes():
    proc = _plan()
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "GPU window: 6 parts, 530 s of budgets (a window is 540 s)"
    parts = [line.split()[0] for line in lines[1:] if not line.lstrip().startswith("$")]
    assert parts == ["install", "check", "step_0p6b", "step_1p7b", "pytest_gpu", "train"]
    commands = [line.strip()[2:] for line in lines if line.lstrip().startswith("$")]
    assert "--shape qwen3_0p6b" in commands[2] and "--shape qwen3_1p7b" in commands[3]
    assert "--attn sdpa,auto --zero 1 " in commands[2] and "--attn auto --zero 3 " in commands[3]
    assert all("--vocab" not in c for c in commands[2:4])  # the real vocabulary
    assert "-m gpu" in commands[4] and "rollout.engine=vllm" in commands[5] and "trainer.total_steps=3" in commands[5]
    changed = _plan("--budget", "train=200", "--skip", "install")
    assert changed.stdout.splitlines()[0] == "GPU window: 5 parts, 510 s of budgets (a window is 540 s)"
    over = _plan("--budget", "train=400").stdout.splitlines()
    assert over[0].startswith("GPU window: 6 parts, 770 s") and over[-1].startswith("note: the budgets exceed")
    bad = _plan("--budget", "trian=200")
    assert bad.returncode == 2 and "--budget trian=200: expected PART=SECONDS with PART one of install" in bad.stderr


def test_run_part_statuses_and_cut_of_the_whole_process_group(tmp_path):
    log = tmp_path / "part.log"
    assert run_part("echo hello", 10, log, env_file=None)[0] == "ok" and log.read_text() == "hello\n"
    assert run_part("exit 3", 10, log, env_file=None)[0] == "failed (exit 3)"
    start = time.monotonic()
    status, seconds = run_part(f"sleep 30 & echo $! > {tmp_path}/child; wait", 1, log, env_file=None)
    assert status == "cut at 1 s" and 1 <= seconds < 5 and time.monotonic() - start < 5
    child = int((tmp_path / "child").read_text())
    time.sleep(0.2)
    assert not Path(f"/proc/{child}").exists() or "zombie" in Path(f"/proc/{child}/status").read_text().lower()


def test_a_slow_part_is_cut_and_the_window_goes_on(tmp_path, monkeypatch):
    monkeypatch.setattr(window, "BUNDLE_ENV", tmp_path / "no-env.sh")
    parts = [Part("first", 5, "", "echo one"), Part("slow", 1, "", "echo started; sleep 30"),
             Part("last", 5, "", "echo three")]
    assert run_window(parts, {"first": 5, "slow": 1, "last": 5}, tmp_path) == 1  # not everything ok
    results = json.loads((tmp_path / "window.json").read_text())["parts"]
    assert [(r["part"], r["status"], r["result"]) for r in results] == [
        ("first", "ok", "one"), ("slow", "cut at 1 s", "started"), ("last", "ok", "three")]
    table = (tmp_path / "window.md").read_text().splitlines()
    assert table[0] == "| part | status | s | budget s | result |" and table[3].startswith("| slow | cut at 1 s |")


def test_summaries_of_cut_and_finished_parts(tmp_path):
    log = ("tests/gpu/test_attention_gpu.py::test_flex_forward_and_backward_on_packed_rows_equal_sdpa PASSED [ 50%]\n"
           "tests/gpu/test_attention_gpu.py::test_flash_forward_and_backward_on_packed_rows_equal_sdpa SKIPPED (x)\n"
           "tests/gpu/test_x.py::test_y FAILED [100%]\n")
    assert summarize_pytest(log) == "1 passed, 1 skipped, 1 failed (test_y)"
    assert summarize_pytest("collecting ...") == "no test finished"
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1, "loss": 0.1, "time_step": 10.0}\n{"step": 2, "loss": 0.2, "time_step": 20.0, '
                       '"mismatch_logp_abs_mean": 0.0123}\n')
    vllm = ("INFO gpu_worker.py:1 Sleep mode freed 41.80 GiB memory, 1.20 GiB memory is still in use.\n"
            "INFO abstract.py:2 It took 0.021000 seconds to wake up tags ['weights'].\n")
    assert summarize_train(vllm, metrics) == ("2 of 3 steps, 15.0 s a step, mismatch 0.0123, sleep frees up to 41.8 GiB, "
                                              "wake <= 0.02 s")
    # a bench cut after one configuration: the JSON has raw rows only; the summary derives the rest
    data = {"tokens": 1000, "response_tokens": 800, "forward_flops": 1e12, "peak": 989.4e12, "head_stats_s": 0.5,
            "head_update_s": 2.0, "head_flop_share": 0.22, "head_flop_share_update_executed": 0.27,
            "rows": [{"layout": "packed", "cut": "16384 tokens", "zero": 1, "attn": "sdpa", "stats_s": 1.0,
                      "update_s": 4.0, "micro_batches": 12.0, "peak_gib": 20.0},
                     {"layout": "packed", "cut": "16384 tokens", "zero": 3, "attn": "sdpa", "error": "out of memory: x"}]}
    (tmp_path / "step.json").write_text(json.dumps(data))
    result, table = summarize_step(tmp_path / "step.json")
    # update MFU = 3 x 1e12 FLOPs / (4 s x 989.4e12 FLOP/s) = 0.076%; the head took 2 of the update's 4 s
    assert result == "sdpa ZeRO-1: update MFU 0.1%, head 50% of the update, 20 GiB; sdpa ZeRO-3: out of memory: x"
    assert "| sdpa | packed | 16384 tokens | 3 | out of memory: x |" in table
    assert summarize_step(tmp_path / "missing.json") == ("no configuration finished", "")
