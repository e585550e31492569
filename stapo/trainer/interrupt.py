"""Ctrl-C and SIGTERM stop a run at the next step boundary, checkpointed (a step cut midway would not resume
exactly); the flag is agreed across ranks, and a second Ctrl-C stops at once (docs/faq.md).
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["EXIT_STATUS", "HEALTH_EXIT_STATUS", "HealthStop", "RunInterrupted", "StopRequest", "stop_on_signals"]

log = logging.getLogger("stapo.trainer")

#: shell convention 128 + signal number: what schedulers read as "stopped by this signal"
EXIT_STATUS = {"SIGINT": 130, "SIGTERM": 143}


class RunInterrupted(Exception):
    """The run stopped on a signal after saving ``checkpoint`` at ``step``."""

    def __init__(self, signal_name: str, step: int, checkpoint: Path | None) -> None:
        self.signal_name, self.step, self.checkpoint = signal_name, step, checkpoint
        self.exit_status = EXIT_STATUS.get(signal_name, 130)
        saved = f"checkpoint {checkpoint} saved; run the same command to resume" if checkpoint else \
            "nothing to save yet"
        super().__init__(f"{signal_name} at step {step}: {saved}")


#: ``health.on_alarm: stop`` (docs/health.md): not a signal's status, so a script can tell the two apart
HEALTH_EXIT_STATUS = 3


class HealthStop(RunInterrupted):
    """A health alarm stopped the run (``health.on_alarm: stop``) after saving ``checkpoint`` at ``step``."""

    def __init__(self, alarm: str, step: int, checkpoint: Path | None) -> None:
        super().__init__(alarm, step, checkpoint)
        self.exit_status = HEALTH_EXIT_STATUS


class StopRequest:
    """Which signal asked the run to stop (None: none yet)."""

    def __init__(self) -> None:
        self.signal_name: str | None = None

    def handler(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.signal_name is not None and name == "SIGINT":
            raise KeyboardInterrupt  # the second Ctrl-C: stop now
        if self.signal_name is None:
            log.warning("%s: stopping after this step with a checkpoint%s", name,
                        " (Ctrl-C again stops at once, without one)" if name == "SIGINT" else "")
        self.signal_name = self.signal_name or name

    def agreed(self, gather: Callable[[object], list]) -> str | None:
        """The stop signal of any rank (``gather``: an all-gather of one object), the same on all."""
        names = [n for n in gather(self.signal_name) if n is not None]
        return names[0] if names else None


@contextmanager
def stop_on_signals() -> Iterator[StopRequest]:
    """SIGINT and SIGTERM set a :class:`StopRequest` inside the block; the old handlers come back after.
    Outside the main thread (signals cannot be caught there) the request just stays empty."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    previous = {sig: signal.signal(sig, request.handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield request
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
