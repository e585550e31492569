"""One vLLM engine per tensor-parallel group of ranks (``rollout.tensor_parallel_size > 1``; docs/gpu.md).

vLLM's in-process executor (``external_launcher``) lays the ranks out as ExternalDP x DP x PP x PCP x TP
(vllm/distributed/parallel_state.py, ``initialize_model_parallel``): with ``tensor_parallel_size=k``
ranks ``[0..k)``, ``[k..2k)``, ... each form one engine whose shards run every request together, while
the groups generate independently. Every rank of a group must therefore submit the SAME requests in
the same order, though the trainer deals each rank its own prompts. :class:`TensorParallelRollout`
gathers the group's prompts, has every rank submit their union with the group leader's sampling seed,
and hands each rank its own rows. Weight sync needs nothing extra: every rank loads the full tensors
a ZeRO-3 gather gives it, and vLLM's weight loaders keep the slice of the rank's TP shard.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from stapo.rollout import Rollout, SamplingParams


def tensor_parallel_group(tensor_parallel_size: int):
    """This rank's group of ``tensor_parallel_size`` consecutive ranks, as vLLM lays them out.
    Collective: every rank creates every group (torch's ``new_group`` contract). Gloo: it carries
    only the prompt lists."""
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


class TensorParallelRollout:
    """A rollout engine shared by the ranks of ``group`` (module doc); everything but ``generate``
    (sleep, wake, weight sync) goes to the engine as it is, on every rank."""

    def __init__(self, engine, group) -> None:
        self.engine, self.group = engine, group
        self.group_rank, self.group_size = dist.get_rank(group), dist.get_world_size(group)

    def generate(self, prompt_ids: Sequence[Sequence[int]], n: int, sampling: SamplingParams) -> Rollout:
        """``n`` samples of each of THIS rank's prompts; rows grouped per prompt, as the engine's."""
        shares: list = [None] * self.group_size
        dist.all_gather_object(shares, ([list(p) for p in prompt_ids], n, sampling), group=self.group)
        if any(share[1] != n for share in shares):
            raise ValueError(f"tensor-parallel ranks asked for different samples per prompt: {[s[1] for s in shares]}")
        union = [p for share in shares for p in share[0]]
        rollout = self.engine.generate(union, n, shares[0][2])  # the leader's seed: the same requests
        start = sum(len(share[0]) for share in shares[:self.group_rank])
        return rollout.select(torch.arange(start * n, (start + len(prompt_ids)) * n))

    #: not forwarded to the engine: a rank's calls must go through `generate`'s gather of the group's prompts
    generate_many = None

    def __getattr__(self, name):
        return getattr(self.engine, name)
