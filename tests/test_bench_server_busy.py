"""bench/_server_busy.py: the server's busy share per training step, from vLLM's running-request gauge, filed
under the step the run's metrics.jsonl says is being trained (a loopback HTTP server stands in for /metrics)."""

import http.server
import math
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from _server_busy import COUNTER, BusyProbe, running_requests, summed  # noqa: E402

EXPOSITION = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="tiny"}} {0}
vllm:num_requests_running{{engine="1",model_name="tiny"}} {1}
vllm:num_requests_running_other{{engine="0"}} 7.0
vllm:num_requests_waiting{{engine="0",model_name="tiny"}} 5.0
# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{{engine="0",model_name="tiny"}} {2}
vllm:generation_tokens_created{{engine="0",model_name="tiny"}} 1.7e9
"""


def test_the_gauge_is_summed_over_engines_and_nothing_else():
    assert running_requests(EXPOSITION.format(2.0, 1.0, 0.0)) == 3.0
    assert running_requests(EXPOSITION.format(0.0, 0.0, 0.0)) == 0.0
    assert running_requests("vllm:num_requests_running 4.0\n") == 4.0
    assert summed(EXPOSITION.format(0.0, 0.0, 123.0), COUNTER) == 123.0  # not its _created line


def test_samples_are_filed_under_the_step_being_trained(tmp_path):
    state = {"running": 0.0, "tokens": 500.0, "auth": set()}  # 500 tokens before the run: not its

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            state["auth"].add(self.headers.get("Authorization"))
            body = EXPOSITION.format(state["running"], 0.0, state["tokens"]).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    metrics = tmp_path / "metrics.jsonl"
    probe = BusyProbe(f"127.0.0.1:{server.server_address[1]}", metrics, period=0.01)
    probe.start()
    try:
        time.sleep(0.3)  # step 1: idle throughout
        metrics.write_text('{"step": 0, "eval_accuracy": 0.5}\n{"step": 1, "loss": 0.1}\n')
        state["running"], state["tokens"] = 2.0, 564.0  # step 2 generates 64 tokens ...
        time.sleep(0.3)  # step 2: busy throughout
        with metrics.open("a") as f:
            f.write('{"step": 2, "loss": 0.1}\n')
        state["running"] = 0.0
        time.sleep(0.3)  # ... step 3 none
    finally:
        probe.stop()
        server.shutdown()
    assert probe.busy_frac(1) == 0.0
    assert probe.busy_frac(2) > 0.9  # a sample taken as the row was written may fall either side
    assert probe.busy_frac(3) < 0.1
    assert len(probe.samples[1]) >= 5 and len(probe.samples[2]) >= 5
    assert math.isnan(probe.busy_frac(9))  # no sample
    assert [probe.generated_tokens(step) for step in (1, 2, 3)] == [0.0, 64.0, 0.0]
    assert math.isnan(probe.generated_tokens(9))
    assert state["auth"] == {None}


def test_the_secret_is_sent_when_set(tmp_path, monkeypatch):
    monkeypatch.setenv("STAPO_SERVER_TOKEN", "s3cret")
    assert BusyProbe("127.0.0.1:1", tmp_path / "m.jsonl", 0.25).headers == {"Authorization": "Bearer s3cret"}
