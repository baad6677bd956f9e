"""Train a tiny language model with asynchronous checkpoints, then prove that resuming from one is exact.

What this shows:

* **The overlap pattern.** ``engine.save(state, path)`` is called right after ``optimizer.step()`` and returns
  at once; the next forward and backward run while the engine copies the tensors in background threads;
  ``handle.wait_snapshot()`` is called right before the next ``optimizer.step()``, the first moment the saved
  tensors are modified. The training loop only stalls for the time spent inside those two calls, which is
  printed per checkpoint next to what ``torch.save`` + ``fsync`` of the same state costs.
* **Exact resume.** The state holds the model, AdamW, the LR scheduler, the step, the data sampler's generator
  and the global RNG (dropout). After training, this script relaunches itself in a new process
  (``--phase resume``) that builds everything fresh, loads the checkpoint at ``--resume-at`` (by default the
  last one at or before two thirds of the run, so that there are steps left to compare) and trains to the end.
  The parent then checks that every loss after the resume point is bit-for-bit the one of the first run, and
  that both runs' final checkpoints hold identical tensors; it exits with status 1 if not.

Run from the repository root, once the package is installed (``bash .ci/install``)::

    python3 examples/train_tiny_lm.py            # 300 steps, a checkpoint every 50, into out/tiny_lm/
    python3 examples/train_tiny_lm.py --steps 100 --ckpt-every 25 --out /tmp/tiny_lm

Writes, under ``--out``: ``ckpt/step_000050.safetensors``, ... (one file per checkpoint) with
``ckpt/datastates_telemetry.jsonl`` (one line per checkpoint: ``nanotron-datastates plot`` draws it), the
resumed run's checkpoints in ``resume/``, and both runs' losses as JSON.

The data is synthetic but learnable: each sequence is drawn from one of a few fixed sparse bigram "languages",
so the model must learn the tables and infer from the context which one it is reading.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from nanotron_datastates import DataStatesConfig, DataStatesEngine, SaveHandle

# -- model ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 256
    seq_len: int = 64
    d_model: int = 192
    n_layers: int = 4
    n_heads: int = 4
    dropout: float = 0.1


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention, then an MLP, each with a residual."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.dropout = cfg.dropout
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model),
            nn.GELU(),
            nn.Linear(4 * cfg.d_model, cfg.d_model),
        )
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.mlp(self.ln2(x)))


class TinyLM(nn.Module):
    """Decoder-only transformer; the output head shares the token embedding's weight (tied)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self.head.weight = self.tok.weight  # the engine stores a tied tensor once and re-ties it on load
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        # Small weights: with the default N(0, 1) embedding, the tied head starts with huge logits.
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


# -- data -------------------------------------------------------------------------------------------------


def make_languages(vocab: int, n_languages: int = 4, successors: int = 4, seed: int = 1234) -> torch.Tensor:
    """Transition tables [n_languages, vocab, vocab]: each token has a few likely successors per language."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n_languages, vocab, vocab, generator=g) * 2
    keep = logits.topk(successors, dim=-1).indices
    sparse = torch.full_like(logits, -math.inf).scatter(-1, keep, logits.gather(-1, keep))
    return sparse.softmax(-1)


def entropy_floor(tables: torch.Tensor) -> float:
    """Mean entropy of a next token, in nats: roughly the lowest loss reachable once the language is known."""
    return -(tables * tables.clamp_min(1e-30).log()).sum(-1).mean().item()


def sample_batch(tables: torch.Tensor, gen: torch.Generator, batch: int, seq_len: int) -> torch.Tensor:
    """A batch of seq_len + 1 tokens per row (inputs and shifted targets), drawn only from `gen`."""
    n_lang, vocab, _ = tables.shape
    lang = torch.randint(n_lang, (batch,), generator=gen)
    tokens = [torch.randint(vocab, (batch,), generator=gen)]
    for _ in range(seq_len):
        probs = tables[lang, tokens[-1]]
        tokens.append(torch.multinomial(probs, 1, generator=gen).squeeze(1))
    return torch.stack(tokens, dim=1)


# -- training state ---------------------------------------------------------------------------------------


@dataclass
class Trainer:
    """Everything a training step touches; all of its state goes into each checkpoint."""

    model: TinyLM
    optimizer: torch.optim.AdamW
    scheduler: torch.optim.lr_scheduler.LambdaLR
    data_gen: torch.Generator
    tables: torch.Tensor
    batch: int
    seq_len: int


def warmup_cosine(warmup: int, total: int) -> Callable[[int], float]:
    """LR multiplier: linear warmup to 1, then a cosine down to 0.1 at `total`."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))

    return factor


