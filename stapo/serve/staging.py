"""A vLLM SERVER's side of a weight sync, inside vLLM's worker (docs/rollout.md, "Rollout servers", "Delta syncs").

Buckets are STAGED on the host and loaded at the commit in one layerwise reload, so an aborted sync never leaves
a mix of two policies in a server. Reached through ``/collective_rpc`` (`stapo.serve.guard`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import time
import uuid
from dataclasses import dataclass, field

import torch

from stapo.sync.bucket_format import unpack_tensors
from stapo.sync.weight_delta import apply_delta, checksum, decode_delta, layout_key
from stapo.sync.weight_group import STEP_TIMEOUT_ENV, VLLM_STEP_TIMEOUT_S, GroupSpec

__all__ = ["SERVER_RPC_METHODS", "ServerWorkerMixin"]

SERVER_RPC_METHODS = frozenset({
    "stapo_policy_version", "stapo_server_state", "stapo_fingerprint", "stapo_join_weight_group",
    "stapo_receive_bucket", "stapo_commit_weight_update", "stapo_abort_weight_update", "stapo_weight_checksums",
})


@dataclass
class _Session:
    nonce: str = field(repr=False)
    group: object  # torch ProcessGroupGloo / ProcessGroupNCCL
    device: torch.device  # where the broadcast lands (the GPU for NCCL)
    opened: float = field(default_factory=time.time)
    staged: list = field(default_factory=list)  # [(layout, host uint8 bytes | None, delta | None)] in order
    keep: bool = False  # rollout.server.sync: delta — the committed buckets become the worker's kept copy
    mismatched: list = field(default_factory=list)  # buckets whose checksum differs from the trainer's


class ServerWorkerMixin:
    """The server-side session; ``self`` is vLLM's worker."""

    def _stapo_open_session(self) -> _Session | None:
        return getattr(self, "_stapo_session", None)

    def _stapo_session_for(self, nonce: str) -> _Session:
        session = self._stapo_open_session()
        if session is None:
            raise RuntimeError("no weight update session is open on this server")
        if not nonce or not hmac.compare_digest(str(nonce).encode(), session.nonce.encode()):
            raise PermissionError("this call does not belong to the open weight update session (wrong nonce)")
        return session

    def stapo_server_state(self) -> str:
        """JSON: the policy version held, this worker's instance id (new after a restart), and whether a session
        is open (a trainer that stopped mid-sync leaves one: the next trainer aborts it)."""
        if not hasattr(self, "_stapo_instance"):
            self._stapo_instance = uuid.uuid4().hex
        session = self._stapo_open_session()
        return json.dumps({"version": getattr(self, "_stapo_version", None), "instance": self._stapo_instance,
                           "session_open": session is not None,
                           "session_age_s": None if session is None else round(time.time() - session.opened, 3)})

    def stapo_fingerprint(self) -> str:
        """JSON `stapo.serve.fingerprint` of the served model and tokenizer (computed once)."""
        if not hasattr(self, "_stapo_fingerprint"):
            from transformers import AutoTokenizer

            from stapo.serve.fingerprint import model_fingerprint, tokenizer_fingerprint

            mc = self.vllm_config.model_config
            tokenizer = AutoTokenizer.from_pretrained(mc.tokenizer, revision=mc.tokenizer_revision,
                                                      trust_remote_code=mc.trust_remote_code)
            self._stapo_fingerprint = json.dumps({"model": model_fingerprint(mc.hf_config, mc.dtype),
                                                  "tokenizer": tokenizer_fingerprint(tokenizer)})
        return self._stapo_fingerprint

    def stapo_join_weight_group(self, spec: str) -> int:
        """Join the session's group (``spec``: a `GroupSpec` as JSON, clamped to this server's time limits), check
        rank 0's proof of the nonce; returns this worker's rank. Refused while another session is open."""
        if self._stapo_open_session() is not None:
            raise RuntimeError("a weight update session is already open on this server (abort it first)")
        try:
            step_timeout_s = float(os.environ.get(STEP_TIMEOUT_ENV) or VLLM_STEP_TIMEOUT_S)
        except ValueError:
            step_timeout_s = VLLM_STEP_TIMEOUT_S  # vLLM's own default then
        if not step_timeout_s > 0:
            step_timeout_s = VLLM_STEP_TIMEOUT_S
        group_spec = GroupSpec.from_json(spec).bounded(step_timeout_s)
        rank = group_spec.rank_offset + int(getattr(self, "rank", 0))
        device = torch.device(self.device) if group_spec.backend == "nccl" else torch.device("cpu")
        group = group_spec.join(rank, device)  # checks in; forms the group only on the trainer's go
        self._stapo_session = _Session(group_spec.nonce, group, device)
        return rank

    def stapo_receive_bucket(self, layout: str) -> str:
        """Receive one bucket by broadcast (``layout``: JSON with its encoding, checksum and the nonce) and stage it
        on the host; returns JSON ``{"tensors", "checksum"}`` of the resulting bytes."""
        spec = json.loads(layout)
        session = self._stapo_session_for(spec.get("nonce", ""))
        raw = torch.empty(int(spec.get("payload_nbytes", spec["nbytes"])), dtype=torch.uint8, device=session.device)
        if raw.numel():  # an unchanged bucket of a delta sync sends nothing
            session.group.broadcast(raw, 0).wait()
        session.keep |= "encoding" in spec  # rollout.server.sync: delta (a full sync's buckets carry none)
        result, staged = self._stapo_decode(spec, raw, session.device)
        count = len(unpack_tensors(spec, result))  # validates the layout against the bytes
        mine = checksum(result)
        if mine != spec.get("checksum"):
            session.mismatched.append(f"{spec['names'][0]}...: {mine} != {spec['checksum']}")
        session.staged.append(staged)
        return json.dumps({"tensors": count, "checksum": mine})

    def _stapo_decode(self, spec: dict, raw: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, tuple]:
        """``(the bucket's resulting bytes on device, what to stage)``; a delta goes onto a COPY of the kept
        bucket, which stays untouched until the commit."""
        encoding = spec.get("encoding", "dense")
        if encoding == "dense":
            return raw, (spec, raw.cpu(), None)
        if encoding != "delta":
            raise ValueError(f"unknown bucket encoding {encoding!r}")
        word = int(spec["word"])
        base = self._stapo_kept_copy().get(layout_key(spec))
        if base is None:
            raise RuntimeError("a delta of a bucket this server holds no copy of (the trainer must send it whole)")
        positions, values = decode_delta(raw, int(spec["changed"]), int(spec["nbytes"]) // word, word)
        result = base.to(device, copy=True)
        apply_delta(result, positions, values, word)
        return result, (spec, None, (positions.cpu(), values.cpu()))

    def _stapo_kept_copy(self) -> dict:
        return getattr(self, "_stapo_kept", {})

    def stapo_commit_weight_update(self, commit: str) -> int:
        """Load every staged bucket in one layerwise reload and record the version (``commit``: JSON ``{"nonce",
        "version"}``); returns the tensors loaded. The session ends either way; a failed load leaves the version
        None (synced before it serves again); a checksum that differed refuses it, the weights kept."""
        spec = json.loads(commit)
        session = self._stapo_session_for(spec.get("nonce", ""))
        self._stapo_session = None  # the group and the staged bytes go with this call
        if session.mismatched:
            raise RuntimeError(f"weights not committed: {len(session.mismatched)} bucket(s) differ from the "
                               f"trainer's checksum ({session.mismatched[0]}); this server keeps its weights")
        loaded = 0
        self.stapo_begin_weight_update()
        try:
            for layout, host in self._stapo_settle(session):
                loaded += self._stapo_load(unpack_tensors(layout, host.to(self.device)))
        except BaseException:
            self._stapo_version = None
            self.stapo_finish_weight_update()  # layers not loaded get their previous tensors back
            raise
        self.stapo_finish_weight_update(spec.get("version"))
        return loaded

    def _stapo_settle(self, session: _Session) -> list[tuple[dict, torch.Tensor]]:
        """The session's buckets as host bytes, in order; a delta sync's become the kept copy here, at the commit
        (deltas applied in place only here), a full sync drops it."""
        kept, new, out = self._stapo_kept_copy(), {}, []
        for layout, host, delta in session.staged:
            if delta is not None:
                host = kept[layout_key(layout)]
                apply_delta(host, *delta, int(layout["word"]))
            if session.keep:
                new[layout_key(layout)] = host
            out.append((layout, host))
        self._stapo_kept = new
        return out

    def stapo_abort_weight_update(self, nonce: str = "") -> bool:
        """Drop the open session (with no nonce: whichever is open, for a restarted trainer); the served weights
        stay. Returns whether one was open."""
        if self._stapo_open_session() is None:
            return False
        if nonce:
            self._stapo_session_for(nonce)  # PermissionError: another session's nonce
        self._stapo_session = None
        return True

    def stapo_weight_checksums(self) -> str:
        """JSON: the policy version, the checksum of each kept bucket (by layout key) and one of the served state
        dict: two servers serving the same bytes report the same ``served``."""
        served = hashlib.sha1()
        for name, tensor in self._stapo_model().state_dict().items():
            flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            served.update(f"{name}={checksum(flat)};".encode())
        return json.dumps({"version": getattr(self, "_stapo_version", None), "served": served.hexdigest(),
                           "kept": {key: checksum(b) for key, b in self._stapo_kept_copy().items()}})
