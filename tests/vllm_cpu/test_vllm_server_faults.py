"""Fault injection against REAL `stapo serve` processes (vLLM's CPU build, loopback): the closed control
plane, syncs that survive a dead trainer or a dead server, request errors, hangs, malformed replies and
foreign models (docs/rollout.md, "Security" and "Faults"). Each test adds its figure to the lane's summary
(conftest.FAULT_FIGURES). The session's two servers run with the lane's secret; tests that kill or stop
one bring it back before they end."""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from _servers import VLLMServer, lane_token_file, servers_override
from conftest import FAULT_FIGURES, LANE_TOKEN, ROOT, plain_env
from test_train import COMMON

from stapo.rollout import SamplingParams, generate
from stapo.run_dir import METRICS_FILE, read_metrics
from stapo.servers.client import ServerClient, ServerError
from stapo.servers.engine import ServerEngine
from stapo.sync.weight_group import (GroupSpec, checked_in, exchange_proofs, let_form, listening_store, namespaced,
                                       new_nonce, route_address)

pytestmark = pytest.mark.timeout(1800)
SERVER = ["rollout.mode=server", "trainer.save_every=1", "trainer.keep_last=4"]
# The mid-sync kills run with delta syncs, at a learning rate where some of the fp32 weights change in a step
# (at the lane's 2e-4 every one does and each bucket would go whole): a delta is in flight when they strike.
DELTA = ["rollout.server.sync=delta", "optim.lr=3e-10"]


def figure(what: str, seconds: float) -> None:
    FAULT_FIGURES.append(f"{what}: {seconds:.1f} s")


