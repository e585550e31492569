"""GPU lane, two GPUs: a weight group on NCCL forms within the spec's formation bound, then takes its collective
timeout (not NCCL's default 10 minutes) and carries a broadcast. Gloo's side: tests/rollout/test_weight_group.py. Marked `gpu`; skipped with
fewer than two CUDA devices (NCCL refuses two ranks on one device)."""

from __future__ import annotations

import datetime
import threading

import pytest
import torch

from stapo.sync.weight_group import GroupSpec, listening_store, namespaced, new_nonce

pytestmark = pytest.mark.gpu


def test_an_nccl_weight_group_forms_then_takes_the_specs_timeout_and_broadcasts():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    nonce, listening = new_nonce(), listening_store("127.0.0.1", 30)
    spec = GroupSpec("127.0.0.1", listening.port, world_size=2, backend="nccl", timeout_s=7, nonce=nonce,
                     join_timeout_s=5)
    received, groups, wrong = {}, {}, {}

    def member(rank):
        torch.cuda.set_device(rank)
        store = namespaced(listening, nonce) if rank == 0 else spec.store()
        group, wrong[rank] = spec.form(rank, store, torch.device("cuda", rank))
        groups[rank] = group
        tensor = torch.arange(4.0, device=f"cuda:{rank}") if rank == 0 else torch.zeros(4, device="cuda:1")
        group.broadcast([tensor]).wait()
        received[rank] = tensor.cpu()

    threads = [threading.Thread(target=member, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert torch.equal(received[1], torch.arange(4.0)) and wrong == {0: [], 1: []}
    assert all(group.options._timeout == datetime.timedelta(seconds=7) for group in groups.values())
