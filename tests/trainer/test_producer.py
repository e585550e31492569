"""The asynchronous producer (rollout.max_staleness; docs/algorithm.md "Asynchronous training"): batch j
is generated once the servers hold a policy at most k versions older than iteration j, never during a
weight sync, and the checkpoint's resume point is the draw of the first batch not trained yet."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from stapo.rollout import Rollout
from stapo.trainer.producer import ProducedBatch, RolloutProducer


class Draws:
    """A prompt sampler stand-in with a state (the real one is stapo.data.PromptSampler): draw n -> n+1."""

    def __init__(self) -> None:
        self.position = 0
        self.generating = threading.Event()

    def state(self) -> dict:
        return {"position": self.position}

    def produce(self, index: int, version: int) -> ProducedBatch:
        self.generating.set()
        self.position += 1
        time.sleep(0.01)
        rollout = Rollout(prompt_ids=torch.ones(2, 1, dtype=torch.long), prompt_mask=torch.ones(2, 1, dtype=torch.bool),
                          response_ids=torch.ones(2, 1, dtype=torch.long),
                          response_mask=torch.ones(2, 1, dtype=torch.bool), sampling_logprobs=torch.zeros(2, 1),
                          finish_reason=["stop"] * 2, response_text=["x"] * 2, group_index=torch.zeros(2, dtype=torch.long),
                          group_size=2).with_policy_version(version)
        self.generating.clear()
        return ProducedBatch(index, [index], rollout, version, 0, 0.01)


@pytest.mark.parametrize("k", [1, 2])
def test_every_batch_is_at_most_k_versions_old_and_as_fresh_as_allowed(k):
    draws = Draws()
    producer = RolloutProducer(draws.produce, draws.state, max_staleness=k, first_index=0, version=0, stop_index=6)
    versions = []
    for step in range(6):  # the trainer: take batch `step`, train, sync version step + 1
        batch = producer.take(step)
        versions.append(batch.policy_version)
        assert batch.rollout.policy_version.tolist() == [batch.policy_version] * 2
        # the update, until the producer ran ahead as far as allowed (batches up to step + k; a fixed 50 ms
        # sleep here was a timing window a busy machine could miss)
        wait_for(lambda: draws.position >= min(step + 1 + k, 6))
        with producer.paused():
            producer.advance(step + 1)
    producer.close()
    # k = 1: batch j from version j - 1 (batch 0 from the start weights); k = 2: j - 2
    assert versions == [max(j - k, 0) for j in range(6)]
    assert draws.position == 6  # nothing generated past the run's end (stop_index)


def test_no_generation_runs_inside_a_weight_sync():
    draws = Draws()
    producer = RolloutProducer(draws.produce, draws.state, max_staleness=3, first_index=0, version=0)
    for _ in range(20):
        with producer.paused():
            assert not draws.generating.is_set()
            time.sleep(0.005)
    producer.close()


def test_the_resume_point_is_the_draw_of_the_first_untrained_batch():
    draws = Draws()
    producer = RolloutProducer(draws.produce, draws.state, max_staleness=1, first_index=4, version=4)
    producer.take(4)
    producer.take(5)  # generated ahead with version 4
    with producer.paused():
        state, ahead = producer.resume_state(5)  # iteration 4 trained, 5 not yet
    assert state == {"position": 1} and ahead == 1  # batch 5 was drawn second; 1 batch ahead of step 5
    producer.close()


def test_an_error_in_the_producer_reaches_the_trainer():
    def failing(index, version):
        raise RuntimeError("no rollout server is left")

    producer = RolloutProducer(failing, dict, max_staleness=1, first_index=0, version=0)
    with pytest.raises(RuntimeError, match="no rollout server is left"):
        producer.take(0)
    producer.close()
    with pytest.raises(ValueError, match="max_staleness >= 1"):
        RolloutProducer(failing, dict, max_staleness=0, first_index=0, version=0)



def test_a_batch_carries_the_version_the_servers_held_while_it_was_generated():
    """A sync may land between the producer choosing its next batch and generating it: the label must be
    what the servers held during generation, i.e. the version read under the engine lock (stress test;
    before the fix it was read before the lock and a sync in between mislabelled the batch)."""
    held = {"version": 0}  # what the "servers" hold; changed only inside `paused`, like a real sync

    def produce(index, version):
        generated_with = held["version"]
        time.sleep(0.0002)
        return ProducedBatch(index, [generated_with], None, version, 0, 0.0)

    producer = RolloutProducer(produce, dict, max_staleness=2, first_index=0, version=0, stop_index=300)
    for step in range(300):
        batch = producer.take(step)
        assert batch.policy_version == batch.examples[0], step
        with producer.paused():
            held["version"] = step + 1
            producer.advance(step + 1)
    producer.close()


def test_the_resume_points_stay_consistent_under_concurrent_takes():
    """`take` drops the resume points of trained batches while the producer adds new ones: one lock for
    both (before the fix: "dictionary changed size during iteration" under load)."""
    producer = RolloutProducer(lambda i, v: ProducedBatch(i, [], None, v, 0, 0.0), lambda: {"i": 0},
                               max_staleness=64, first_index=0, version=0, stop_index=3000)
    for step in range(3000):
        producer.take(step)
        if step % 50 == 0:
            with producer.paused():
                state, ahead = producer.resume_state(step + 1)
            assert ahead >= 0 and isinstance(state, dict)
        producer.advance(step + 1)
    producer.close()


def wait_for(condition, timeout_s: float = 60.0) -> None:
    """Poll ``condition`` (a thread's progress) instead of sleeping a fixed time a busy machine may overrun."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the producer made no progress in 60 s"
        time.sleep(0.002)


class Segmented:
    """A batch of 80 'tokens' generated 5 ms apart that a sync can cut (partial rollouts): it keeps the
    versions of the tokens it made and goes on after the sync."""

    def __init__(self) -> None:
        self.cut = threading.Event()
        self.versions: dict[int, list[int]] = {}

    def produce(self, index, version):
        made = self.versions.setdefault(index, [])
        while len(made) < 80:
            if self.cut.is_set():
                return None
            time.sleep(0.005)
            made.append(version)
        return ProducedBatch(index, [], None, min(made), 0, 0.0)


def test_a_sync_cuts_a_partial_batch_instead_of_waiting_and_the_batch_goes_on():
    seg = Segmented()
    producer = RolloutProducer(seg.produce, dict, max_staleness=1, first_index=0, version=0, stop_index=3,
                               interrupt=seg.cut.set, resume=seg.cut.clear)
    producer.take(0)  # batch 0: version 0 throughout
    wait_for(lambda: seg.versions.get(1))  # batch 1 under way with version 0
    with producer.paused(interrupt=True):  # the sync after step 0
        # the sync got the engine with batch 1 unfinished: it cut the batch instead of waiting for it (a
        # count, not the 100 ms window this was, which a busy machine could overrun; the batch takes 0.4 s)
        assert len(seg.versions[1]) < 80, seg.versions[1]
        producer.advance(1)
    batch = producer.take(1)
    made = seg.versions[1]
    assert made[0] == 0 and made[-1] == 1 and made == sorted(made) and batch.policy_version == 0
    producer.close()
