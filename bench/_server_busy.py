"""The rollout server's busy share per training step, measured on the server (``bench/async_overlap.py``).

A batch's generation time cannot give it once batches outlive steps (asynchronous and partial rollouts: a cut
batch's time spans syncs and steps), so `BusyProbe` samples vLLM's ``vllm:num_requests_running`` gauge
(``/metrics``) every ``period`` seconds and files each sample under the step being trained at that moment:
the steps the run has logged so far (metrics.jsonl rows with a loss) + 1. A step's busy share is the
fraction of its samples with a request running.
"""

from __future__ import annotations

import os
import threading
import urllib.request
from collections import defaultdict
from pathlib import Path

from stapo.serve.secret import trainer_secret

GAUGE = "vllm:num_requests_running"


def running_requests(metrics_text: str) -> float:
    """The gauge summed over its label sets (one per engine) in a Prometheus text exposition."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics_text.splitlines()
               if line.startswith(GAUGE + "{") or line.startswith(GAUGE + " "))


class BusyProbe(threading.Thread):
    """Samples the server at ``address`` (host:port; with the trainer's secret, `trainer_secret`) until `stop`."""

    def __init__(self, address: str, metrics_path: Path, period: float):
        super().__init__(daemon=True)
        self.url, self.metrics_path, self.period = f"http://{address}/metrics", metrics_path, period
        token = trainer_secret(os.environ, None)
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.samples: dict[int, list[bool]] = defaultdict(list)
        self._stopped = threading.Event()

    def run(self) -> None:
        while not self._stopped.wait(self.period):
            step = self._logged_steps() + 1
            request = urllib.request.Request(self.url, headers=self.headers)
            try:
                with urllib.request.urlopen(request, timeout=10) as reply:
                    busy = running_requests(reply.read().decode()) > 0
            except OSError:  # an unanswered sample is no sample: that step's share rests on the others
                continue
            if self._logged_steps() + 1 == step:  # a sample across a step's end belongs to neither step
                self.samples[step].append(busy)

    def _logged_steps(self) -> int:
        if not self.metrics_path.is_file():
            return 0
        return sum('"loss"' in line for line in self.metrics_path.read_text().splitlines())

    def stop(self) -> None:
        self._stopped.set()
        self.join()

    def busy_frac(self, step: int) -> float:
        """Step ``step``'s share of samples with a request running (nan without samples)."""
        taken = self.samples.get(step, [])
        return sum(taken) / len(taken) if taken else float("nan")
