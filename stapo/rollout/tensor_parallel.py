"""One vLLM engine per tensor-parallel group of ranks (``rollout.tensor_parallel_size > 1``; docs/gpu.md).

vLLM's ``external_launcher`` needs every rank of a group to submit the SAME requests: `TensorParallelRollout`
submits the group's union (each request keeps its seed) and hands each rank its own segments.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist

from stapo.rollout.engine import RolloutEngine, Segment, SegmentRequest
from stapo.rollout.sampling import SamplingParams


def tensor_parallel_group(tensor_parallel_size: int):
    """This rank's gloo group of ``tensor_parallel_size`` consecutive ranks, as vLLM lays them out (collective:
    every rank creates every group, torch's ``new_group`` contract)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if tensor_parallel_size < 1 or world % tensor_parallel_size:
        raise ValueError(f"rollout.tensor_parallel_size ({tensor_parallel_size}) must divide the number of "
                         f"ranks ({world})")
    mine = None
    for start in range(0, world, tensor_parallel_size):
        group = dist.new_group(list(range(start, start + tensor_parallel_size)), backend="gloo")
        if start <= rank < start + tensor_parallel_size:
            mine = group
    return mine


class TensorParallelRollout(RolloutEngine):
    """A rollout engine shared by the ranks of ``group``: segments go through the group's union of requests;
    weights, memory and the engine's facts are the engine's, on every rank."""

    def __init__(self, engine: RolloutEngine, group) -> None:
        self.engine, self.group = engine, group
        self.group_rank, self.group_size = dist.get_rank(group), dist.get_world_size(group)
        self.tokenizer, self.pad_token_id = engine.tokenizer, engine.pad_token_id
        self.max_model_len = engine.max_model_len

    def generate_segments(self, requests: Sequence[SegmentRequest], sampling: SamplingParams) -> list[Segment]:
        """THIS rank's segments, from one submission of the whole group's requests on every rank."""
        shares: list = [None] * self.group_size
        dist.all_gather_object(shares, list(requests), group=self.group)
        union = [r for share in shares for r in share]
        start = sum(len(share) for share in shares[:self.group_rank])
        return self.engine.generate_segments(union, sampling)[start: start + len(requests)]

    @property
    def needs_weights(self) -> bool:
        return self.engine.needs_weights

    @property
    def policy_version(self) -> int | None:
        return self.engine.policy_version

    def weight_update(self, version: int | None = None):
        return self.engine.weight_update(version)

    def load_weights(self, weights) -> None:
        self.engine.load_weights(weights)

    def sleep(self) -> None:
        self.engine.sleep()

    def wake(self) -> None:
        self.engine.wake()

    def close(self) -> None:
        self.engine.close()
