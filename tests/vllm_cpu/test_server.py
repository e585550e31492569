"""rollout.mode=server against REAL vLLM server processes (`stapo serve`, vLLM's CPU build, loopback):
the same samples as the in-process engine, weights broadcast into the servers (mismatch after every
sync), asynchronous training (max_staleness=1), resume, and servers that die (docs/rollout.md).

Two servers (conftest's ``servers``) are shared by the lane; the fault tests come last and kill / restart
them."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _bounds import STALE_SYNC_MIN, assert_fp32_noise, assert_like_colocated, report
from _servers import servers_override
from conftest import FP32_LOGPROB_BOUND, HERE, LANE_TOKEN, ROOT, plain_env
from test_vllm_server_delta import teacher_forced as served_logprobs
from test_vllm_server_delta import trainer_logprobs
from test_train import COMMON, samples_of, train

from stapo.rollout import SamplingParams, VLLMEngine, generate
from stapo.run_dir import METRICS_FILE, latest_checkpoint, read_metrics, step_of
from stapo.servers.engine import ServerEngine
from stapo.telemetry.metrics import training_metrics

sys.path.insert(0, str(HERE.parent / "rollout"))
from _rollout_utils import teacher_forced  # noqa: E402

pytestmark = pytest.mark.timeout(2400)
SERVER = ["rollout.mode=server", "trainer.save_every=1", "trainer.keep_last=4"]


def engine_core_processes() -> set[int]:
    """The live vLLM engine-core processes this process started."""
    children = set()
    for task in Path("/proc/self/task").iterdir():
        children |= {int(pid) for pid in _read(f"{task}/children").split()}  # a thread may end meanwhile
    return {pid for pid in children if "EngineCore" in _read(f"/proc/{pid}/cmdline")
            and _read(f"/proc/{pid}/stat").rpartition(")")[2].split()[:1] != ["Z"]}


def _read(path: str) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:  # gone meanwhile
        return ""


@pytest.fixture(scope="module")
def k0_run(servers, warm_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("server_k0") / "run"
    return out, train(out, warm_model_dir, *SERVER, servers_override(*servers), "trainer.total_steps=4")


def test_server_and_in_process_engines_give_the_same_samples(servers, warm_model_dir, prompts):
    from transformers import AutoModelForCausalLM

    from stapo.sync.buckets import sync_weights

    # same weights (the warm model, loaded in-process and broadcast into the server, which other tests of the
    # session may have trained), same seed: the same rows
    remote_engine = ServerEngine([servers[0].address], pad_token_id=0, token=LANE_TOKEN)
    warm = AutoModelForCausalLM.from_pretrained(str(warm_model_dir), dtype=torch.float32)
    sync_weights(warm, remote_engine, bucket_bytes=2**20, version=0)
    sampling = SamplingParams(temperature=1.0, top_k=20, max_new_tokens=24, seed=5)
    remote = generate(remote_engine, prompts, 4, sampling)
    before = engine_core_processes()
    local_engine = VLLMEngine(warm_model_dir, dtype="float32", max_model_len=512, enforce_eager=True)
    started = engine_core_processes() - before
    local = generate(local_engine, prompts, 4, sampling)
    local_engine.close()  # its engine-core process stops now, not at the interpreter's exit
    assert started and not started & engine_core_processes(), started
    with pytest.raises(RuntimeError, match="generation after VLLMEngine.close"):
        generate(local_engine, prompts, 1, sampling)
    assert torch.equal(remote.response_ids, local.response_ids)
    assert remote.finish_reason == local.finish_reason
    # the same tokens: against the trainer's recompute of them, the server path's log-probs are the colocated
    # engine's (the same kernels on one CPU), and those are the kernels' noise
    trainer, mask = teacher_forced(warm, local, temperature=1.0, top_k=20), local.response_mask
    colocated = float((local.sampling_logprobs - trainer)[mask].abs().max())
    server = float((remote.sampling_logprobs - trainer)[mask].abs().max())
    report("same samples: server vs colocated engine, max |difference| of their log-probs",
           float((remote.sampling_logprobs - local.sampling_logprobs).abs().max()))
    report(f"same samples: server vs the trainer (colocated engine vs the trainer {colocated:.3g})", server)
    assert_fp32_noise(colocated, "the colocated engine vs the trainer")
    assert_like_colocated(server, colocated, "the server vs the trainer")


def same_samples(out, ref_out, row: dict, ref: dict) -> bool:
    """Two runs of one config sampled the same batch at ``row``'s step: the logged samples, the mean length and
    reward of all responses agree (the samples file keeps two responses a step)."""
    keys = ("reward_mean", "response_length_mean")
    return samples_of(out, row["step"]) == samples_of(ref_out, ref["step"]) and all(row[k] == ref[k] for k in keys)


def assert_mismatch_like_colocated(out, steps, colocated_run, what: str) -> None:
    """Each step's mismatch is the kernels' noise; where the server run sampled what the colocated run (the same
    config, model, prompts and seeds; test_train.py) sampled, it is the colocated engine's figure."""
    ref_out, reference = colocated_run
    for row, ref in zip(steps, reference, strict=True):
        figure, step = row["mismatch_logp_abs_max"], row["step"]
        same = same_samples(out, ref_out, row, ref)
        report(f"{what}, step {step}: mismatch max (colocated {ref['mismatch_logp_abs_max']:.3g}"
               f"{', same samples' if same else ', other samples'})", figure)
        assert_fp32_noise(figure, f"{what}, step {step}")
        if same:
            assert_like_colocated(figure, ref["mismatch_logp_abs_max"], f"{what}, step {step}")


