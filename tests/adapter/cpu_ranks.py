"""Nanotron's real classes on a CPU machine: a gloo ParallelContext, a small Llama (tied embeddings, tensor-
parallel layers), its optimizer (ZeRO or not), LR scheduler, random states and training metadata.

Two of Nanotron's calls are CUDA-only and get CPU stand-ins here: `ParallelContext.set_device` (picks the
rank's GPU) and the pipeline's P2P buffers (allocated on "cuda"). Nothing else is changed.

Run as a script, once per rank (`launch`): each rank builds that state for a layout, writes Nanotron's own
checkpoint of it (`stock/`, with Nanotron's save functions), and reports which files the adapter plans for it
(`rank-<r>.json`), so a test compares the two. With `roundtrip=True` each rank instead saves its state with
the adapter's Saver, changes it, resumes it with the adapter's Resume into a state built afresh, and reports
every tensor that differs from the one captured at the save.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "config_tiny_llama_datastates.yaml"


def parallel_context(tp: int = 1, dp: int = 1, pp: int = 1, cp: int = 1) -> Any:
    """Nanotron's ParallelContext over the gloo process group already initialized."""
    from nanotron.parallel import ParallelContext
    from nanotron.parallel.pipeline_parallel import p2p

    ParallelContext.set_device = lambda self: None
    if not getattr(p2p.P2P, "_cpu", False):
        init = p2p.P2P.__init__
        p2p.P2P.__init__ = lambda self, pg, device: init(self, pg, torch.device("cpu"))
        p2p.P2P._cpu = True
    kw = {}
    if cp > 1 or "context_parallel_size" in inspect.signature(ParallelContext).parameters:
        kw["context_parallel_size"] = cp  # a Nanotron without context parallelism fails here, as it should
    return ParallelContext(tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp, **kw)


def config(tp: int = 1, dp: int = 1, pp: int = 1, cp: int = 1, zero_stage: int = 0) -> Any:
    """The example YAML, parsed by Nanotron, with this layout and a model of a few thousand parameters."""
    from nanotron.config import get_config_from_file

    from nanotron_datastates.nanotron import yaml_config as ds_config

    ds_config.register()  # the example's `datastates:` keys
    c = get_config_from_file(str(EXAMPLE))
    c.parallelism.tp, c.parallelism.dp, c.parallelism.pp = tp, dp, pp
    if cp > 1:
        c.parallelism.context_parallel_size = cp
    c.optimizer.zero_stage = zero_stage
    c.optimizer.accumulate_grad_in_fp32 = False  # its fp32 gradient buffers are allocated on "cuda"
    m = c.model.model_config
    m.hidden_size, m.intermediate_size, m.num_hidden_layers = 16, 32, 2
    m.num_attention_heads = m.num_key_value_heads = 4
    m.vocab_size, m.max_position_embeddings = 64, 32
    m.tie_word_embeddings = True
    return c


