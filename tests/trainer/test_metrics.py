"""MetricsLogger: JSONL durability/validity, resume truncation, sinks, console modes."""

import io
import json
import math
import re
import sys
import types
from pathlib import Path

import pytest

from stapo.run_dir import read_metrics
from stapo.telemetry import metrics as metrics_mod
from stapo.telemetry.console import StepClock, format_duration
from stapo.telemetry.metrics import OPTIONAL_METRIC_KEYS, STEP_METRIC_KEYS, MetricsLogger

ANSI = re.compile(r"\x1b\[")


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


def _logger(tmp_path, **kw):
    kw.setdefault("tensorboard", False)
    kw.setdefault("stream", io.StringIO())
    return MetricsLogger(tmp_path, is_main=kw.pop("is_main", True), **kw)


def test_documented_keys_are_the_constant():
    # docs/metrics.md is THE list: every key in STEP_METRIC_KEYS and OPTIONAL_METRIC_KEYS appears in it as `key`.
    doc = (Path(__file__).parents[2] / "docs" / "metrics.md").read_text(encoding="utf-8")
    documented = set(re.findall(r"`([a-z][a-z0-9_]*)`", doc))
    for key in STEP_METRIC_KEYS + OPTIONAL_METRIC_KEYS:
        assert key in documented, key
    assert len(set(STEP_METRIC_KEYS)) == len(STEP_METRIC_KEYS)  # no key listed twice
    assert {"silenced_frac", "spurious_frac", "mask_tau_h", "probe_tau_h", "time_sync"} <= set(STEP_METRIC_KEYS)


def test_log_writes_one_valid_json_line_per_step(tmp_path):
    with _logger(tmp_path) as log:
        log.log(1, {"reward_mean": 0.25, "loss": float("nan"), "grad_norm": float("inf"),
                    "approx_kl": -math.inf, "skipped_steps": 1, "mask": "stapo"})
        log.log(2, {"reward_mean": 0.5, "step": 2})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    first = json.loads(lines[0])  # strict JSON: no bare NaN/Infinity tokens
    assert "NaN" not in lines[0].replace('"NaN"', "")
    assert first == {"step": 1, "reward_mean": 0.25, "loss": "NaN", "grad_norm": "Infinity",
                     "approx_kl": "-Infinity", "skipped_steps": 1, "mask": "stapo"}
    rows = read_metrics(tmp_path)  # dir or file both accepted
    assert math.isnan(rows[0]["loss"]) and rows[0]["grad_norm"] == math.inf
    assert rows[0]["approx_kl"] == -math.inf and rows[1] == {"step": 2, "reward_mean": 0.5}


def test_line_is_on_disk_before_close(tmp_path):
    # flushed + fsync'd per line: a reader sees it while the logger is still open
    log = _logger(tmp_path)
    log.log(7, {"loss": 1.5})
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 7, "loss": 1.5}]
    log.close()
    log.close()  # idempotent
    with pytest.raises(RuntimeError, match="after close"):
        log.log(8, {"loss": 1.0})


def test_tensor_values_and_bad_values(tmp_path):
    torch = pytest.importorskip("torch")
    with _logger(tmp_path) as log:
        log.log(1, {"entropy_mean": torch.tensor(0.5)})
        with pytest.raises(TypeError, match="'bad'"):
            log.log(2, {"bad": [1, 2]})
        with pytest.raises(TypeError, match="'vec' is not a scalar"):
            log.log(2, {"vec": torch.ones(2)})
        with pytest.raises(ValueError, match="disagrees"):
            log.log(3, {"step": 4})
    assert read_metrics(tmp_path) == [{"step": 1, "entropy_mean": 0.5}]


def test_non_main_writes_nothing(tmp_path):
    out = tmp_path / "run"
    stream = io.StringIO()
    with MetricsLogger(out, is_main=False, tensorboard=True, wandb={"project": "x"},
                       total_steps=3, stream=stream) as log:
        log.log(1, {"reward_mean": 1.0})
        log.log_samples(1, [{"prompt": "p", "response": "r", "reward": 1.0, "ground_truth": "1"}])
        assert log.truncate_after(0) == 0
    assert not out.exists() and stream.getvalue() == ""


def test_truncated_last_line_is_tolerated_and_repaired(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "lo')  # SIGKILL mid-write
    assert read_metrics(path) == [{"step": 1, "loss": 1.0}]
    with _logger(tmp_path) as log:  # reopening drops the partial tail before appending
        log.log(2, {"loss": 0.5})
    assert read_metrics(path) == [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 0.5}]
    path.write_text('{"step": 1}\n{"step": 2\n{"step": 3}\n')
    with pytest.raises(ValueError, match="line 2"):
        read_metrics(path)


