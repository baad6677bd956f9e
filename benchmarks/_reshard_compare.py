"""nanotron_reshard_proof.py's comparison: the full tensors of a run put together from every rank's parts (on
the CPU, from Nanotron's sharding metadata and ZeRO offsets), and a resumed state compared with the saved one,
bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

KINDS = ("weight", "master", "exp_avg", "exp_avg_sq", "step")


def assemble(name: str, work: Path) -> dict[str, Any]:
    """The full tensors of run `name` from every rank's parts, and which elements no rank held."""
    import torch

    ranks = [torch.load(p, weights_only=False) for p in sorted(work.glob(f"parts_{name}_rank*.pt"))]
    # First each tensor-parallel piece from its ZeRO ranges, then the full tensor from its pieces.
    pieces: dict[tuple[str, str, str], Any] = {}  # (kind, name, tp place) -> (piece, filled, place)
    steps: dict[str, Any] = {}
    wrong: list[str] = []
    for r in ranks:
        for kind, pname, t, rng in r["parts"]:
            full_shape, shape, pairs = r["where"][pname]
            if kind == "step":
                steps[pname] = t
                continue
            key = (kind, pname, repr(pairs))
            if key not in pieces:
                blank = torch.zeros(shape, dtype=t.dtype), torch.zeros(shape, dtype=torch.bool)
                pieces[key] = (*blank, full_shape, pairs)
            piece, filled, _, _ = pieces[key]
            size = piece.numel() if rng is None else rng[1] - rng[0]
            if t.numel() != size:
                wrong.append(f"{kind} {pname}: {t.numel()} elements for a place of {size}")
                continue
            if rng is None:
                piece.copy_(t.reshape(shape))
                filled.fill_(True)
            else:
                piece.view(-1)[rng[0] : rng[1]] = t.reshape(-1)
                filled.view(-1)[rng[0] : rng[1]] = True
    full: dict[str, dict[str, Any]] = {k: {} for k in KINDS}
    held: dict[tuple[str, str], Any] = {}
    for (kind, pname, _), (piece, filled, full_shape, pairs) in pieces.items():
        if pname not in full[kind]:
            full[kind][pname] = torch.zeros(full_shape, dtype=piece.dtype)
            held[kind, pname] = torch.zeros(full_shape, dtype=torch.bool)
        for local_slices, global_slices in pairs or [(..., ...)]:
            full[kind][pname][global_slices] = piece[local_slices]
            held[kind, pname][global_slices] = filled[local_slices]
    full["step"] = steps
    holes = [f"{k} {n}: {int((~h).sum())} elements held by no rank" for (k, n), h in held.items()]
    holes = wrong + [h for h, (_, m) in zip(holes, held.items()) if not m.all()]
    head = ranks[0]
    return {
        "tensors": full,
        "holes": holes,
        "lr_scheduler": head["lr_scheduler"],
        "lrs": head["lrs"],
        "iteration_step": head["iteration_step"],
        "metadata": head["metadata"],
    }


def compare_states(saved: dict[str, Any], resumed: dict[str, Any]) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {}
    for kind in KINDS:
        a, b = saved["tensors"][kind], resumed["tensors"][kind]
        diffs = [f"{kind} {n}: missing" for n in sorted(set(a) ^ set(b))]
        for n in sorted(set(a) & set(b)):
            x, y = a[n], b[n]
            same = x.dtype == y.dtype and x.shape == y.shape
            same = same and torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
            if not same:
                diffs.append(f"{kind} {n}: {x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)} differ")
        elements = sum(t.numel() for t in a.values())
        out[kind] = {"tensors": len(a), "elements": elements, "differences": len(diffs), "first": diffs[:5]}
    for key in ("lr_scheduler", "lrs", "iteration_step", "metadata"):
        a, b = repr(saved[key]), repr(resumed[key])
        out[key] = {"equal": a == b, **({} if a == b else {"saved": a, "resumed": b})}
    out["holes"] = saved["holes"] + resumed["holes"]
    return out
