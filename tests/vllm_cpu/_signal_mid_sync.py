"""Imported into a `stapo train` (``--import``) by tests/vllm_cpu/test_vllm_server_faults.py: the trainer signals
itself inside the weight sync that makes policy version ``AT_VERSION``. ``STAPO_LANE_MID_SYNC_AT=commit`` (the
default): after every bucket went out and before the commit. ``formation``: once every server's workers checked in,
before the trainer lets the group form. ``STAPO_LANE_MID_SYNC=kill`` (the default): SIGKILL — what a trainer node
lost mid-sync leaves behind: a session open on every server, its bytes staged there, nothing committed. ``stop``:
SIGSTOP — frozen mid-sync until the test sends SIGCONT (after killing a server). Deterministic, where freezing a
running trainer at the right moment from outside is not (a sync of the tiny model is a fraction of a second)."""

from __future__ import annotations

import os
import signal

from stapo.servers.engine import ServerEngine
from stapo.sync import broadcast

AT_VERSION = 2  # the sync after step 2: step 1's checkpoint is on disk by then
SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}
_AT = os.environ.get("STAPO_LANE_MID_SYNC_AT", "commit")
_weight_update, _close_session, _let_form = ServerEngine.weight_update, ServerEngine._close_session, broadcast.let_form
_syncing = {}  # the version of the sync under way; whether the signal was sent (once: a retry has that version too)


def _signal() -> None:
    if not _syncing.get("signalled"):
        _syncing["signalled"] = True
        os.kill(os.getpid(), SIGNALS[os.environ.get("STAPO_LANE_MID_SYNC", "kill")])


def _weight_update_noting_its_version(self, version: int | None = None):
    _syncing["version"] = version
    return _weight_update(self, version)


def _close_session_after_a_signal(self, version: int):
    if _AT == "commit" and version == AT_VERSION:
        _signal()
    return _close_session(self, version)


def _let_form_after_a_signal(store, nonce: str) -> None:
    if _AT == "formation" and _syncing.get("version") == AT_VERSION:
        _signal()
    return _let_form(store, nonce)


ServerEngine.weight_update = _weight_update_noting_its_version
ServerEngine._close_session = _close_session_after_a_signal
broadcast.let_form = _let_form_after_a_signal