def test_truncate_after_drops_later_steps_and_keeps_appending(tmp_path):
    sample = {"prompt": "p", "response": "r", "reward": 1.0, "ground_truth": "g",
              "tokens": ["r"], "silenced": [True]}
    with _logger(tmp_path) as log:
        for s in range(1, 6):
            log.log(s, {"loss": float(s), "grad_norm": math.nan})
            log.log_samples(s, [sample])
    # resume from a checkpoint at step 3: steps 4, 5 were logged by the killed run
    with _logger(tmp_path) as log:
        assert log.truncate_after(3) == 2
        log.log(4, {"loss": 40.0})
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[3]["loss"] == 40.0 and math.isnan(rows[2]["grad_norm"])
    for line in (tmp_path / "metrics.jsonl").read_text().splitlines():
        json.loads(line)
    assert not (tmp_path / ".tmp-metrics.jsonl").exists()
    samples = read_metrics(tmp_path / "samples.jsonl")
    assert [r["step"] for r in samples] == [1, 2, 3] and samples[0]["silenced"] == [True]


def test_tensorboard_scalars_and_purge_on_resume(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with _logger(tmp_path, tensorboard=True) as log:
        for s in (1, 2, 3):
            log.log(s, {"reward_mean": s / 10, "mask": "stapo"})
    with _logger(tmp_path, tensorboard=True) as log:
        log.truncate_after(1)
        log.log(2, {"reward_mean": 0.9})
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert acc.Tags()["scalars"] == ["reward_mean"]  # strings are not scalars
    got = [(e.step, round(e.value, 6)) for e in acc.Scalars("reward_mean")]
    assert got == [(1, 0.1), (2, 0.9)]  # steps 2, 3 of the killed run were purged


def test_wandb_missing_warns_once_and_does_not_crash(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with caplog.at_level("WARNING"):
        with _logger(tmp_path, wandb={"project": "p"}) as log:
            log.log(1, {"loss": 1.0})
            log.log(2, {"loss": 1.0})
    assert sum("wandb" in r.message for r in caplog.records) == 1
    assert len(read_metrics(tmp_path)) == 2


def test_wandb_receives_numeric_metrics(tmp_path, monkeypatch):
    calls = []
    run = types.SimpleNamespace(finish=lambda: calls.append(("finish",)))
    fake = types.SimpleNamespace(init=lambda **kw: calls.append(("init", kw)) or run,
                                 log=lambda d, step: calls.append(("log", d, step)))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    with _logger(tmp_path, wandb={"project": "p"}) as log:
        log.log(3, {"loss": 2.0, "grad_norm": math.inf, "mask": "stapo"})
    assert calls[0] == ("init", {"project": "p", "dir": str(tmp_path)})
    assert calls[1] == ("log", {"loss": 2.0, "grad_norm": math.inf}, 3)
    assert calls[2] == ("finish",)


def test_plain_console_lines_have_no_control_characters(tmp_path):
    stream = io.StringIO()
    with _logger(tmp_path, stream=stream, total_steps=3, plain_interval_s=1e9) as log:
        for s in (1, 2, 3):
            log.log(s, {"reward_mean": 0.5, "accuracy": 0.75, "entropy_mean": 0.123456,
                        "silenced_frac": 0.0001, "time_step": 2.0})
    lines = stream.getvalue().splitlines()
    # first step, then nothing until the interval passes, then the last step; the ETA after step 1
    # is its 2 s step time x the 2 steps left = 4 s (the last step has none)
    assert lines == [
        "step 1/3 | reward 0.5 | acc 0.75 | entropy 0.1235 | silenced 0.010% | step_time 2.00s | eta 4s",
        "step 3/3 | reward 0.5 | acc 0.75 | entropy 0.1235 | silenced 0.010% | step_time 2.00s",
    ]
    assert not ANSI.search(stream.getvalue()) and "\r" not in stream.getvalue()


def test_every_evaluation_reaches_the_plain_console(tmp_path):
    stream = io.StringIO()
    with _logger(tmp_path, stream=stream, total_steps=4, plain_interval_s=1e9) as log:
        log.log(0, {"eval_accuracy": 0.25, "eval_reward_mean": -0.5, "eval_response_length_mean": 12.5})
        for s in (1, 2, 3, 4):
            log.log(s, {"reward_mean": 0.5, "time_step": 1.0, **({"eval_accuracy": 0.5} if s == 2 else {})})
    lines = stream.getvalue().splitlines()
    assert lines[0] == "step 0/4 | held-out acc 0.25 | held-out length 12.5"  # before training: no ETA yet
    assert [line.split(" |")[0] for line in lines] == ["step 0/4", "step 1/4", "step 2/4", "step 4/4"]
    assert "held-out acc 0.5" in lines[2] and "eta " in lines[2]


def test_eta_is_the_mean_wall_time_per_step_times_the_steps_left():
    clock = StepClock()
    assert clock.eta(5, 10, {"eval_accuracy": 0.5}, now=100.0) is None  # an evaluation row: no step timed yet
    assert clock.eta(6, 10, {"time_step": 4.0}, now=104.0) == 16.0  # step 6 started at 100: 4 s x 4 left
    assert clock.eta(8, 10, {"time_step": 3.0}, now=115.0) == 10.0  # 15 s for steps 6-8: 5 s x 2 left
    assert clock.eta(10, 10, {"time_step": 3.0}, now=120.0) is None
    assert [format_duration(s) for s in (4.4, 65, 3725)] == ["4s", "1m05s", "1h02m"]


def test_tty_console_uses_a_progress_bar(tmp_path):
    stream = FakeTTY()
    with _logger(tmp_path, stream=stream, total_steps=4) as log:
        log.log(1, {"reward_mean": 0.5, "silenced_frac": 0.0002})
    out = stream.getvalue()
    assert ANSI.search(out) and "1/4" in out and "silenced 0.020%" in out


def test_log_samples_plain_marks_silenced_tokens(tmp_path):
    stream = io.StringIO()
    sample = {"prompt": "1+1?", "response": "It is 2", "reward": 1.0, "ground_truth": "2",
              "tokens": ["It", " is", " 2"], "silenced": [False, True, False]}
    with _logger(tmp_path, stream=stream) as log:
        log.log_samples(5, [sample, {**sample, "reward": -1.0}])
        with pytest.raises(ValueError, match="misses keys"):
            log.log_samples(5, [{"prompt": "p"}])
        with pytest.raises(ValueError, match="different lengths"):
            log.log_samples(5, [{**sample, "silenced": [True]}])
    assert "response: It[[ is]] 2" in stream.getvalue()
    assert not ANSI.search(stream.getvalue())
    rows = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [r["reward"] for r in rows] == [1.0, -1.0]
    assert rows[0]["step"] == 5 and rows[0]["silenced"] == [False, True, False]


def test_log_samples_tty_highlights_with_rich(tmp_path):
    stream = FakeTTY()
    sample = {"prompt": "p", "response": "a [b]", "reward": 1.0, "ground_truth": "x",
              "tokens": ["a", " [b]"], "silenced": [False, True]}
    with _logger(tmp_path, stream=stream) as log:
        log.log_samples(1, [sample])
    out = stream.getvalue()
    assert "[b]" in out  # escaped: the token's brackets are not taken as rich markup
    assert "[[" not in out and ANSI.search(out)


def test_the_sync_metrics_are_rank_0s_broadcast():
    # rollout servers, rollout.server.sync=delta, 2 ranks: rank 0 sent 1 MiB of a 4 MiB sync, 10 of 1,000 words changed;
    # rank 1 only took part in the gathers (its engine sends nothing). sync_mb is per rank: 4 MiB each.
    from stapo.sync.buckets import SyncStats
    from stapo.sync.weight_delta import TransferStats
    from stapo.telemetry.step_metrics import StepSums, sync_metrics

    ranks = [StepSums(), StepSums()]
    ranks[0].add_sync(SyncStats(2, 5, 4 * 2**20, 0.5, TransferStats(2**20, 4 * 2**20, 10, 1000)), server=True,
                      delta=True)
    ranks[1].add_sync(SyncStats(2, 5, 4 * 2**20, 0.5), server=True, delta=True)
    summed = {k: ranks[0][k] + ranks[1][k] for k in ranks[0]}
    assert summed["sync_mb"] == 8.0 and sync_metrics(summed) == {"sync_sent_mb": 1.0, "sync_changed_frac": 0.01}
    failed = StepSums()
    failed.add_sync(None, server=True, delta=True)  # the sync failed for good: nothing sent, nothing compared
    assert sync_metrics(failed)["sync_sent_mb"] == 0.0 and math.isnan(sync_metrics(failed)["sync_changed_frac"])
    full = StepSums()
    full.add_sync(SyncStats(2, 5, 4 * 2**20, 0.5, TransferStats(4 * 2**20, 4 * 2**20)), server=True)
    assert sync_metrics(full) == {"sync_sent_mb": 4.0}  # rollout.server.sync=full: no changed fraction
    colocated = StepSums()
    colocated.add_sync(SyncStats(2, 5, 4 * 2**20, 0.5))
    assert colocated == {"sync_mb": 4.0} and sync_metrics(colocated) == {}
