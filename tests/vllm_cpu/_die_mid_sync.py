"""Imported into a `stapo train` (``--import``) by tests/vllm_cpu/test_server_faults.py: the trainer SIGKILLs
itself inside the weight sync that makes policy version ``KILL_AT_VERSION``, after every bucket went out and
before the commit — what a trainer node lost mid-sync leaves behind: a session open on every server, its
bytes staged there, nothing committed. Deterministic, where freezing a running trainer at the right moment
from outside is not."""

from __future__ import annotations

import os
import signal

from stapo.servers.engine import ServerEngine

KILL_AT_VERSION = 2  # the sync after step 2: step 1's checkpoint is on disk by then
_close_session = ServerEngine._close_session


def _close_session_or_die(self, version: int):
    if version == KILL_AT_VERSION:
        os.kill(os.getpid(), signal.SIGKILL)
    return _close_session(self, version)


ServerEngine._close_session = _close_session_or_die
