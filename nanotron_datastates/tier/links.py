"""The way replicas' bytes travel between ranks (`Link`), chosen once for the job (`open_link`,
`memory_replica_transport`): NCCL through the GPUs (link_nccl.py) where every rank has one and PyTorch has
NCCL, its calls made at the optimizer steps while training runs (step_order.py), else gloo from host memory
over TCP (`GlooLink`). `auto` sends replicas while training runs over gloo and pulls a restart's over NCCL:
NCCL's copies and kernels take turns with the step's own on the GPU's one queue, and cost the steps more
than gloo's host copies (benchmarks/NOTES.md). The choice is named in the log and the telemetry.
"""

from __future__ import annotations

from typing import Protocol, Union

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from .replica_transfer import CHUNK, Arriving, Landed, ReplicaError, Transfer, gather, move
from .step_order import StepOrder

# gloo groups a gloo link sends over at once, one TCP stream and I/O thread each: between two ranks of one
# host, into new tmpfs pages, one moved 0.52 GB/s a rank, four 1.82, eight 2.76 (benchmarks/NOTES.md); four
# keep fewer threads copying beside the training's own
GLOO_STREAMS = 4


class Link(Protocol):
    """Moves files' bytes between ranks, every rank of the group at once (both ends of a pair list its
    files in the same order); paced to `gbps` GB/s sent (0: no limit); returns the seconds it took."""

    name: str
    chunk: int  # bytes of a message (NCCL: of a wave's chunk)
    order: StepOrder | None  # while training runs, NCCL's calls made at the optimizer steps

    def move(
        self,
        sends: list[Transfer],
        recvs: list[Transfer],
        gbps: float = 0.0,
        waves: int = 0,
        landed: Landed | None = None,
        arriving: Arriving | None = None,
    ) -> float:
        """`landed(t)`: called, from any thread, for each file received whole, as soon as it is;
        `arriving(t, n)`, for a file not whole yet, as its first n bytes are in."""

    def reserve(self, outs: int, ins: int) -> None:
        """Makes now what moving to `outs` peers and from `ins` peers needs: before training, not during."""

    def close(self) -> None: ...


class GlooLink:
    """Host memory to host memory over gloo groups of the same ranks (`streams`: one, or a list whose
    pieces of each chunk travel side by side, each group over its own connections), `chunk` bytes a wave."""

    name = "gloo"
    order: StepOrder | None = None  # host to host: nothing in the GPU's queue to keep in order

    def __init__(
        self, streams: Union[ProcessGroup, list[ProcessGroup], tuple[ProcessGroup, ...]], chunk: int = CHUNK
    ) -> None:
        self.groups = list(streams) if isinstance(streams, (list, tuple)) else [streams]
        self.chunk = chunk

    def move(
        self,
        sends: list[Transfer],
        recvs: list[Transfer],
        gbps: float = 0.0,
        waves: int = 0,
        landed: Landed | None = None,
        arriving: Arriving | None = None,
    ) -> float:
        return move(self.groups, sends, recvs, gbps, self.chunk, landed, arriving)  # `waves`: NCCL's

    def reserve(self, outs: int, ins: int) -> None:
        pass  # gloo sends from and receives into the files' mappings: no buffers of its own

    def close(self) -> None:
        pass


def nccl_here() -> str | None:
    """Why this rank cannot move replicas through NCCL (None: it can)."""
    if not dist.is_nccl_available():
        return "PyTorch was built without NCCL"
    if not torch.cuda.is_available():
        return "no GPU"
    return None


def gloo_link(gloo: ProcessGroup, chunk: int | None = None, streams: int = GLOO_STREAMS) -> GlooLink:
    """A gloo link over `gloo` and `streams` - 1 gloo groups more over every rank, made now (collective
    over every rank: `gloo` is over every rank too)."""
    more = [dist.new_group(backend="gloo") for _ in range(streams - 1)]
    return GlooLink([gloo, *more], chunk or CHUNK)


def open_link(
    gloo: ProcessGroup,
    transport: str = "auto",
    chunk: int | None = None,
    at_steps: bool = False,
    streams: int = GLOO_STREAMS,
) -> Link:
    """The job's link (collective: every rank calls it, with the same `transport`): 'nccl' makes an NCCL
    group of its own over every rank (its communicator opened now, on this rank's current GPU, not at the
    first transfer) and fails, naming the setting and the rank, where a rank cannot use it; 'gloo' uses
    `gloo`, a gloo group over every rank, and `streams` - 1 more made here (`gloo_link`); 'auto' takes NCCL
    where every rank can, else gloo. `chunk`: the bytes of a message (default: each link's own).
    `at_steps`: for replicas sent while training runs, an NCCL link's calls are made at the optimizer
    steps (its `order`, on a gloo group of its own made here: step_order.py), with TRAINING_SLOTS waves
    ready at most; 'auto' then takes gloo."""
    if transport == "auto" and at_steps:  # every rank alike: the same setting, the same call
        return gloo_link(gloo, chunk, streams)
    asked = gather(gloo, nccl_here() if transport != "gloo" else "not asked for")
    cannot = [(rank, why) for rank, why in enumerate(asked) if why]
    if transport == "nccl" and cannot:
        rank, why = cannot[0]
        raise ReplicaError(f"datastates.memory_replica_transport=nccl: rank {rank} cannot use NCCL ({why})")
    if cannot:
        return gloo_link(gloo, chunk, streams)
    from .link_nccl import CHUNK as NCCL_CHUNK
    from .link_nccl import SLOTS, TRAINING_SLOTS, NcclLink

    device = torch.device("cuda", torch.cuda.current_device())
    group = dist.new_group(backend="nccl")
    dist.all_reduce(torch.zeros(1, device=device), group=group)  # opens the communicator, every rank at once
    torch.cuda.synchronize(device)
    order = StepOrder(dist.new_group(backend="gloo")) if at_steps else None
    slots = TRAINING_SLOTS if at_steps else SLOTS
    return NcclLink(group, device, chunk or NCCL_CHUNK, slots, order=order)
