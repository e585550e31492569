"""ZeRO-3 prefetch engages in the trainer's own passes (docs/distributed.md, "ZeRO-3 prefetch").

DeepSpeed's stage-3 parameter coordinator records the order in which modules fetch their parameters
and, once a recorded trace is COMPLETE, all-gathers the parameters of the next modules ahead of use
(``zero.prefetch_bucket_size``). A new pass of the trace starts only from the forward pre-hook on
the root module, so the stats pass and the update must call the root module; the old code ran the
decoder and the head directly and the trace never left the INVALID state (this test then fails at
its first assertion: no fetch ever saw a complete trace, and no parameter was ever in flight).

On 2 gloo ranks, with a ``zero:`` setting that partitions every projection: a stats pass, an update,
a stats pass and an update alternate (their module orders differ: forward only vs forward + backward),
then a frozen ZeRO-3 reference runs two stats passes. A spy on the coordinator's
``fetch_sub_module`` records, after each module's fetch, whether the trace was complete and how many
parameters were still being gathered (``ds_status == INFLIGHT``): those are prefetched for modules
to come, since the fetched module's own parameters have been waited for. Gradients under prefetch
are compared with a plain single-process model.
"""

from __future__ import annotations

import pytest
import torch

from _batches import ragged_rows
from _dist_utils import run_ranks, tiny_qwen3

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

ROWS = 6  # 3 per rank; one row per micro-batch -> 3 micro-batches per pass
# norms (8-16 elements) stay whole; every projection (>= 128 elements) and the 1,024-element
# embedding/head are partitioned; the bucket prefetches a few tensors ahead
TUNING = dict(param_persistence_threshold=100, prefetch_bucket_size=1000, max_live_parameters=10_000,
              max_reuse_distance=2_000)


def _rows():
    return ragged_rows([3, 5, 4, 6, 2, 5], [7, 2, 9, 5, 6, 4], seed=0, vocab=(1, 64))


def _spy(log: list, phase: list):
    """Wrap the coordinator's fetch: log (phase, forward, trace complete, params in flight) per fetch."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    fetch = PartitionedParameterCoordinator.fetch_sub_module
    models: dict[str, torch.nn.Module] = {}

    def spy(self, current_submodule, forward):
        fetch(self, current_submodule, forward)
        model = models[phase[0].split(":")[0]]
        inflight = sum(p.ds_status == ZeroParamStatus.INFLIGHT for p in model.parameters())
        log.append((phase[0], forward, self.is_complete_trace(), inflight))

    PartitionedParameterCoordinator.fetch_sub_module = spy
    return models


def _prefetch_worker(out_dir, **_):
    from _dist_utils import gather_full_grads
    from stapo.distributed.accumulation import GradientAccumulation
    from stapo.distributed.process_group import init_distributed
    from stapo.distributed.deepspeed_engine import ZeroTuning, build_engine, build_reference
    from stapo.trainer.microbatch import MicroBatches
    from stapo.distributed.policy import response_token_stats
    from stapo.trainer.update import TrainBatch, UpdateOptions, policy_stats
    from stapo.sync.buckets import iter_weight_buckets

    info = init_distributed()
    n_global = int(_rows()[3].sum())  # response tokens on all ranks
    share = ROWS // info.world_size
    mine = slice(info.rank * share, (info.rank + 1) * share)
    prompt_ids, prompt_mask, response_ids, response_mask = (t[mine] for t in _rows())
    zeros = torch.zeros(response_ids.shape)
    batch = TrainBatch(prompt_ids, prompt_mask, response_ids, response_mask, torch.zeros(share), zeros, zeros)
    opts = UpdateOptions(micro_batch_size=1, chunk_size=4)
    tuning = ZeroTuning(**TUNING)
    engine = build_engine(tiny_qwen3(seed=0), lr=1e-2, warmup_steps=0, grad_accum_steps=share, bf16=False,
                          zero_tuning=tuning)
    reference = build_reference(tiny_qwen3(seed=0), zero_stage=3, bf16=False, zero_tuning=tuning)
    log, phase = [], [""]
    models = _spy(log, phase)
    models.update(policy=engine.module, reference=reference)
    out = {"grads": {}, "weights": {}}

    def update(name):
        """The update's micro-batch loop (as update_minibatch): mean response NLL, summed exactly."""
        micro_batches = MicroBatches(batch, opts, torch.device("cpu"), no_grad=False)
        accumulation = GradientAccumulation(engine, len(micro_batches))
        for i, (_, inputs) in enumerate(micro_batches):
            phase[0] = f"policy:{name}:{i}"
            logprobs, _ = response_token_stats(engine.module, inputs, temperature=1.0, chunk_size=4, runner=engine)
            accumulation.backward(-logprobs.sum() / n_global)  # summed over ranks: the global mean
        out["grads"][name] = gather_full_grads(engine)
        accumulation.step()

    for name in ("stats1", "update1", "stats2", "update2"):
        out["weights"][name] = {n: t.clone() for b in iter_weight_buckets(engine) for n, t in b}
        if name.startswith("stats"):
            phase[0] = f"policy:{name}"
            out[name] = policy_stats(engine.module, batch, opts)
        else:
            update(name)
    for name in ("ref1", "ref2"):
        phase[0] = f"reference:{name}"
        out[name] = policy_stats(reference, batch, opts)
    out["log"] = log
    return out


