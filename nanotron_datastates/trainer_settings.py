"""TrainerSettings: the whole `datastates:` section of Nanotron's YAML, one flat, validated dataclass.

The engine's keys are those of `DataStatesConfig`, which it extends; the trainer's own follow (rotation,
staging on the GPU, queuing at the step, telemetry, the memory tier). Parsed once from the YAML
(`TrainerSettings.from_dict`), it is `config.datastates`, the Saver's settings and the engine's config alike.
Imports no Nanotron.
"""

from __future__ import annotations

from dataclasses import dataclass

from .engine_settings import DataStatesConfig

_ALWAYS_NEVER = {True: "always", False: "never", "true": "always", "false": "never"}


def _key(value: object) -> bool | str | None:
    """`value` as a key of _ALWAYS_NEVER: a bool itself, a string lowered (None for anything else)."""
    return value if isinstance(value, bool) else value.strip().lower() if isinstance(value, str) else None


@dataclass(frozen=True)
class TrainerSettings(DataStatesConfig):
    """Every key of the `datastates:` section: the engine's (`DataStatesConfig`), then what the Nanotron
    trainer does around the engine. Read by attribute (`config.datastates.keep_last_n`) or by key."""

    RANGES = {
        **DataStatesConfig.RANGES,
        "keep_last_n": (0, 1 << 20, "expected an integer >= 0 (0 keeps every checkpoint)"),
        "memory_tier_copies": (1, 2, "expected 1 or 2"),
        "memory_replicas": (0, 64, "expected an integer in [0, 64] (0: none)"),
        "memory_replica_gbps": (0, 1e4, "expected GB/s in [0, 10000] (0: no limit)"),
        "memory_interval": (0, 1 << 30, "expected a number of steps >= 0 (0: none)"),
    }
    CHOICES = {
        **DataStatesConfig.CHOICES,
        "device_snapshot": ("auto", "always", "never"),
        "memory_replica_transport": ("auto", "nccl", "gloo"),
        "memory_replica_process": ("auto", "always", "never"),
    }

    keep_last_n: int = 0
    """Keep the newest N committed checkpoints and remove older ones, off the training thread, once a newer
    one is committed (never the one `latest.txt` names, never one in flight). 0 keeps every checkpoint; at
    least 2 are kept, so that a restart whose newest checkpoint is damaged has one to fall back to."""
    device_snapshot: str = "auto"
    """Copy each checkpoint on the GPU first (at memory speed, in the training stream's order), so that the
    optimizer step never waits for the copies to the host, which then read from that copy. 'auto' does so
    when the GPU has room for it above the peak memory training has used so far, with the larger of 1 GiB
    and 5% of the GPU to spare; 'always' whenever the memory can be had (without a GPU: a copy in host
    memory); 'never'. With memory checkpoints every 10 steps or fewer (`memory_interval`), the copy's
    memory stays allocated between checkpoints, and each checkpoint copies into it."""
    queue_at_step: bool = True
    """For checkpoints copied on the GPU first: plan and copy the state's files on a thread of the saver's
    own, beside the next forward and backward passes (neither changes them), the next optimizer step
    waiting until that is done, and queue every file once that step is launched. The training thread then
    spends well under a millisecond a checkpoint; in `save_checkpoint`, just after Nanotron's end-of-step
    synchronization, the GPU would wait for the copies' launch. Off: everything is queued on the training
    thread before `save_checkpoint` returns (for a training step captured as CUDA graphs, which another
    thread's launches must not meet)."""
    telemetry: bool = True
    """Append one JSON line per checkpoint to `datastates_telemetry.jsonl` in the checkpoints folder (bytes,
    stall, snapshot, persisted, throughput, cache high-water mark and waits)."""
    balance_writes: bool = True
    """Share the files the data- and context-parallel replicas of a model shard hold alike (its weights, the
    optimizer's without ZeRO, the scheduler's) out among them, each file to one replica, the largest first to
    the least loaded, so that each copies and writes about an equal part. The files are Nanotron's either
    way: only who writes each changes. Off: rank 0 of the replicas writes them all, as Nanotron does."""
    memory_tier: bool = False
    """Keep the newest committed checkpoint of each rank in node-local shared memory too (`memory_tier_path`),
    so that a restart on the same node (a killed process, torchrun's restarts, a relaunch) reads it from
    memory. The tier's files are the saves' host memory (in place of host cache chunks, no second copy).
    Needs room for `memory_tier_copies` checkpoints of the node's ranks there (checked after the first step);
    removed when training ends normally. With `memory_replicas`, a copy on the next node too."""
    memory_tier_copies: int = 2
    """Checkpoints of each rank the memory tier keeps: 2, the committed one stays whole while the next is
    taken; 1, the next overwrites it (withdrawn first: a restart never reads it half overwritten), in the
    memory of one checkpoint, and a crash while a checkpoint is in flight restarts from storage."""
    memory_tier_path: str = "/dev/shm/nanotron-datastates-{uid}"
    """Where the memory tier keeps its files: a tmpfs folder private to this user (`{uid}` is replaced by
    the user's id; created 0700, refused if another user owns it or others may write to it)."""
    memory_replicas: int = 0
    """With the memory tier: the ranks of other nodes that keep a copy of each rank's newest committed
    checkpoint in their memory too (a ring over nodes), sent after each commit; a job that loses a node then
    restarts from memory, the lost ranks' state pulled from their peers. Each node then needs room for two
    replicas per copy it holds besides its own (checked after the first step). 0: none."""
    memory_replica_gbps: float = 20.0
    """GB/s each rank sends its replicas at, at most, so that training's own traffic keeps the network
    (0: no limit). A restart pulls what its node lacks at full speed: nothing else runs then."""
    memory_replica_transport: str = "auto"
    """How replicas travel: 'nccl', GPU to GPU on an NCCL communicator and CUDA streams of their own (NVLink
    within a node, the cluster's network between nodes); while training runs, each wave's calls (32 MiB a
    peer and direction, 8 ready at most: 512 MiB of GPU memory and as much pinned per replica) are made by
    the training thread at an optimizer step, in the same place of every rank's collectives (a second
    communicator's kernels queued in another order deadlock the training's); a restart pulls unpaced.
    'gloo', host memory to host memory over TCP. 'auto': replicas sent while training runs over gloo (over
    NCCL, with one hardware queue for every stream, their copies took turns with the step's kernels: the
    180M's mean step +55% against +14% over gloo, benchmarks/NOTES.md), a restart's pull over NCCL where every
    rank has a GPU and PyTorch has NCCL, else gloo."""
    memory_replica_process: str = "auto"
    """Who sends the replicas while training runs (over gloo): 'always', a process of each rank's own,
    spawned at the start (it meets the others through torchrun's store); 'never', threads of the training
    process; 'auto', the process where every rank can start one (torchrun's store in the environment, not a
    daemonic process, the transport not 'nccl'), else the threads. From outside the training process the
    same replicas cost the steps less (180M, dp2: 28 ms over the 8 steps after a checkpoint against 94 ms,
    benchmarks/NOTES.md). true and false mean always and never. A restart pulls as without."""
    memory_interval: int = 0
    """With the memory tier: also take a checkpoint into memory only (the tier, and the replicas with
    `memory_replicas`) every N steps, between Nanotron's `checkpoint_interval` checkpoints to storage. A
    restart resumes from the newest checkpoint, in memory or storage, that the nodes hold whole, so a failure
    loses at most N steps. 0: none."""

    def __post_init__(self) -> None:
        alias = _ALWAYS_NEVER.get(_key(self.memory_replica_process))
        if alias is not None:  # frozen: the alias replaced by its name before the fields are checked
            object.__setattr__(self, "memory_replica_process", alias)
        super().__post_init__()
        if self.memory_replicas and not self.memory_tier:
            raise ValueError(
                f"datastates.memory_replicas={self.memory_replicas} is invalid: expected an integer in "
                "[0, 64], and 0 where datastates.memory_tier is false (replicas copy the memory tier's)"
            )
        if self.memory_replica_process == "always" and self.memory_replica_transport == "nccl":
            raise ValueError(
                "datastates.memory_replica_process=always is invalid with "
                "datastates.memory_replica_transport=nccl: the replica process sends over gloo (set the "
                "transport to auto or gloo)"
            )
        if self.memory_interval and not self.memory_tier:
            raise ValueError(
                f"datastates.memory_interval={self.memory_interval} is invalid: expected a number of steps "
                ">= 0, and 0 where datastates.memory_tier is false (memory checkpoints go into the tier)"
            )
