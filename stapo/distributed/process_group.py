"""Process-group setup and the few collectives the trainer needs (docs/distributed.md, "Launch").

One code path for every launch mode; ``RANK`` is global and decides data, seeds, files and collectives,
``LOCAL_RANK`` only picks the device.
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from stapo.losses.reduce import all_reduce_sum_, distributed_on
from stapo.losses.reduce import rank as get_rank  # noqa: F401  (the one rank / world-size lookup)
from stapo.losses.reduce import world_size as get_world_size

_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_MPI_SIZE_ENV = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: global ``rank`` of ``world_size``, ``local_rank`` on its node."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _launched() -> bool:
    """True under a torchrun/deepspeed/accelerate launch; raises on a half-set environment
    (``MASTER_*`` alone do not count: ``accelerate launch --cpu`` sets them for one process)."""
    present = [name for name in _LAUNCHER_ENV if name in os.environ]
    if "RANK" not in present and "WORLD_SIZE" not in present:
        return False
    if len(present) < len(_LAUNCHER_ENV):
        missing = [name for name in _LAUNCHER_ENV if name not in present]
        raise RuntimeError(
            f"incomplete launcher environment: {present} are set but {missing} are not; "
            "use deepspeed/torchrun/accelerate launch, or unset them for a single process")
    return True


def _mpi_world_size() -> int:
    return max([int(os.environ[name]) for name in _MPI_SIZE_ENV if name in os.environ] or [1])


def launcher_world_size() -> int:
    """The number of ranks the launcher started (``WORLD_SIZE``, or MPI's), 1 without a launcher;
    read from the environment without joining a process group (``stapo train --dry-run``)."""
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return _mpi_world_size()


def default_backend() -> str:
    """NCCL where CUDA is, else gloo: the training group's and the weight broadcast's default."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(backend: str | None = None, timeout: timedelta | None = None) -> DistInfo:
    """Join (or create; an existing group is reused) the default process group: this rank's :class:`DistInfo`.

    ``timeout`` (``trainer.collective_timeout_minutes``): DeepSpeed's 10 minutes is short for RL's uneven generation.
    """
    import deepspeed  # heavy: only the trainer pays for it

    launched = _launched()  # validates a half-set launcher environment even when a group exists
    backend = backend or default_backend()
    use_cuda = backend == "nccl" and torch.cuda.is_available()
    if use_cuda and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # before NCCL binds a device
    from deepspeed.constants import default_pg_timeout

    timeout_kw = {"timeout": timeout or default_pg_timeout}
    if not dist.is_initialized():
        if launched:
            deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False, **timeout_kw)
        elif _mpi_world_size() > 1:  # mpirun (e.g. accelerate's multi-CPU mode): needs mpi4py
            deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=True, verbose=False, **timeout_kw)
        else:
            os.environ.setdefault("LOCAL_RANK", "0")  # read by DeepSpeedEngine, see module doc
            dist.init_process_group(
                backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1, **timeout_kw
            )
    elif timeout is not None:
        dist.distributed_c10d._set_pg_timeout(timeout)  # the group existed: set it there
    # Registers DeepSpeed's communication wrapper around the existing group (no-op if done).
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False, **timeout_kw)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device)


def barrier() -> None:
    """Wait for every rank (no-op without a process group)."""
    if distributed_on():
        dist.barrier()


def close_distributed() -> None:
    """Leave the default process group once every rank is done: a gloo group left to the interpreter's exit
    can abort the process after its work finished."""
    if distributed_on():
        dist.barrier()
        dist.destroy_process_group()


def exit_process(status: int) -> NoReturn:
    """End a process whose work is done with ``status``, and nothing else: leave the group (after a success,
    when every rank gets here), run the ``atexit`` handlers (logging, child processes, temp files), flush, and
    exit without the interpreter's C++ teardown, where gloo's and DeepSpeed's threads can still abort a
    finished process ("terminate called without an active exception", status -6 instead of ``status``)."""
    if status == 0:
        close_distributed()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj``, indexed by rank."""
    if not distributed_on():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank: one rank decides what all must agree on (the checkpoint to resume)."""
    if not distributed_on():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_reduce_max(value: float) -> float:
    """The maximum of ``value`` over all ranks (itself without a process group)."""
    if get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def comm_device(group=None) -> torch.device:
    """Where a collective's tensors must live: NCCL needs accelerator tensors, gloo takes CPU ones."""
    if distributed_on() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def reduce_metrics(sums: dict[str, torch.Tensor | float]) -> dict[str, float]:
    """Sum each named per-rank sum over all ranks in ONE all-reduce, in float64 (billions of tokens stay
    exact); divide after reducing, so means do not depend on the split."""
    if not sums:
        return {}
    names = list(sums)
    device = comm_device()
    values = [torch.as_tensor(sums[name]).detach() for name in names]
    bad = [name for name, value in zip(names, values) if value.numel() != 1]
    if bad:
        raise ValueError(f"reduce_metrics expects scalars; not scalar: {bad}")
    stacked = torch.stack([v.to(device, torch.float64).reshape(()) for v in values])  # (M,)
    return dict(zip(names, all_reduce_sum_(stacked).tolist()))
