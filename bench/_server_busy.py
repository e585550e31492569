"""The rollout server's busy share per training step, measured on the server (``bench/async_overlap.py``).

A batch's generation time cannot give it once batches outlive steps (asynchronous and partial rollouts: a cut
batch's time spans syncs and steps), so `BusyProbe` samples vLLM's ``vllm:num_requests_running`` gauge
(``/metrics``) every ``period`` seconds and files each sample under the step being trained at that moment:
the steps the run has logged so far (metrics.jsonl rows with a loss) + 1. A step's busy share is the
fraction of its samples with a request running. A short generation can fall between samples, so each sample
also reads the ``vllm:generation_tokens_total`` counter: a step's generated tokens are the counter's rise from
the previous step's last sample to its own, whatever the sampling missed.
"""

from __future__ import annotations

import os
import threading
import urllib.request
from collections import defaultdict
from pathlib import Path

from stapo.serve.secret import trainer_secret

GAUGE = "vllm:num_requests_running"
COUNTER = "vllm:generation_tokens_total"


def summed(metrics_text: str, name: str) -> float:
    """Metric ``name`` summed over its label sets (one per engine) in a Prometheus text exposition."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics_text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def running_requests(metrics_text: str) -> float:
    return summed(metrics_text, GAUGE)


class BusyProbe(threading.Thread):
    """Samples the server at ``address`` (host:port; with the trainer's secret, `trainer_secret`) until `stop`."""

    def __init__(self, address: str, metrics_path: Path, period: float):
        super().__init__(daemon=True)
        self.url, self.metrics_path, self.period = f"http://{address}/metrics", metrics_path, period
        token = trainer_secret(os.environ, None)
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.samples: dict[int, list[bool]] = defaultdict(list)
        self.counter: dict[int, float] = {}  # the generated-token counter at each step's last sample
        self.counter_start: float | None = None  # ... and at the first sample
        self._stopped = threading.Event()

    def run(self) -> None:
        while not self._stopped.wait(self.period):
            step = self._logged_steps() + 1
            request = urllib.request.Request(self.url, headers=self.headers)
            try:
                with urllib.request.urlopen(request, timeout=10) as reply:
                    text = reply.read().decode()
            except OSError:  # an unanswered sample is no sample: that step's share rests on the others
                continue
            if self._logged_steps() + 1 == step:  # a sample across a step's end belongs to neither step
                self.samples[step].append(running_requests(text) > 0)
                self.counter[step] = summed(text, COUNTER)
                if self.counter_start is None:
                    self.counter_start = self.counter[step]

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

    def generated_tokens(self, step: int) -> float:
        """Tokens the server generated from the last sample of the steps before ``step`` (or the first sample)
        to ``step``'s last sample (nan without a sample in ``step``)."""
        if step not in self.counter:
            return float("nan")
        before = [self.counter[s] for s in self.counter if s < step]
        return self.counter[step] - (before[-1] if before else self.counter_start)