def build_trainer(args: argparse.Namespace, cfg: ModelConfig) -> Trainer:
    torch.manual_seed(args.seed)  # model init and dropout draw from the global RNG
    model = TinyLM(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(args.steps // 10, args.steps))
    # A generator of its own, so that the data order does not depend on how much dropout consumed.
    data_gen = torch.Generator().manual_seed(args.seed + 1)
    return Trainer(model, optimizer, scheduler, data_gen, make_languages(cfg.vocab), args.batch, cfg.seq_len)


def capture_state(tr: Trainer, step: int) -> dict[str, Any]:
    """Everything an exact resume needs. Tensors are referenced, not copied: the engine copies them."""
    return {
        "model": tr.model.state_dict(),
        "optimizer": tr.optimizer.state_dict(),
        "scheduler": tr.scheduler.state_dict(),
        "step": step,
        "rng": {"torch": torch.get_rng_state(), "data": tr.data_gen.get_state()},
    }


def restore_state(tr: Trainer, state: dict[str, Any]) -> int:
    """Loads a captured state into a freshly built trainer; returns the step it was captured after."""
    tr.model.load_state_dict(state["model"])
    tr.optimizer.load_state_dict(state["optimizer"])
    tr.scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"]["torch"])
    tr.data_gen.set_state(state["rng"]["data"])
    return state["step"]


def train_step(tr: Trainer) -> torch.Tensor:
    """Forward and backward of one batch; the optimizer step is left to the caller (it must wait first)."""
    tokens = sample_batch(tr.tables, tr.data_gen, tr.batch, tr.seq_len)
    logits = tr.model(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    tr.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    return loss.detach()


# -- checkpoints ------------------------------------------------------------------------------------------


@dataclass
class CheckpointRecord:
    step: int
    file_mb: float
    save_ms: float  # inside engine.save()
    wait_ms: float  # blocked in wait_snapshot()
    torch_save_ms: float  # torch.save + fsync of the same state, measured off the clock
    persisted_ms: float  # from engine.save() until the file is durable

    @property
    def stall_ms(self) -> float:
        return self.save_ms + self.wait_ms


@dataclass
class Pending:
    """A save whose snapshot is still being taken while the next step computes."""

    handle: SaveHandle
    state: dict[str, Any]
    step: int
    save_ms: float


def timed_torch_save(state: dict[str, Any], directory: Path) -> float:
    """Milliseconds for torch.save + fsync of `state` into a scratch file next to the checkpoints."""
    scratch = directory / "torch_save.scratch.pt"
    t0 = time.perf_counter()
    with open(scratch, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    ms = (time.perf_counter() - t0) * 1e3
    scratch.unlink()
    return ms


def finish_checkpoint(pending: Pending, directory: Path) -> CheckpointRecord:
    """Waits for the snapshot (the only blocking part, timed), then measures the torch.save comparison."""
    t0 = time.perf_counter()
    pending.handle.wait_snapshot()
    wait_ms = (time.perf_counter() - t0) * 1e3
    # Off the training clock from here. Waiting for the file first keeps the two writers off the same disk;
    # the saved tensors are still those of `pending.step`: only gradients changed since.
    pending.handle.wait_persisted()
    stats = pending.handle.stats
    record = CheckpointRecord(
        step=pending.step,
        file_mb=stats["file_bytes"] / 1e6,
        save_ms=pending.save_ms,
        wait_ms=wait_ms,
        torch_save_ms=timed_torch_save(pending.state, directory),
        persisted_ms=stats["persisted_s"] * 1e3,
    )
    print(
        f"step {record.step:4d}  checkpoint {record.file_mb:.1f} MB  stall {record.stall_ms:.1f} ms "
        f"(save {record.save_ms:.1f} + wait {record.wait_ms:.1f})  "
        f"torch.save+fsync {record.torch_save_ms:.1f} ms  persisted after {record.persisted_ms:.0f} ms"
    )
    return record


def checkpoint_path(directory: Path, step: int) -> Path:
    return directory / f"step_{step:06d}.safetensors"


# -- the loop ---------------------------------------------------------------------------------------------


def train(
    tr: Trainer, engine: DataStatesEngine, first_step: int, last_step: int, ckpt_every: int, ckpt_dir: Path
) -> tuple[dict[int, float], list[CheckpointRecord]]:
    """Runs steps first_step..last_step; returns the loss of each step and one record per checkpoint."""
    losses: dict[int, float] = {}
    records: list[CheckpointRecord] = []
    pending: Pending | None = None
    for step in range(first_step, last_step + 1):
        loss = train_step(tr)  # overlaps the copy of the checkpoint saved after the previous step
        if pending is not None:  # optimizer.step() below mutates the saved tensors
            records.append(finish_checkpoint(pending, ckpt_dir))
            pending = None
        tr.optimizer.step()
        tr.scheduler.step()
        losses[step] = loss.item()
        if step % 25 == 0 or step == first_step:
            print(f"step {step:4d}  loss {losses[step]:.4f}  lr {tr.scheduler.get_last_lr()[0]:.2e}")
        if step % ckpt_every == 0 or step == last_step:  # the final state is saved too, as a real job would
            state = capture_state(tr, step)
            t0 = time.perf_counter()
            handle = engine.save(state, checkpoint_path(ckpt_dir, step))
            pending = Pending(handle, state, step, (time.perf_counter() - t0) * 1e3)
    if pending is not None:  # the last checkpoint has no next step to overlap with
        records.append(finish_checkpoint(pending, ckpt_dir))
    return losses, records


# -- phases -----------------------------------------------------------------------------------------------


def make_engine(args: argparse.Namespace, telemetry: Path | None = None) -> DataStatesEngine:
    """The engine; with `telemetry`, a JSON line per checkpoint there (`nanotron-datastates plot`)."""
    config = DataStatesConfig(
        host_cache_size=args.host_cache_gib, parser_threads=2, telemetry_path=str(telemetry or "")
    )
    return DataStatesEngine(config)


def write_losses(path: Path, losses: dict[int, float]) -> None:
    # float.hex round-trips exactly; a decimal repr would also do, but hex makes the intent obvious.
    path.write_text(json.dumps({str(step): loss.hex() for step, loss in losses.items()}, indent=0))


def read_losses(path: Path) -> dict[int, float]:
    return {int(step): float.fromhex(h) for step, h in json.loads(path.read_text()).items()}


def run_resume_phase(args: argparse.Namespace, cfg: ModelConfig) -> None:
    """Child process: fresh trainer, load the checkpoint, train to the end, write the losses."""
    tr = build_trainer(args, cfg)
    out = Path(args.out)
    ckpt_dir = out / "resume"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    with make_engine(args) as engine:
        t0 = time.perf_counter()
        step = restore_state(tr, engine.load(args.resume_from))
        print(f"loaded {args.resume_from} (step {step}) in {(time.perf_counter() - t0) * 1e3:.0f} ms")
        losses, _ = train(tr, engine, step + 1, args.steps, args.ckpt_every, ckpt_dir)
    write_losses(out / "resume_losses.json", losses)


def clear_outputs(out: Path) -> None:
    """Removes what an earlier run of this script left in `out`, and nothing else."""
    for sub in ("ckpt", "resume"):
        shutil.rmtree(out / sub, ignore_errors=True)
    for name in ("train_losses.json", "resume_losses.json"):
        (out / name).unlink(missing_ok=True)


def launch_resume(args: argparse.Namespace, resume_from: Path) -> None:
    """Runs the resume phase in a new process (nothing carried over in memory), echoing its output."""
    cmd = [sys.executable, os.path.abspath(__file__), "--phase", "resume", "--resume-from", str(resume_from)]
    for flag in ("steps", "ckpt_every", "out", "host_cache_gib", "threads", "batch", "seed"):
        cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    print(f"\nrelaunching in a new process: resume from {resume_from}")
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as child:
        assert child.stdout is not None
        for line in child.stdout:
            print(f"  [resume] {line}", end="")
    if child.returncode != 0:
        raise SystemExit(f"the resume process failed with status {child.returncode}")


def compare_losses(first: dict[int, float], resumed: dict[int, float], resume_step: int) -> bool:
    steps = sorted(s for s in first if s > resume_step)
    if sorted(resumed) != steps:
        print(f"resume: FAILED, the resumed run covered {len(resumed)} steps, expected {len(steps)}")
        return False
    diff = [s for s in steps if first[s].hex() != resumed[s].hex()]
    if diff:
        s = diff[0]
        print(f"resume: FAILED, {len(diff)} of {len(steps)} losses differ, first at step {s}: ", end="")
        print(f"{first[s]!r} vs {resumed[s]!r}")
        return False
    print(f"resume: {len(steps)} steps after step {resume_step} match bit for bit")
    return True


def same_state(a: Any, b: Any) -> bool:
    """Exact equality of two nested states (tensors: same dtype, shape and bits)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same_state, a, b))
    return a == b


def compare_final_checkpoints(args: argparse.Namespace, out: Path) -> bool:
    with make_engine(args) as engine:
        first = engine.load(checkpoint_path(out / "ckpt", args.steps))
        resumed = engine.load(checkpoint_path(out / "resume", args.steps))
    ok = same_state(first, resumed)
    print(f"final checkpoints of both runs at step {args.steps}: {'identical' if ok else 'DIFFERENT'}")
    return ok


def print_summary(records: list[CheckpointRecord]) -> None:
    stall = [r.stall_ms for r in records]
    torch_save = [r.torch_save_ms for r in records]
    mean_stall, mean_torch = statistics.mean(stall), statistics.mean(torch_save)
    print(f"\nsummary over {len(records)} checkpoints of {records[0].file_mb:.1f} MB")
    print(f"  {'':28s}{'mean':>10s}{'max':>10s}")
    print(f"  {'training stall (datastates)':28s}{mean_stall:8.1f}ms{max(stall):8.1f}ms")
    print(f"  {'torch.save + fsync':28s}{mean_torch:8.1f}ms{max(torch_save):8.1f}ms")
    print(f"  {'persisted after save()':28s}{statistics.mean(r.persisted_ms for r in records):8.1f}ms")
    print(f"  torch.save + fsync stalls {mean_torch / max(mean_stall, 1e-6):.0f}x longer on average")


def default_resume_step(steps: int, every: int) -> int:
    """The last checkpoint at or before two thirds of the run: it leaves a third of the steps to compare."""
    step = (2 * steps // 3) // every * every
    if not 0 < step < steps:
        raise SystemExit(f"--steps {steps} and --ckpt-every {every} leave no checkpoint before the end")
    return step


def run_train_phase(args: argparse.Namespace, cfg: ModelConfig, out: Path) -> list[CheckpointRecord]:
    """The first run: trains from scratch, checkpointing as it goes, and writes its losses."""
    t0 = time.perf_counter()
    tr = build_trainer(args, cfg)
    n_params = sum(p.numel() for p in tr.model.parameters()) / 1e6
    start, floor = math.log(cfg.vocab), entropy_floor(tr.tables)
    print(f"{n_params:.2f} M parameters; loss starts near {start:.2f}, entropy floor {floor:.2f}")
    with make_engine(args, out / "ckpt" / "datastates_telemetry.jsonl") as engine:
        losses, records = train(tr, engine, 1, args.steps, args.ckpt_every, out / "ckpt")
    write_losses(out / "train_losses.json", losses)
    print(f"training: {time.perf_counter() - t0:.1f} s")
    return records


def run_all(args: argparse.Namespace, cfg: ModelConfig) -> int:
    """Train, resume in a new process, compare; 0 if the resumed run is bit-for-bit the first one."""
    out = Path(args.out)
    resume_step = args.resume_at
    if resume_step is None:
        resume_step = default_resume_step(args.steps, args.ckpt_every)
    if resume_step % args.ckpt_every or not 0 < resume_step < args.steps:
        raise SystemExit(f"--resume-at {resume_step}: no checkpoint is saved there before the end")
    clear_outputs(out)
    (out / "ckpt").mkdir(parents=True, exist_ok=True)
    print(f"model {asdict(cfg)}, batch {args.batch}, {args.steps} steps, torch threads {args.threads}")

    records = run_train_phase(args, cfg, out)
    launch_resume(args, checkpoint_path(out / "ckpt", resume_step))
    first, resumed = read_losses(out / "train_losses.json"), read_losses(out / "resume_losses.json")
    ok = compare_losses(first, resumed, resume_step)
    ok = compare_final_checkpoints(args, out) and ok
    print_summary(records)
    return 0 if ok else 1


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300, help="training steps (default %(default)s)")
    p.add_argument(
        "--ckpt-every", type=int, default=50, help="steps between checkpoints (default %(default)s)"
    )
    p.add_argument(
        "--out",
        default="out/tiny_lm",
        help="output folder; earlier outputs there are removed (default %(default)s)",
    )
    p.add_argument(
        "--host-cache-gib", type=float, default=0.5, help="the engine's host cache, GiB (default %(default)s)"
    )
    p.add_argument(
        "--threads",
        type=int,
        default=2,
        help="torch threads, the same in both processes (default %(default)s)",
    )
    p.add_argument("--batch", type=int, default=16, help="sequences per step (default %(default)s)")
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the model, data and dropout (default %(default)s)"
    )
    p.add_argument(
        "--resume-at",
        type=int,
        default=None,
        help="the checkpoint step to resume from (default: the last at or before two thirds of the run)",
    )
    p.add_argument("--phase", choices=("all", "resume"), default="all", help=argparse.SUPPRESS)
    p.add_argument("--resume-from", default=None, help=argparse.SUPPRESS)
    return p.parse_args()


def main() -> int:
    args = parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # progress shows live, also through the parent's pipe
    torch.set_num_threads(args.threads)  # reductions split by thread count: keep it fixed for bitwise results
    cfg = ModelConfig()
    if args.phase == "resume":
        run_resume_phase(args, cfg)
        return 0
    return run_all(args, cfg)


if __name__ == "__main__":
    sys.exit(main())