def test_weights_reach_the_servers_after_every_sync(k0_run, colocated_run, servers, warm_model_dir, prompts):
    from transformers import AutoModelForCausalLM

    out, steps = k0_run
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert all(r["policy_staleness"] == 0 for r in steps)
    # step 1 samples the start sync, steps 2-4 the sync after each update
    assert_mismatch_like_colocated(out, steps, colocated_run, "server run")
    versions = ServerEngine([s.address for s in servers], pad_token_id=0, sends_weights=False,
                            token=LANE_TOKEN).policy_versions()
    assert versions == {s.address: [4] for s in servers}  # each server reports the policy it holds
    # ... and serves it: its teacher-forced log-probs are the run's final weights', not the start weights'
    ids = prompts[0] + prompts[2]
    final, start = (trainer_logprobs(AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32), ids)
                    for path in (out / "final", warm_model_dir))
    for server in servers:
        served = torch.tensor(served_logprobs(server, ids))
        to_final, to_start = float((served - final).abs().max()), float((served - start).abs().max())
        report(f"server {server.address} vs the final weights (vs the start weights {to_start:.3g})", to_final)
        assert_fp32_noise(to_final, f"server {server.address} against the run's final weights")
        assert to_start > FP32_LOGPROB_BOUND, to_start  # the start weights would fail the same check


def test_server_mode_resumes_to_the_same_metrics(k0_run, servers, warm_model_dir, tmp_path):
    out, steps = k0_run
    resumed = tmp_path / "run"
    train(resumed, warm_model_dir, *SERVER, servers_override(*servers), "trainer.total_steps=2")
    (resumed / "checkpoints").joinpath("latest").write_text("step_1")  # as if killed during step 2
    again = train(resumed, warm_model_dir, *SERVER, servers_override(*servers), "trainer.total_steps=3",
                  "trainer.resume=auto")
    assert [r["step"] for r in again] == [1, 2, 3]
    for step in (2, 3):
        assert samples_of(resumed, step) == samples_of(out, step)
        here = training_metrics(next(r for r in again if r["step"] == step))
        ref = training_metrics(next(r for r in steps if r["step"] == step))
        assert {k: here[k] for k in ("reward_mean", "response_length_mean", "loss", "grad_norm")} == \
               {k: ref[k] for k in ("reward_mean", "response_length_mean", "loss", "grad_norm")}