def training_state(pc: Any, c: Any, seed: int = 0) -> tuple[Any, Any, Any, Any]:
    """(model, optimizer, lr_scheduler, random_states) as Nanotron's trainer builds them; one optimizer step
    taken, so that the Adam moments exist."""
    from nanotron.helpers import init_optimizer_and_grad_accumulator, lr_scheduler_builder
    from nanotron.models import build_model
    from nanotron.models.llama import LlamaForTraining
    from nanotron.parallel.parameters import NanotronParameter
    from nanotron.random import RandomStates, get_current_random_state
    from nanotron.scaling.parametrization import ParametrizationMethod
    from nanotron.trainer import mark_tied_parameters

    torch.manual_seed(seed)
    random_states = RandomStates({"tp_synced": get_current_random_state()})
    model = build_model(
        model_builder=lambda: LlamaForTraining(
            config=c.model.model_config,
            parallel_context=pc,
            parallel_config=c.parallelism,
            random_states=random_states,
        ),
        parallel_context=pc,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    mark_tied_parameters(model=model, parallel_context=pc, parallel_config=c.parallelism)
    with torch.no_grad():
        for name, p in model.get_named_params_with_correct_tied():
            p.copy_(by_position(p, name, seed))
    optimizer, _ = init_optimizer_and_grad_accumulator(
        parametrization_method=ParametrizationMethod.STANDARD,
        model=model,
        optimizer_args=c.optimizer,
        parallel_context=pc,
    )
    step(model, optimizer)
    assert all(isinstance(p, NanotronParameter) for p in model.parameters())
    lr_scheduler = lr_scheduler_builder(
        optimizer=optimizer,
        lr_scheduler_args=c.optimizer.learning_rate_scheduler,
        total_training_steps=c.tokens.train_steps,
    )
    return model, optimizer, lr_scheduler, random_states


def by_position(p: Any, name: str, seed: int) -> torch.Tensor:
    """This rank's part of a full tensor drawn for parameter `name`: the same values, element for element,
    whatever the layout (so that states of different layouts can be compared)."""
    import zlib

    full_shape = p.get_sharded_info().unsharded_shape if p.is_sharded else p.shape
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    full = torch.randn(tuple(full_shape), generator=g)
    if not p.is_sharded:
        return full.to(p.dtype)
    local = torch.empty(p.shape, dtype=p.dtype)
    for pair in p.get_sharded_info().local_global_slices_pairs:
        local[pair.local_slices] = full[pair.global_slices]
    return local


def step(model: Any, optimizer: Any, k: int = 1) -> None:
    """One optimizer step with gradients drawn by position (`by_position`), the same whatever the layout."""
    for name, p in model.get_named_params_with_correct_tied():
        p.grad = by_position(p, name, 100 + k)
    optimizer.step()
    optimizer.zero_grad()


def snapshot(model: Any, optimizer: Any, lr_scheduler: Any, random_states: Any) -> dict[str, Any]:
    """Copies of everything a checkpoint holds, to compare a resumed state with."""
    import copy

    return copy.deepcopy(
        {
            "model": {k: v.detach() for k, v in model.state_dict().items()},
            "optimizer": optimizer.state_dict(),
            "lr_scheduler": lr_scheduler.state_dict(),
            "random": {k: vars(v) for k, v in random_states.items()},
        }
    )


def differences(a: Any, b: Any, where: str = "") -> list[str]:
    """Where two nested states differ (tensors bit for bit, dtype and shape included)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        ok = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
        ok = ok and a.dtype == b.dtype and a.shape == b.shape
        ok = ok and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        return [] if ok else [where]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{where}: keys {sorted(map(str, set(a) ^ set(b)))}"]
        return [d for k in a for d in differences(a[k], b[k], f"{where}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    if hasattr(a, "__array__") and hasattr(b, "__array__"):
        import numpy as np

        return [] if np.array_equal(a, b) else [where]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def count_tensors(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return 1
    if isinstance(x, dict):
        return sum(count_tensors(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return sum(count_tensors(v) for v in x)
    return 0


def roundtrip(pc: Any, c: Any, work: Path) -> dict[str, Any]:
    """Saves this rank's state with the Saver (rank 0 commits), steps on, then resumes it with Resume into a
    state built afresh from another seed; returns what differs from the state captured at the save.

    With CPU_RANKS_REPLICAS=N, the ranks are on two simulated nodes (the first half and the second, each with
    its own memory tier root), the tier on with N memory replicas; the job then ends as a crash does (no
    release of the tier) and the second node's tier is wiped before the resume: a lost node. With
    CPU_RANKS_MEMORY=1 too (or alone: one node), a memory checkpoint of step 9 follows two steps later, and
    the state compared is the one it captured."""
    from nanotron_datastates import DataStatesEngine
    from nanotron_datastates.nanotron.resume.resume import Resume
    from nanotron_datastates.nanotron.save.commit_files import finalizer
    from nanotron_datastates.nanotron.save.saver import Saver
    from nanotron_datastates.trainer_settings import TrainerSettings

    replicas = int(os.environ.get("CPU_RANKS_REPLICAS", "0"))
    memory = os.environ.get("CPU_RANKS_MEMORY") == "1"
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    node = rank // max(1, world // 2) if replicas else 0
    if replicas or memory:
        os.environ["GROUP_RANK"] = str(node)
        c.datastates = TrainerSettings.from_dict(
            {"memory_tier": True, "memory_tier_path": str(work / f"node{node}-shm"),
             "memory_replicas": replicas, "memory_replica_gbps": 0, "memory_interval": 3 if memory else 0,
             "memory_replica_process": os.environ.get("CPU_RANKS_REPLICA_PROCESS", "never")},
            env=False,
        )  # fmt: skip
    state = training_state(pc, c)
    model, optimizer, lr_scheduler, random_states = state
    ckpt = work / "ckpt"
    summed = os.environ.get("CPU_RANKS_MEMORY_CHECKSUMS") == "1"
    engine = DataStatesEngine(host_cache_size=1 / 64, chunk_size=1, memory_checksums=summed)
    saver = Saver(engine, c.datastates, pc, model, optimizer, ckpt)
    saver.start()  # in the CheckpointManager's order
    events: list[str] = []
    saver.observers.append(lambda event, fields: events.append(event))
    saver.after_first_step()
    saved = snapshot(*state)
    finalize = None
    if torch.distributed.get_rank() == 0:
        finalize = functools.partial(
            finalizer,
            step=7,
            checkpoints=ckpt,
            pc=pc,
            config=c,
            model_config=c.model.model_config,
            optimizer=optimizer,
            metadata=training_metadata(7),
            replicas=saver.placement,  # as the trainer mixin asks
        )
    saver.request(7, lr_scheduler, random_states, finalize)
    saver.before_step()
    step(model, optimizer, 2)  # the checkpoint holds the state asked for, not this one
    if memory:  # as the trainer mixin asks at step 9 (memory_interval 3); storage keeps 7
        from nanotron_datastates.nanotron.save.commit_files import memory_documents

        assert saver.memory_due(9) and not saver.memory_due(7) and not saver.memory_due(8)
        saver.backpressure(lambda s: None)
        saved = snapshot(*state)
        docs = memory_documents(
            step=9, pc=pc, config=c, metadata=training_metadata(9), replicas=saver.placement
        )
        saver.request(9, lr_scheduler, random_states, None, memory=docs)
        saver.before_step()
        step(model, optimizer, 2)
        assert not saver.memory_due(9)
    if not replicas and not memory:
        saver.drain(lambda s: None)
    saver.close()
    engine.close()
    if replicas:
        import shutil

        torch.distributed.barrier()
        if rank == world // 2:  # the second node is lost, its memory with it
            shutil.rmtree(work / "node1-shm")
        torch.distributed.barrier()

    fresh = training_state(pc, c, seed=1)
    resume = Resume()
    assert resume.plan(c, pc, ckpt / "7", device=torch.device("cpu"))
    resume.load_weights(fresh[0])
    resume.load_rest(*fresh[1:], fresh[0])
    metadata = resume.confirm()
    resume.before_step()
    resume.finish(close_engine=True)
    held = None
    if replicas or memory:  # the steps this rank's tier marks held after the resume (a pull marks them too)
        from nanotron_datastates.tier.memory import MemoryTier

        held = MemoryTier(work / f"node{node}-shm", ckpt, rank).held_steps()
    manifest = json.loads((resume.folder / "datastates.json").read_text())
    return {
        "held": held,
        "summed": sorted({"crc32c" in entry for entry in manifest["files"].values()}),
        "unsummed": [n for n, e in manifest["files"].items() if "crc32c" not in e],
        "events": events,
        "differences": differences(saved, snapshot(*fresh)),
        "tensors": count_tensors(saved),
        "last_train_step": metadata.last_train_step,
        "flags": [c.checkpoints.load_optimizer, c.checkpoints.load_lr_scheduler],
        "source": str(resume.source) if resume.source else None,
        "folder": str(resume.folder),
        "node": node,
    }


def save_only(pc: Any, c: Any, work: Path) -> dict[str, Any]:
    """This layout's state, saved by the Saver into `work/ckpt/7` (rank 0 commits); with CPU_RANKS_TWO set,
    into `work/ckpt/5`, then, a step later, `work/ckpt/9`."""
    from nanotron_datastates import DataStatesEngine
    from nanotron_datastates.nanotron.save.commit_files import finalizer
    from nanotron_datastates.nanotron.save.saver import Saver
    from nanotron_datastates.trainer_settings import TrainerSettings

    model, optimizer, lr_scheduler, random_states = training_state(pc, c)
    engine = DataStatesEngine(host_cache_size=1 / 64, chunk_size=1)
    saver = Saver(engine, TrainerSettings(), pc, model, optimizer, work / "ckpt")
    finalize = None
    if torch.distributed.get_rank() == 0:
        finalize = functools.partial(finalizer, step=7, checkpoints=work / "ckpt", pc=pc, config=c,
                             model_config=c.model.model_config, optimizer=optimizer,
                             metadata=training_metadata(7))  # fmt: skip
    first = 5 if os.environ.get("CPU_RANKS_TWO") else 7
    if first == 5:
        saver.request(5, lr_scheduler, random_states, finalize_at(5, pc, c, optimizer, work))
        saver.before_step()
        step(model, optimizer, 2)
        saver.request(9, lr_scheduler, random_states, finalize_at(9, pc, c, optimizer, work))
    else:
        saver.request(7, lr_scheduler, random_states, finalize)
    saver.drain(lambda s: None)
    saver.close()
    engine.close()
    return {}


def finalize_at(at: int, pc: Any, c: Any, optimizer: Any, work: Path) -> Any:
    from nanotron_datastates.nanotron.save.commit_files import finalizer

    if torch.distributed.get_rank() != 0:
        return None
    return functools.partial(finalizer, step=at, checkpoints=work / "ckpt", pc=pc, config=c,
                             model_config=c.model.model_config, optimizer=optimizer,
                             metadata=training_metadata(at))  # fmt: skip


def resume_other(pc: Any, c: Any, work: Path) -> dict[str, Any]:
    """Resumes `work/ckpt/7`, saved on another layout, into a state built afresh from another seed; returns
    what differs from the state this layout holds after the same training (the same by construction:
    `by_position`), random states aside (another layout's ranks take those of the saved ranks at their
    places: compared where the rank existed)."""
    from nanotron_datastates.nanotron.resume.resume import Resume
    from nanotron_datastates.save.commit import CheckpointError

    if os.environ.get("CPU_RANKS_INTERMEDIATE"):  # another model than the one saved
        c.model.model_config.intermediate_size = int(os.environ["CPU_RANKS_INTERMEDIATE"])
        resume = Resume()
        resume.plan(c, pc, work / "ckpt" / "7", device=torch.device("cpu"))
        state = training_state(pc, c)
        resume.load_weights(state[0])
        resume.load_rest(*state[1:], state[0])
        try:
            resume.confirm()
        except CheckpointError as e:
            return {"error": str(e)}
        return {"error": None}
    expected = snapshot(*training_state(pc, c))
    fresh = training_state(pc, c, seed=1)
    resume = Resume()
    at = os.environ.get("CPU_RANKS_STEP", "7")
    assert resume.plan(c, pc, work / "ckpt" / at, device=torch.device("cpu"))
    warmed = [str(p.relative_to(work / "ckpt" / at)) for p in resume.warmer.paths] if resume.warmer else []
    resume.load_weights(fresh[0])
    resume.load_rest(*fresh[1:], fresh[0])
    metadata = resume.confirm()
    resume.before_step()
    resume.finish(close_engine=True)
    got = snapshot(*fresh)
    expected.pop("random"), got.pop("random")
    return {
        "differences": differences(expected, got),
        "tensors": count_tensors(expected),
        "last_train_step": metadata.last_train_step,
        "resumed_from": resume.folder.name,
        "warmed": warmed,
    }


def two_gloo_ranks(target: Any, args_of: Any, timeout: float = 600.0) -> dict[int, Any]:
    """Runs `target(rank, *args_of(rank), out)` in two spawned processes, each of which puts (rank, answer)
    on the queue `out`; returns the answers by rank, once both processes have exited 0."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    ranks = [context.Process(target=target, args=(r, *args_of(r), out)) for r in range(2)]
    for p in ranks:
        p.start()
    answers = dict(out.get(timeout=timeout) for _ in ranks)
    for p in ranks:
        p.join(60)
        assert p.exitcode == 0, p.exitcode
    return answers


def training_metadata(step: int) -> Any:
    """Nanotron's TrainingMetadata after `step` steps, with every field this Nanotron has set."""
    from nanotron.serialize.metadata import DataStageMetadata, TrainingMetadata

    stage = {"name": "stable", "start_training_step": 1, "consumed_train_samples": 8 * step}
    stage_fields = {f.name for f in dataclasses.fields(DataStageMetadata)}
    if "sequence_length" in stage_fields:  # Nanotron main: tokens per dataset folder, for its dataloader
        stage.update(
            sequence_length=32,
            consumed_tokens_per_dataset_folder={"/data/a": 200 * step, "/data/b": 56 * step},
        )
    meta = {"consumed_train_samples": 8 * step, "last_train_step": step, "last_stage_idx": 0}
    if "consumed_tokens_total" in {f.name for f in dataclasses.fields(TrainingMetadata)}:
        meta["consumed_tokens_total"] = 256 * step
    return TrainingMetadata(data_stages=[DataStageMetadata(**stage)], **meta)


def stock_save(pc: Any, c: Any, state: tuple[Any, Any, Any, Any], root: Path, step: int) -> None:
    """Nanotron's own checkpoint of `state`, by its trainer's rules (weights, optimizer, scheduler, random
    states, metadata), but for config.yaml."""
    from nanotron.serialize.metadata import save_meta
    from nanotron.serialize.optimizer import save_lr_scheduler, save_optimizer
    from nanotron.serialize.random import save_random_states
    from nanotron.serialize.weights import save_weights

    model, optimizer, lr_scheduler, random_states = state
    save_weights(model=model, parallel_context=pc, root_folder=root)  # returns on all but the rank writing
    save_optimizer(optimizer=optimizer, parallel_context=pc, root_folder=root)
    save_lr_scheduler(
        lr_scheduler=lr_scheduler, is_zero=c.optimizer.zero_stage, parallel_context=pc, root_folder=root
    )
    # Nanotron main names one random-state file for all context-parallel ranks: they write it in turn, as
    # a torch.save of two ranks at once into one path can interleave their bytes.
    import torch.distributed as dist

    from nanotron_datastates.nanotron import groups

    for turn in range(groups.cp_size(pc)):
        if groups.cp_rank(pc) == turn:
            save_random_states(random_states=random_states, parallel_context=pc, root_folder=root)
        if groups.cp_size(pc) > 1:
            dist.barrier()
    save_meta(parallel_context=pc, root_folder=root, training_metadata=training_metadata(step))


def planned(pc: Any, c: Any, state: tuple[Any, Any, Any, Any]) -> dict[str, Any]:
    """The files the adapter plans for this rank, relative to the checkpoint's folder."""
    from nanotron_datastates.nanotron import groups, shards

    model, optimizer, _, _ = state
    zero = int(c.optimizer.zero_stage)
    writes = shards.writers(model, optimizer, pc)  # shared out among the replicas, as the Saver's default
    files = [str(p) for p, _, _ in shards.weight_shards(model, pc, Path(), writes)]
    files.append(shards.optimizer_path(optimizer, pc, Path(), writing=True, writes=writes))
    files.append(shards.lr_scheduler_path(pc, Path(), writing=True, writes=writes))
    files.append(shards.random_states_path(pc, Path()))
    return {
        "writes": sorted(str(f) for f in files if f is not None),
        "reads": [
            str(shards.optimizer_path(optimizer, pc, Path(), writing=False)),
            str(shards.random_states_path(pc, Path())),
        ],
        "topology": groups.layout_of(pc, zero),
    }


def main() -> None:
    import cpu_stand_ins  # noqa: F401 - main's CUDA-only imports, before nanotron's
    import torch.distributed as tdist

    work, tp, dp, pp, cp, zero = Path(sys.argv[1]), *map(int, sys.argv[2:7])
    rank = int(os.environ["RANK"])
    tdist.init_process_group(
        "gloo", init_method=f"file://{work}/init", rank=rank, world_size=int(os.environ["WORLD_SIZE"])
    )
    from nanotron_datastates.nanotron import shards

    pc = parallel_context(tp, dp, pp, cp)
    c = config(tp, dp, pp, cp, zero)
    from balanced_ranks import MODES  # with balance_writes on and off

    modes = {"roundtrip": roundtrip, "save": save_only, "resume": resume_other, **MODES}
    if sys.argv[7:]:
        (work / f"rank-{rank}.json").write_text(json.dumps(modes[sys.argv[7]](pc, c, work)))
        tdist.barrier()
        tdist.destroy_process_group()
        return
    state = training_state(pc, c)
    stock_save(pc, c, state, work / "stock", step=7)
    tdist.barrier()
    out = planned(pc, c, state)
    sources = shards.weight_sources(state[0], pc, work / "stock")
    out["weight_sources"] = (
        None if sources is None else sorted(str(p.relative_to(work / "stock")) for _, _, p in sources)
    )
    if rank == 0:
        out["metadata_text"] = shards.checkpoint_metadata_text(pc, training_metadata(7))
    (work / f"rank-{rank}.json").write_text(json.dumps(out))
    tdist.barrier()
    tdist.destroy_process_group()


def launch(
    work: Path,
    world: int,
    tp: int = 1,
    dp: int = 1,
    pp: int = 1,
    cp: int = 1,
    zero: int = 0,
    roundtrip: bool = False,
    mode: str | None = None,
) -> list[dict]:
    """Runs `main` on `world` processes; their reports, by rank. `mode`: "roundtrip", "save", "resume" (see
    those functions) or one of balanced_ranks.py's; none: Nanotron's own save and the adapter's plan."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "init").unlink(missing_ok=True)  # a launch's rendezvous file; the next launch makes its own
    mode = "roundtrip" if roundtrip else mode
    args = [str(a) for a in (tp, dp, pp, cp, zero)] + ([mode] if mode else [])
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(work), *args],
            env=dict(
                os.environ,
                RANK=str(r),
                LOCAL_RANK=str(r),
                WORLD_SIZE=str(world),
                NANOTRON_DATASTATES_AUTOLOAD="0",
                CUDA_DEVICE_MAX_CONNECTIONS="1",  # Nanotron asserts it with tensor parallelism
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r} of tp={tp} dp={dp} pp={pp} cp={cp} zero={zero}:\n{out[-4000:]}"
    return [json.loads((work / f"rank-{r}.json").read_text()) for r in range(world)]


if __name__ == "__main__":
    main()
