"""rollout.server.sync=delta against REAL vLLM servers (`stapo serve`, vLLM's CPU build, loopback): delta syncs leave a
server's weights bit-identical to a full sync's — the checksums of the tensors it serves and teacher-forced
log-probs — over several syncs, after an aborted session and after a restart (docs/rollout.md, "Delta syncs").

The lane's two servers: servers[0] takes delta syncs, servers[1] full syncs of the same weights. The fault
suite (test_vllm_server_faults.py) runs its mid-sync kills with delta syncs."""

from __future__ import annotations

import logging

import pytest
import torch
from _bounds import assert_fp32_noise, report
from conftest import LANE_TOKEN

from stapo.servers.client import ServerClient
from stapo.servers.engine import ServerEngine
from stapo.sync.buckets import iter_weight_buckets, sync_weights
from stapo.sync.weight_delta import checksum

pytestmark = pytest.mark.timeout(1800)
BUCKET = 2**20  # the tiny model in several buckets


@pytest.fixture(scope="module")
def pair(servers, warm_model_dir):
    from transformers import AutoModelForCausalLM

    for server in servers:
        server.ensure_running()  # test_server.py's last tests leave servers[1] down
    model = AutoModelForCausalLM.from_pretrained(str(warm_model_dir), dtype=torch.float32)
    delta = ServerEngine([servers[0].address], pad_token_id=0, token=LANE_TOKEN, sync="delta")
    full = ServerEngine([servers[1].address], pad_token_id=0, token=LANE_TOKEN)
    return model, delta, full


def sync_both(model, delta: ServerEngine, full: ServerEngine, version: int):
    sync_weights(model, full, BUCKET, version=version)
    transfer = sync_weights(model, delta, BUCKET, version=version).transfer
    assert delta.last_sync.ok and full.last_sync.ok, (delta.last_sync, full.last_sync)
    return transfer


def checksums(server) -> dict:
    return ServerClient(server.address, token=LANE_TOKEN).rpc_json("stapo_weight_checksums", timeout_s=120)[0]


def teacher_forced(server, ids: list[int]) -> list[float]:
    """The server's log-prob of every token of ``ids`` after the first (vLLM's ``prompt_logprobs``)."""
    body = {"prompt": ids, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}
    reply = ServerClient(server.address, token=LANE_TOKEN).post("/v1/completions", body, 120)
    steps = reply["choices"][0]["prompt_logprobs"][1:]
    return [step[str(token)]["logprob"] for step, token in zip(steps, ids[1:])]


def trainer_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def nudge(model, what: str) -> None:
    """Change the policy: ``few`` elements of three tensors (the tied embedding among them), or one ``whole``
    tensor and a few elements elsewhere."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        if what in ("few", "whole"):
            for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.norm.weight"):
                params[name].view(-1)[7:12] += 0.05
        if what == "whole":
            params["model.layers.1.mlp.down_proj.weight"].mul_(1.1)


def test_delta_syncs_leave_the_server_bit_identical_to_a_full_syncs(pair, servers, prompts):
    model, delta, full = pair
    ids = prompts[0] + prompts[1]
    served, sent = [], []
    for version, what in enumerate(["none", "few", "whole", "none"], start=1):
        nudge(model, what)
        sent.append(sync_both(model, delta, full, version))
        a, b = checksums(servers[0]), checksums(servers[1])
        assert a["served"] == b["served"] and a["version"] == b["version"] == version
        assert a["kept"] == {key: checksum(copy) for key, copy in delta.sent.buckets.items()}  # rank 0's copy
        logprobs = teacher_forced(servers[0], ids)
        assert logprobs == teacher_forced(servers[1], ids)
        mismatch = float((torch.tensor(logprobs) - trainer_logprobs(model, ids)).abs().max())
        report(f"delta sync {version}: served teacher-forced log-probs vs the trainer's", mismatch)
        assert_fp32_noise(mismatch, f"delta sync {version}")
        served.append(a["served"])
    assert served[0] != served[1] != served[2] == served[3]  # each change reached the served model
    assert sent[0].sent_bytes == sent[0].dense_bytes and sent[0].compared_words == 0  # the first sync: whole
    assert 0 < sent[1].sent_bytes < sent[1].dense_bytes / 100 and sent[1].changed_words == 15
    down_proj = dict(model.named_parameters())["model.layers.1.mlp.down_proj.weight"]
    assert sent[2].sent_bytes >= down_proj.numel() * 4 and sent[2].sent_bytes < sent[2].dense_bytes / 2
    assert sent[3].sent_bytes == 0


def test_an_aborted_delta_session_leaves_the_servers_copy_and_weights(pair, servers):
    model, delta, full = pair
    before = checksums(servers[0])
    nudge(model, "few")
    with pytest.raises(RuntimeError, match="the trainer fails mid-sync"):
        with delta.weight_update(version=99):
            delta.load_weights(next(iter_weight_buckets(model, BUCKET)))  # the embedding's bucket, as a delta
            assert 0 < delta._session.stats.sent_bytes < delta._session.stats.dense_bytes
            raise RuntimeError("the trainer fails mid-sync")
    client = ServerClient(servers[0].address, token=LANE_TOKEN)
    assert client.rpc_json("stapo_server_state", timeout_s=30)[0]["session_open"]
    client.rpc("stapo_abort_weight_update", "", timeout_s=30)  # what the next trainer does first
    assert checksums(servers[0]) == before  # version, kept copy and served weights as before the session
    transfer = sync_both(model, delta, full, 5)  # rank 0's copy went with the failed sync: whole
    assert transfer.sent_bytes == transfer.dense_bytes
    assert checksums(servers[0])["served"] == checksums(servers[1])["served"]


def test_a_restarted_server_gets_a_full_sync_then_deltas_again(pair, servers, prompts, caplog):
    model, delta, full = pair
    servers[0].kill()
    servers[0].start().wait_ready()  # a new worker instance: the weights it loaded, no copy, no version
    nudge(model, "few")
    with caplog.at_level(logging.INFO, logger="stapo.rollout"):
        restarted = sync_both(model, delta, full, 6)
    assert f"rollout server {servers[0].address} does not hold the weights last sent" in caplog.text
    assert restarted.sent_bytes == restarted.dense_bytes and restarted.changed_words == 15
    nudge(model, "few")
    again = sync_both(model, delta, full, 7)
    assert again.sent_bytes < again.dense_bytes / 100
    a, b = checksums(servers[0]), checksums(servers[1])
    assert a["served"] == b["served"] and a["version"] == 7
    ids = prompts[2] + prompts[0]
    assert teacher_forced(servers[0], ids) == teacher_forced(servers[1], ids)