def test_asynchronous_training_is_at_most_one_version_behind_and_resumes(servers, warm_model_dir, tmp_path):
    out = tmp_path / "k1"
    steps = train(out, warm_model_dir, *SERVER, servers_override(*servers), "rollout.max_staleness=1",
                  "trainer.total_steps=3")
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert [r["policy_staleness"] for r in steps] == [0, 1, 1]  # batch 1 came from the start weights
    # batch 1 was sampled by the weights it trains: the numerical floor; batches 2-3 one update behind, which
    # the mismatch metric now measures too (docs/algorithm.md, "Asynchronous training"; an update whose
    # groups all had equal rewards moves nothing, so not every stale batch need show it)
    assert_fp32_noise(steps[0]["mismatch_logp_abs_max"], "asynchronous run, step 1")
    stale = max(r["mismatch_logp_abs_max"] for r in steps[1:])
    report("asynchronous run, steps 2-3 (one update behind): mismatch max", stale)
    assert stale >= STALE_SYNC_MIN and max(r["mismatch_logp_abs_mean"] for r in steps[1:]) > FP32_LOGPROB_BOUND, steps
    # ... and token-level IS corrects it by default (loss.rollout_is=auto with k >= 1; docs/losses.md)
    assert all("rollout_is_eff_sample_size" in r and r["rejected_frac"] == 0.0 for r in steps), steps
    largest = max(r["rollout_is_max"] for r in steps[1:])
    assert steps[0]["rollout_is_max"] < 1.0 + 2 * FP32_LOGPROB_BOUND < largest, steps
    # killed after step 1's checkpoint: the batch generated ahead is regenerated, no trained step is lost
    (out / "checkpoints").joinpath("latest").write_text("step_1")
    proc = subprocess.run([sys.executable, "-m", "stapo.cli", "train", f"model.path={warm_model_dir}",
                           f"trainer.output_dir={out}", *COMMON, *SERVER, servers_override(*servers),
                           "rollout.max_staleness=1", "trainer.total_steps=3", "trainer.resume=auto"],
                          cwd=ROOT, env=plain_env(), capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rollout batches generated ahead of step 1" in proc.stderr
    assert [r["step"] for r in read_metrics(out / METRICS_FILE) if "loss" in r] == [1, 2, 3]


def _train_until_step(out, model_dir, step: int, *overrides: str) -> subprocess.Popen:
    """Start a run in the background; return once its metrics show ``step``."""
    cmd = [sys.executable, "-m", "stapo.cli", "train", f"model.path={model_dir}", f"trainer.output_dir={out}",
           *COMMON, *SERVER, *overrides]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=plain_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 1200
    while time.monotonic() < deadline and proc.poll() is None:
        if (out / METRICS_FILE).exists() and any(r.get("step") == step and "loss" in r
                                                 for r in read_metrics(out / METRICS_FILE)):
            return proc
        time.sleep(0.5)
    proc.kill()
    raise AssertionError(f"the run did not reach step {step}:\n{proc.communicate()[1][-3000:]}")


def test_a_server_killed_mid_run_leaves_its_requests_to_the_other(servers, colocated_run, warm_model_dir, tmp_path):
    out = tmp_path / "killed"
    proc = _train_until_step(out, warm_model_dir, 1, servers_override(*servers), "trainer.total_steps=4")
    segments = servers[1].kill()
    # the harness found the killed server's vLLM ring buffers and removed them (vLLM leaves them on a SIGKILL)
    assert segments and not any(path.exists() for path in segments), segments
    _, stderr = proc.communicate(timeout=1800)
    assert proc.returncode == 0, stderr[-3000:]
    assert f"rollout server {servers[1].address} is down" in stderr
    steps = [r for r in read_metrics(out / METRICS_FILE) if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert_mismatch_like_colocated(out, steps, colocated_run, "run with a server killed")


def test_a_restarted_server_is_resynced_before_it_serves(servers, warm_model_dir, prompts):
    from transformers import AutoModelForCausalLM

    from stapo.sync.buckets import sync_weights

    model = AutoModelForCausalLM.from_pretrained(str(warm_model_dir), dtype=torch.float32)
    servers[1].ensure_running()  # killed by the test above
    engine = ServerEngine([s.address for s in servers], pad_token_id=0, token=LANE_TOKEN)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8, seed=1)
    sync_weights(model, engine, bucket_bytes=2**20, version=11)
    servers[1].kill()
    generate(engine, prompts, 2, sampling)  # the dead server is found and left out
    assert [c.address for c in engine.pool.live] == [servers[0].address]
    servers[1].start().wait_ready()  # restarted: it holds the weights it loaded, not version 11
    generate(engine, prompts, 2, sampling)
    assert [c.address for c in engine.pool.live] == [servers[0].address]  # never serves stale weights
    sync_weights(model, engine, bucket_bytes=2**20, version=12)  # the next sync takes it back
    assert engine.policy_versions() == {s.address: [12] for s in servers}
    assert len(engine.pool.live) == 2


def test_the_run_checkpoints_and_stops_when_no_server_is_left(servers, warm_model_dir, tmp_path):
    out = tmp_path / "none_left"
    servers[1].ensure_running()
    proc = _train_until_step(out, warm_model_dir, 1, servers_override(servers[1]), "trainer.total_steps=4")
    servers[1].kill()
    killed = time.monotonic()
    _, stderr = proc.communicate(timeout=1800)
    stopped_after_s = time.monotonic() - killed
    assert proc.returncode != 0
    # killed during a generation or a sync ("no rollout server is left"), or before a sync ("... answers at the
    # weight sync"); during the sync's group formation it once cost the sync's whole timeout (300 s), found by CI
    assert ("no rollout server is left" in stderr or "no rollout server answers at the weight sync" in stderr) \
        and "Traceback" not in stderr, stderr[-3000:]
    assert stopped_after_s < 180, (stopped_after_s, stderr[-3000:])
    # killed during step 2's generation (checkpoint step_1) or, on a fast machine, after it (step 2's update
    # done, its sync finds no server: checkpoint step_2); either way the trained steps are kept, and
    # every step the checkpoint holds has its metrics row
    kept = step_of(latest_checkpoint(out))
    assert kept in (1, 2)
    assert [r["step"] for r in read_metrics(out / METRICS_FILE) if "loss" in r] == list(range(1, kept + 1))


def test_a_server_that_does_not_answer_at_start_is_named(servers):
    servers[1].kill()  # down already after the test above; killed here too so the test stands alone
    with pytest.raises(ValueError, match=f"rollout server {servers[1].address} does not answer"):
        ServerEngine([servers[0].address, servers[1].address], pad_token_id=0, token=LANE_TOKEN)
