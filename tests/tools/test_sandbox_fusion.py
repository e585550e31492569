"""The python tool's SandboxFusion backend against a small fake of its HTTP API on loopback: the
request it sends (POST /run_code, SandboxFusion's field names) and each kind of answer it gets."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from stapo.tools import build_tool

# code -> (HTTP status, body): the answers SandboxFusion gives (sandbox/server/sandbox_api.py's RunCodeResponse)
ANSWERS = {
    "print(6 * 7)": (200, {"status": "Success", "message": "", "run_result": {
        "status": "Finished", "execution_time": 0.01, "return_code": 0, "stdout": "42\n", "stderr": ""}}),
    "1/0": (200, {"status": "Failed", "message": "", "run_result": {
        "status": "Finished", "return_code": 1, "stdout": "before\n",
        "stderr": "Traceback (most recent call last):\nZeroDivisionError: division by zero\n"}}),
    "while True: pass": (200, {"status": "Failed", "message": "", "run_result": {
        "status": "TimeLimitExceeded", "return_code": None, "stdout": "", "stderr": ""}}),
    "broken sandbox": (200, {"status": "SandboxError", "message": "executor pod crashed", "run_result": None}),
    "print('x' * 5000)": (200, {"status": "Success", "message": "", "run_result": {
        "status": "Finished", "return_code": 0, "stdout": "x" * 5000 + "\n", "stderr": ""}}),
    "server error": (500, {"detail": "internal"}),
    "not json": (200, "<html>proxy login</html>"),
}


class FakeSandboxFusion(BaseHTTPRequestHandler):
    requests: list = []

    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append((self.path, self.headers["Content-Type"], body))
        status, answer = ANSWERS.get(body.get("code"), (422, {"detail": "unknown"}))
        data = (answer if isinstance(answer, str) else json.dumps(answer)).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def service():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeSandboxFusion)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


@pytest.fixture
def remote(service):
    FakeSandboxFusion.requests.clear()
    return build_tool("python", backend="sandbox_fusion", url=service, timeout_s=3.0, memory_mb=512,
                      max_output_chars=100)


def test_the_request_is_sandbox_fusions_run_code(remote):
    result = remote({"code": "print(6 * 7)"})
    assert (result.text, result.error) == ("42\n", False)
    assert FakeSandboxFusion.requests == [("/run_code", "application/json", {
        "code": "print(6 * 7)", "language": "python", "run_timeout": 3.0, "memory_limit_MB": 512})]
    assert remote.open_session() is None  # stateless: every call is its own run


@pytest.mark.parametrize("code, expected", [
    ("1/0", "before\nTraceback (most recent call last):\nZeroDivisionError: division by zero\n"),
    ("while True: pass", "timed out after 3 s (the wall-clock limit)"),
    ("broken sandbox", "sandbox service error: executor pod crashed"),
    ("server error", "answered HTTP 500"),
    ("not json", "answered something that is not SandboxFusion's JSON"),
])
def test_failures_are_error_results(remote, code, expected):
    result = remote({"code": code})
    assert result.error and expected in result.text, result


def test_long_output_is_cut_and_an_unreachable_service_is_an_error(remote):
    cut = remote({"code": "print('x' * 5000)"})
    assert cut.error and "[output cut: 5001 characters, the limit is 100; the middle is left out]" in cut.text
    with __import__("socket").socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    down = build_tool("python", backend="sandbox_fusion", url=f"http://127.0.0.1:{port}")({"code": "print(1)"})
    assert down.error and f"the sandbox service at http://127.0.0.1:{port} could not be reached" in down.text
    with pytest.raises(ValueError, match="needs url"):
        build_tool("python", backend="sandbox_fusion")
