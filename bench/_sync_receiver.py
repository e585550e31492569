"""A weight-sync receiver for bench/weight_sync_delta.py: stapo's worker side of a sync (`ServerWorkerMixin`: join,
receive, stage, keep, commit, abort, checksums) behind the HTTP routes `ServerEngine` calls, with a dict of
tensors in place of vLLM's model (a load copies into it, as vLLM's does into its parameters). What it leaves out
is vLLM's reload itself (the same for full and delta syncs: a server reloads every bucket either way).

    python bench/_sync_receiver.py PORT [cpu|cuda]     # prints READY once it listens on 127.0.0.1:PORT
"""

from __future__ import annotations

import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from stapo.serve.staging import SERVER_RPC_METHODS, ServerWorkerMixin


class DictWorker(ServerWorkerMixin):
    """The worker: loads copy into ``served`` (allocated by the first load, reused after)."""

    device = torch.device("cpu")
    rank = 0

    def __init__(self, device: str = "cpu") -> None:
        self.device = torch.device(device)  # where an NCCL broadcast lands and the served tensors live
        self.served: dict[str, torch.Tensor] = {}

    def stapo_begin_weight_update(self) -> None:
        pass

    def _stapo_load(self, weights) -> int:
        for name, tensor in weights:
            if name in self.served and self.served[name].shape == tensor.shape:
                self.served[name].copy_(tensor)
            else:
                self.served[name] = tensor.clone()
        return len(weights)

    def stapo_finish_weight_update(self, version=None) -> None:
        if version is not None:
            self._stapo_version = int(version)

    def _stapo_model(self):
        served = self.served

        class Served:
            def state_dict(self):
                return dict(sorted(served.items()))
        return Served()


def serve(port: int, device: str = "cpu") -> None:
    worker = DictWorker(device)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/v1/models":
                return self._reply(200, {"data": [{"id": "bench", "max_model_len": 4096}]})
            return self._reply(200 if self.path == "/health" else 404, {})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if self.path == "/reset_prefix_cache":
                return self._reply(200, {})
            method = body.get("method")
            if self.path != "/collective_rpc" or method not in SERVER_RPC_METHODS:
                return self._reply(403, {"error": "not a stapo worker method"})
            try:
                return self._reply(200, {"results": [getattr(worker, method)(*body.get("args", []))]})
            except Exception as err:  # what vLLM's route answers when a worker method raises
                return self._reply(500, {"error": f"{type(err).__name__}: {err}"})

        def _reply(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    print("READY", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    serve(int(sys.argv[1]), *sys.argv[2:3])