def _plain_grads(weights: dict) -> tuple[dict, torch.Tensor]:
    """Single-process reference: the same loss over all rows with the given weights; and logprobs."""
    from stapo.distributed.policy import response_token_stats, teacher_forced_inputs

    model = tiny_qwen3(seed=0)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert missing == ["lm_head.weight"] and not unexpected  # tied: the head is embed_tokens.weight
    prompt_ids, prompt_mask, response_ids, response_mask = _rows()
    inputs = teacher_forced_inputs(prompt_ids, prompt_mask, response_ids, response_mask, packed=False)
    logprobs, _ = response_token_stats(model, inputs, temperature=1.0, chunk_size=4)
    (-logprobs.sum() / int(response_mask.sum())).backward()
    return {n: p.grad for n, p in model.named_parameters()}, logprobs.detach()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_ranks(_prefetch_worker, 2, tmp_path_factory.mktemp("prefetch"), timeout=360)


def _fetches(log, prefix):
    return [entry for entry in log if entry[0].startswith(prefix)]


def test_trace_completes_and_parameters_are_prefetched_in_every_pass(two_ranks):
    for result in two_ranks:
        log = result["log"]
        # first stats micro-batch records the trace; from the second on it is complete and prefetches
        for prefix in ("policy:stats1", "policy:stats2", "policy:update2", "reference:ref1", "reference:ref2"):
            fetches = _fetches(log, prefix)
            complete = [f for f in fetches if f[2]]
            assert complete, f"{prefix}: no fetch saw a complete trace"
            assert any(f[3] > 0 for f in complete), f"{prefix}: nothing was prefetched"
        # after one update the forward+backward trace serves both passes: no micro-batch re-records,
        # and the update's backward follows it too (here every parameter it needs is still gathered:
        # max_reuse_distance kept it from the forward, so there is nothing left to prefetch)
        for prefix in ("policy:stats2", "policy:update2:0", "policy:update2:1", "policy:update2:2", "reference:ref2"):
            assert all(f[2] for f in _fetches(log, prefix)), prefix
        assert any(not f[1] for f in _fetches(log, "policy:update2:0"))  # backward fetches were logged


def test_gradients_and_stats_under_prefetch_match_a_plain_model(two_ranks):
    """Prefetching changes when parameters are gathered, never the arithmetic."""
    for name, stats in (("update1", "stats1"), ("update2", "stats2")):
        weights = two_ranks[0]["weights"][stats]
        ref_grads, ref_logprobs = _plain_grads(weights)
        for rank, result in enumerate(two_ranks):
            assert result["weights"][stats].keys() == two_ranks[0]["weights"][stats].keys()
            for key, ref in ref_grads.items():
                torch.testing.assert_close(result["grads"][name][key], ref, rtol=1e-5, atol=1e-7, msg=key)
            share = ROWS // 2
            logprobs = result[stats][0]
            t_len = logprobs.shape[1]
            torch.testing.assert_close(logprobs, ref_logprobs[rank * share:(rank + 1) * share, :t_len],
                                       rtol=1e-5, atol=1e-6)
    # the frozen reference holds the initial weights: its stats equal the first stats pass
    for result in two_ranks:
        torch.testing.assert_close(result["ref2"][0], result["stats1"][0], rtol=0, atol=0)