def status(address: str, path: str, body: dict | None = None, token: str | None = None) -> int:
    request = urllib.request.Request(f"http://{address}{path}", data=None if body is None else json.dumps(body).encode(),
                                     headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status
    except urllib.error.HTTPError as err:
        return err.code


@pytest.fixture
def both(servers):
    for s in servers:
        s.ensure_running()
    return servers


def state(server) -> dict:
    return ServerClient(server.address, token=LANE_TOKEN).rpc_json("stapo_server_state", timeout_s=30)[0]


def served(server) -> str:
    """The checksum of the weights ``server`` serves (stapo_weight_checksums)."""
    return ServerClient(server.address, token=LANE_TOKEN).rpc_json("stapo_weight_checksums", timeout_s=120)[0]["served"]


def sent_less_than_dense(out) -> bool:
    """Some step's delta sync sent fewer bytes than its buckets hold."""
    return any(r["sync_sent_mb"] < r["sync_mb"] for r in read_metrics(out / METRICS_FILE) if "sync_sent_mb" in r)


def test_no_secret_is_401_a_foreign_method_403_and_only_loopback_listens(both):
    start = time.monotonic()
    address = both[0].address
    assert status(address, "/health") == 200  # liveness is open
    assert status(address, "/v1/models") == 401 and status(address, "/v1/models", token="wrong") == 401
    assert status(address, "/collective_rpc", {"method": "stapo_server_state", "args": []}) == 401
    assert status(address, "/v1/models", token=LANE_TOKEN) == 200
    for method in ("__class__", "execute_model", "stapo_load_weights", "collective_rpc"):
        assert status(address, "/collective_rpc", {"method": method, "args": []}, token=LANE_TOKEN) == 403, method
    for path in ("/sleep", "/server_info", "/update_weights", "/v1/load_lora_adapter"):
        assert status(address, path, {}, token=LANE_TOKEN) == 403, path
    outside = route_address("192.0.2.1")  # this machine's non-loopback address, when it has one
    if outside != "127.0.0.1":
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://{outside}:{both[0].port}/health", timeout=5)
    figure("401 / 403 / loopback-only checks", time.monotonic() - start)


def test_a_process_that_is_not_the_trainer_cannot_change_the_served_weights(both, prompts):
    """Without the secret nothing is reached; a rank 0 that got as far as the group but does not hold the session's
    nonce (the group's first collective checks it) is left before the server takes a byte."""
    start = time.monotonic()
    server, engine = both[0], ServerEngine([both[0].address], pad_token_id=0, token=LANE_TOKEN)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
    before, held = generate(engine, prompts, 1, greedy), state(server)["version"]
    nonce, listening = new_nonce(), listening_store("127.0.0.1", 30)
    store = namespaced(listening, nonce)
    spec = GroupSpec("127.0.0.1", listening.port, world_size=2, rank_offset=1, timeout_s=30, nonce=nonce)
    assert status(server.address, "/collective_rpc", {"method": "stapo_join_weight_group", "args": [spec.to_json()]}) == 401
    client = ServerClient(server.address, token=LANE_TOKEN)
    with ThreadPoolExecutor(1) as pool:
        join = pool.submit(client.rpc, "stapo_join_weight_group", spec.to_json(), timeout_s=60)
        while not checked_in(store, nonce, 1, 1):  # the worker checked in; the go is given
            time.sleep(0.02)
        let_form(store, nonce)
        impostor = spec.connect(0, store=store, bind_host="127.0.0.1")  # ... and an impostor takes rank 0
        assert exchange_proofs(impostor, new_nonce(), 0, 2, torch.device("cpu")) == [1]  # not the session's nonce
        with pytest.raises(ServerError, match="rank 0 did not prove it holds this session's nonce"):
            join.result(timeout=60)
    assert state(server)["session_open"] is False and state(server)["version"] == held
    assert torch.equal(generate(engine, prompts, 1, greedy).response_ids, before.response_ids)
    figure("impostor rank 0 refused (proof of the nonce), weights unchanged", time.monotonic() - start)


def _train(out, model_dir, *overrides, env=None, imports=()) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "stapo.cli", "train", *(a for f in imports for a in ("--import", str(f))),
           f"model.path={model_dir}", f"trainer.output_dir={out}", *COMMON, *SERVER, *overrides]
    return subprocess.Popen(cmd, cwd=ROOT, env=env or plain_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


class Lines:
    """The trainer's stderr, line by line with the time each arrived (read on a thread)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[tuple[float, str]] = []
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc) -> None:
        for line in proc.stderr:
            self.lines.append((time.monotonic(), line))

    def first(self, text: str) -> float | None:
        return next((t for t, line in self.lines if text in line), None)

    @property
    def text(self) -> str:
        self._thread.join(timeout=10)
        return "".join(line for _, line in self.lines)


def _trained_steps(out) -> list[int]:
    path = out / METRICS_FILE
    return [r["step"] for r in read_metrics(path) if "loss" in r] if path.exists() else []


MID_SYNC = ROOT / "tests" / "vllm_cpu" / "_signal_mid_sync.py"  # the trainer signals itself in the sync to version 2


def _stopped_mid_sync(trainer: subprocess.Popen) -> None:
    """Wait until ``trainer`` (run with MID_SYNC and ``STAPO_LANE_MID_SYNC=stop``) froze itself inside its
    weight sync: its process state is T (stopped)."""
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline and trainer.poll() is None:
        if Path(f"/proc/{trainer.pid}/stat").read_text().rpartition(")")[2].split()[0] == "T":
            return
        time.sleep(0.1)
    raise AssertionError("the trainer never stopped inside its weight sync")


def _kill_a_server_while_stopped_mid_sync(trainer: subprocess.Popen, out, server) -> tuple:
    """Once ``trainer`` froze itself in its sync, SIGKILL ``server`` and let the trainer go on to its end; returns
    its stderr lines, the last step trained before the kill, and when it resumed and finished."""
    lines = Lines(trainer)
    _stopped_mid_sync(trainer)
    at_step = max(_trained_steps(out))
    server.kill()
    resumed = time.monotonic()
    trainer.send_signal(signal.SIGCONT)
    trainer.wait(timeout=1800)
    return lines, at_step, resumed, time.monotonic()


def test_a_trainer_killed_mid_sync_resumes_with_the_same_servers(both, warm_model_dir, tmp_path):
    out = tmp_path / "killed_trainer"
    trainer = _train(out, warm_model_dir, servers_override(*both), "trainer.total_steps=3", *DELTA, imports=[MID_SYNC])
    trainer.communicate(timeout=1800)
    assert trainer.returncode == -signal.SIGKILL and _trained_steps(out)[-1] < 3
    stale = state(both[0])  # what the dead trainer left: an open session
    start = time.monotonic()
    resumed = _train(out, warm_model_dir, servers_override(*both), "trainer.total_steps=3", "trainer.resume=auto",
                     *DELTA)
    _, stderr = resumed.communicate(timeout=1800)
    took = time.monotonic() - start
    assert resumed.returncode == 0, stderr[-3000:]
    assert stale["session_open"]
    assert f"rollout server {both[0].address} was in the middle of a weight sync" in stderr
    assert _trained_steps(out)[-1] == 3 and "resumed from" in stderr
    assert {s.address: state(s)["version"] for s in both} == {s.address: 3 for s in both}
    # no half-applied delta was ever committed: every sync's checksums agreed, and both servers hold one policy
    assert "holds other bytes" not in stderr and served(both[0]) == served(both[1]) and sent_less_than_dense(out)
    figure("trainer SIGKILLed mid-sync (session left open) -> restarted run aborts it and trains the remaining "
           "steps with the same servers", took)


def test_a_server_killed_mid_sync_leaves_the_run_to_the_other(both, warm_model_dir, tmp_path):
    out = tmp_path / "killed_server"
    trainer = _train(out, warm_model_dir, servers_override(*both), "trainer.total_steps=3", *DELTA, imports=[MID_SYNC],
                     env=plain_env(STAPO_LANE_MID_SYNC="stop"))
    lines, at_step, killed, finished = _kill_a_server_while_stopped_mid_sync(trainer, out, both[1])
    stderr = lines.text
    assert trainer.returncode == 0, stderr[-3000:]
    assert f"rollout server {both[1].address}" in stderr and "is down" in stderr
    assert _trained_steps(out) == [1, 2, 3]
    assert state(both[0])["version"] == 3 and "holds other bytes" not in stderr and sent_less_than_dense(out)
    figure(f"server SIGKILLed in the sync after step {at_step} -> that sync retried with the other, the run's "
           f"{3 - at_step} remaining step(s) and its final evaluation done", finished - killed)
    both[1].start().wait_ready()


def test_a_server_killed_as_the_weight_group_forms_leaves_the_run_to_the_other(both, warm_model_dir, tmp_path):
    """Both servers checked in, one dies before the group forms (CI met it once, at random): the trainer waited out
    the sync's timeout (300 s) in the formation and the survivor's engine was blocked as long, so the retry found it
    silent too and the run stopped. Now its failed join names the dead server at once and the survivor is held for
    the formation's bound (`rollout.server.sync_join_timeout_s`, 15 s here) only."""
    out, bound = tmp_path / "killed_forming", 15
    trainer = _train(out, warm_model_dir, servers_override(*both), "trainer.total_steps=3",
                     f"rollout.server.sync_join_timeout_s={bound}", imports=[MID_SYNC],
                     env=plain_env(STAPO_LANE_MID_SYNC="stop", STAPO_LANE_MID_SYNC_AT="formation"))
    lines, _, resumed, finished = _kill_a_server_while_stopped_mid_sync(trainer, out, both[1])
    stderr = lines.text
    assert trainer.returncode == 0, stderr[-3000:]
    assert f"server(s) {both[1].address} failed while the weight group formed" in stderr, stderr[-3000:]
    assert _trained_steps(out) == [1, 2, 3] and state(both[0])["version"] == 3
    retried = lines.first("retrying with the 1 server(s) left")
    assert retried is not None and retried - resumed < 2 * bound + 15, (retried and retried - resumed)
    figure(f"server SIGKILLed after it checked in, before the group formed -> the sync retried with the other "
           f"after {retried - resumed:.1f} s (its formation's bound: {bound} s), the run's last step and its final "
           "evaluation done", finished - resumed)
    both[1].start().wait_ready()


def test_an_over_long_prompt_is_a_warning_and_the_run_goes_on(both, warm_model_dir, tmp_path):
    from stapo.tiny import arithmetic_problems

    rows = [{"prompt": p.question, "answer": p.answer} for p in arithmetic_problems(8, seed=3, terms=3)]
    rows.append({"prompt": "Compute " + "+".join(["1"] * 400) + ".", "answer": "400"})  # > max-model-len 512
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    start = time.monotonic()
    trainer = _train(tmp_path / "long", warm_model_dir, servers_override(*both), "trainer.total_steps=1",
                     f"data.source={data}", f"data.eval_source={data}", "data.max_prompt_length=2048")
    _, stderr = trainer.communicate(timeout=1800)
    assert trainer.returncode == 0, stderr[-3000:]
    assert "a rollout server's max_model_len is 512: prompts longer than 472 tokens" in stderr
    assert "filtered 1 of 9 prompts longer than 472 tokens" in stderr
    figure("over-long prompt: warned and filtered at start, 1-step run", time.monotonic() - start)


def test_a_sigstopped_server_is_declared_down_within_the_bound(both, warm_model_dir, tmp_path):
    bound = 8.0
    out = tmp_path / "stopped"
    trainer = _train(out, warm_model_dir, servers_override(*both), "trainer.total_steps=3",
                     f"rollout.server.down_after_s={bound}", "rollout.server.health_interval_s=1", "rollout.server.health_timeout_s=2")
    lines = Lines(trainer)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline and not _trained_steps(out) and trainer.poll() is None:
        time.sleep(0.2)
    both[1].signal(signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        trainer.wait(timeout=1800)
    finally:
        both[1].signal(signal.SIGCONT)
    stderr = lines.text
    assert trainer.returncode == 0, stderr[-3000:]
    assert _trained_steps(out) == [1, 2, 3]
    declared = lines.first(f"rollout server {both[1].address} is down")
    assert declared is not None, stderr[-3000:]
    # found by a state read (2 s) before its next requests, or by the health watch (bound + a probe period)
    assert declared - stopped <= bound + 1 + 2 + 5, declared - stopped
    figure(f"SIGSTOPped server declared down (rollout.server.down_after_s={bound:g})", declared - stopped)


class FaultProxy:
    """Forwards to a real server, except the completions ``fault(handler, body) -> bool`` answers itself (True):
    ``completions`` counts the completion requests, ``bodies`` holds them."""

    def __init__(self, target: str, fault) -> None:
        self.target, self.completions, self.bodies = target, 0, []
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                self._forward(None)

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path == "/v1/completions":
                    proxy.completions += 1
                    proxy.bodies.append(json.loads(body))
                    if fault(self, body):
                        return
                self._forward(body)

            def _forward(self, body):
                request = urllib.request.Request(f"http://{target}{self.path}", data=body, method=self.command,
                                                 headers=self.forwarded_headers())
                try:
                    with urllib.request.urlopen(request, timeout=60) as reply:
                        self.send(reply.status, reply.read())
                except urllib.error.HTTPError as err:
                    self.send(err.code, err.read())

            def forwarded_headers(self) -> dict:
                return {k: v for k, v in self.headers.items() if k.lower() != "host"}

            def send(self, code, data):
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.address = f"127.0.0.1:{self.httpd.server_address[1]}"


def not_json(handler, body) -> bool:
    """Every completion answers HTTP 200 with a body that is not JSON."""
    handler.send(200, b"<html>502 from a proxy</html>")
    return True


def test_malformed_replies_fail_over_and_name_the_server(both, prompts, caplog):
    proxy = FaultProxy(both[0].address, not_json)
    start = time.monotonic()
    try:
        engine = ServerEngine([proxy.address, both[1].address], pad_token_id=0, token=LANE_TOKEN)
        with caplog.at_level("WARNING", logger="stapo.rollout"):
            rollout = generate(engine, prompts, 2, SamplingParams(temperature=1.0, max_new_tokens=8, seed=2))
    finally:
        proxy.httpd.shutdown()
    assert rollout.finish_reason.count("error") == 0 and len(rollout) == 2 * len(prompts)
    assert proxy.completions >= 1 and [c.address for c in engine.pool.down] == [proxy.address]
    assert f"rollout server {proxy.address}" in caplog.text and "body that is not JSON" in caplog.text
    figure("malformed replies -> failover to the other server", time.monotonic() - start)


def test_a_server_with_another_dtype_or_tokenizer_is_one_clear_error_at_start(both, warm_model_dir, tmp_path):
    from transformers import AutoTokenizer

    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "stapo.cli", "train", f"model.path={warm_model_dir}",
                           f"trainer.output_dir={tmp_path / 'bf16'}", *COMMON, *SERVER, servers_override(both[0]),
                           "model.dtype=bf16", "trainer.zero_stage=1"], cwd=ROOT, env=plain_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"rollout server {both[0].address} does not serve the trainer's model: weight dtype: trainer bfloat16, " \
           "server float32" in proc.stderr
    other = tmp_path / "other_tokenizer"  # the same weights, a tokenizer with one more token
    import shutil

    shutil.copytree(warm_model_dir, other)
    tokenizer = AutoTokenizer.from_pretrained(other)
    tokenizer.add_tokens(["<not_in_the_trainers_vocabulary>"])
    tokenizer.save_pretrained(other)
    server = VLLMServer(other, tmp_path / "other.log").start()
    try:
        server.wait_ready()
        with pytest.raises(ValueError, match=f"rollout server {server.address} does not serve the trainer's model: "
                                             "tokenizer vocab_size"):
            from stapo.config import STAPOConfig
            from stapo.trainer.server_setup import build_server_engine

            cfg = STAPOConfig.from_yaml(None, ["rollout.mode=server", f"rollout.server.addresses=[{server.address}]",
                                               "model.dtype=fp32",
                                               f"rollout.server.token_file={lane_token_file(tmp_path)}"])
            build_server_engine(cfg, str(warm_model_dir), AutoTokenizer.from_pretrained(warm_model_dir), torch.float32)
    finally:
        server.kill()
    figure("another dtype (a run) / another tokenizer (a server started for it): one error at start",
           time.monotonic() - start)


def test_one_5xx_mid_stream_is_retried_on_its_server_not_marked_down(both, prompts, caplog):
    """rollout.server.request_retries applies to streamed segments (rollout.partial) as to whole requests: the first
    stream breaks off after a few real tokens with the 500 event vLLM streams when a step fails; the segment
    runs again on the same server with the same seed (what the broken stream gave is dropped) and the server
    stays in service."""
    from stapo.rollout import SegmentRequest
    from stapo.rollout.sampling import vllm_request_kwargs
    from stapo.servers.completions import completion_body, segment_from_reply
    from stapo.servers.engine import ServerLimits

    error = {"error": {"object": "error", "message": "EngineCore step failed", "type": "InternalServerError",
                       "param": None, "code": 500}}

    def break_first_stream(handler, body) -> bool:
        if proxy.completions > 1:
            return False
        host, port = proxy.target.rsplit(":", 1)
        upstream = http.client.HTTPConnection(host, int(port), timeout=60)
        upstream.request("POST", "/v1/completions", body=body, headers=handler.forwarded_headers())
        reply = upstream.getresponse()
        handler.send_response(200)
        handler.send_header("Content-Type", "text/event-stream")
        handler.end_headers()
        events = 0
        for line in reply:
            handler.wfile.write(line)
            events += line.startswith(b"data:")
            if events == 3:
                break
        handler.wfile.write(b"data: " + json.dumps(error).encode() + b"\n\n")
        handler.wfile.flush()
        upstream.close()
        return True

    proxy = FaultProxy(both[0].address, break_first_stream)
    start = time.monotonic()
    try:
        engine = ServerEngine([proxy.address], pad_token_id=0, token=LANE_TOKEN, stream=True,
                              limits=ServerLimits(request_retries=2))
        sampling = SamplingParams(temperature=1.0, max_new_tokens=12, seed=4)
        request = SegmentRequest(prompts[1], 1234, 12)
        with caplog.at_level("WARNING", logger="stapo.rollout"):
            (segment,) = engine.generate_segments([request], sampling)
        direct = segment_from_reply(ServerClient(both[0].address, token=LANE_TOKEN).post(
            "/v1/completions", completion_body(request, vllm_request_kwargs(sampling))))
    finally:
        proxy.httpd.shutdown()
    assert proxy.completions == 2 and [b["seed"] for b in proxy.bodies] == [1234, 1234]
    assert segment.tokens == direct.tokens and segment.finish == direct.finish  # the retry, not the broken stream
    assert engine.pool.down == [] and "is down" not in caplog.text
    assert f"rollout server {proxy.address}: attempt 1 of 3 failed" in caplog.text and "streamed an error" in caplog.text
    figure("one 5xx mid-stream: retried on the same server, not marked down", time.monotonic() - start)
