"""How fast memory replicas travel between two simulated nodes of one GPU each (2 GPUs): each rank holds
`--gb` GB of checkpoint files in its own tier folder in /dev/shm (the 1.1B model's 14.5 GB a rank, in
`--files` files) and sends them to the other while receiving the other's, as the replicator does after a
commit: files mapped from the tier, received into new temporaries of the peer's tier (fresh pages, as in
training), through each link (tier/links.py):

* `gloo`: host memory to host memory over TCP (loopback here), one stream; `gloo-streams4`, `-streams8`:
  each chunk split over 4 or 8 gloo groups at once (their own connections and I/O threads);
  `gloo-streams4-recycled` into an older copy's files as below;
* `nccl`: through the GPUs (NVLink between the two GPUs here, standing in for the network between nodes),
  with its default buffers, and variants of its chunk size and copy threads; `nccl-recycled` receives into
  the files of an older copy (the replicator's spare, from the third checkpoint on) instead of new ones;
  `-slots8` with 8 waves in flight, `-threads6` and `-threads16` with 6 and 16 copying threads;
* `base-<link>`: a link of `--base-link FILE` (tier/link_nccl.py of another commit), in the same call.

Per link and round: `open_s` (the files opened, the room for the received ones checked, `open_all`),
`move_s` (the transfer, as the telemetry's `seconds`, the received files' memory reserved beside it), `gbps`
(bytes one rank sends per second of `move_s`: the rate of the node pair in each direction; `gbps_with_open`
over both) and whether every received byte equals the sent one.

    python3 benchmarks/micro/bench_replica_link.py --out DIR [--gb 14.5 --files 8 --rounds 3]
        [--base-link FILE --links nccl-recycled,base-nccl-recycled]

Writes DIR/bench_replica_link.json with every value and the medians.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the helpers in benchmarks/
from _common import command_info, host_info  # noqa: E402

# name: (transport, NcclLink keyword arguments)
LINKS: dict[str, tuple[str, dict[str, Any]]] = {
    "gloo": ("gloo", {"streams": 1}),
    "gloo-streams4": ("gloo", {"streams": 4}),
    "gloo-streams8": ("gloo", {"streams": 8}),
    "gloo-streams4-recycled": ("gloo", {"streams": 4}),
    "nccl": ("nccl", {}),
    "nccl-threads4": ("nccl", {"threads": 4}),
    "nccl-chunk64m": ("nccl", {"chunk": 64 << 20}),
    "nccl-recycled": ("nccl", {}),  # into an older replica's files, as the replicator does from the third on
    "nccl-recycled-slots8": ("nccl", {"slots": 8}),
    "nccl-recycled-threads6": ("nccl", {"threads": 6}),
    "nccl-recycled-threads16": ("nccl", {"threads": 16}),
}


def _threads(k: int, n: int, work: Any) -> float:
    """Seconds for `work(i)` over i < n on k threads."""
    from concurrent.futures import ThreadPoolExecutor

    t0 = time.monotonic()
    with ThreadPoolExecutor(k) as pool:
        list(pool.map(work, range(n)))
    return time.monotonic() - t0


def _probe(rank: int, shm: Path, gb: float, group: Any) -> dict[str, float]:
    """Each hop of the NCCL link alone, GB/s: host copies into fresh and into resident tmpfs pages and out of
    them into pinned memory (1, 4 and 8 threads), the copies to and from the GPU, NCCL's exchange."""
    import mmap

    chunk = 32 << 20
    n = int(gb * 1e9) // chunk
    out: dict[str, float] = {}
    pinned = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(8)]
    for k in (1, 4, 8):
        path = shm / f"probe{k}"
        with open(path, "wb+") as f:
            f.truncate(n * chunk)
            m = mmap.mmap(f.fileno(), n * chunk)
        buf = torch.frombuffer(m, dtype=torch.uint8)
        for what, into in (("fresh_write", True), ("resident_write", True), ("read_to_pinned", False)):

            def work(i: int, buf: torch.Tensor = buf, into: bool = into) -> None:
                a, b = buf[i * chunk : (i + 1) * chunk], pinned[i % 8]
                (a.copy_(b) if into else b.copy_(a))

            out[f"{what}_{k}t_gbps"] = n * chunk / _threads(k, n, work) / 1e9
        del buf
        m.close()
        path.unlink()
    gpu = [torch.empty(chunk, dtype=torch.uint8, device="cuda") for _ in range(2)]
    for what, src, dst in (("h2d", pinned[0], gpu[0]), ("d2h", gpu[0], pinned[0])):
        torch.cuda.synchronize()
        t0 = time.monotonic()
        for _ in range(n):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        out[f"{what}_gbps"] = n * chunk / (time.monotonic() - t0) / 1e9
    dist.barrier()
    t0 = time.monotonic()
    for _ in range(n):
        ops = [
            dist.P2POp(dist.isend, gpu[0], 1 - rank, group),
            dist.P2POp(dist.irecv, gpu[1], 1 - rank, group),
        ]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
    torch.cuda.synchronize()
    out["nccl_exchange_gbps"] = n * chunk / (time.monotonic() - t0) / 1e9
    return out


def _base_link(path: str) -> Any:
    """NcclLink of the file `path`, loaded as a module of the installed package's tier/ (its relative imports
    from there)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("nanotron_datastates.tier._base_link_nccl", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module.NcclLink


def _fill(folder: Path, rank: int, gb: float, files: int) -> list[tuple[str, int]]:
    """`files` files of `gb` GB in all, each byte a function of rank, file and offset (checked at the end)."""
    folder.mkdir(parents=True, exist_ok=True)
    size = int(gb * 1e9) // files
    out = []
    for i in range(files):
        rel = f"f{i}.safetensors"
        block = (torch.arange(64 << 20, dtype=torch.int64) * (rank * 31 + i * 7 + 1) % 251).to(torch.uint8)
        with open(folder / rel, "wb") as f:
            for lo in range(0, size, block.numel()):
                f.write(block[: min(block.numel(), size - lo)].numpy().tobytes())
        out.append((rel, size))
    return out


def _expected(rank: int, i: int, lo: int, n: int) -> torch.Tensor:
    at = (torch.arange(lo, lo + n, dtype=torch.int64) % (64 << 20)) * (rank * 31 + i * 7 + 1) % 251
    return at.to(torch.uint8)


def _rank(rank: int, args: argparse.Namespace, init: str) -> None:
    from nanotron_datastates.tier.link_nccl import NcclLink
    from nanotron_datastates.tier.links import gloo_link
    from nanotron_datastates.tier.replica_transfer import Transfer, open_all

    torch.set_num_threads(1)  # as torchrun's OMP_NUM_THREADS=1 leaves a trainer
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    gloo = dist.new_group(backend="gloo")
    nccl = None
    if torch.cuda.is_available():  # without: gloo only (a check of the benchmark itself)
        torch.cuda.set_device(rank)
        nccl = dist.new_group(backend="nccl")
        dist.all_reduce(torch.zeros(1, device="cuda"), group=nccl)
    peer = 1 - rank
    shm = Path(args.shm) / f"node{rank}"
    files = _fill(shm / "own", rank, args.gb, args.files)
    results: dict[str, list[dict[str, Any]]] = {}
    links: dict[str, Any] = {}
    for rnd in range(args.rounds):
        for name in args.links.split(","):
            transport, kw = LINKS[name.removeprefix("base-")]
            if name == "gloo" and rnd > 0:
                continue  # one round: it takes seconds a GB
            if name not in links:  # both ranks make the links in the same order (new groups: collective)
                links[name] = (
                    gloo_link(gloo, streams=kw["streams"])
                    if transport == "gloo"
                    else (_base_link(args.base_link) if name.startswith("base-") else NcclLink)(
                        nccl, torch.device("cuda"), **kw
                    )
                )
            link = links[name]
            sends = [Transfer(peer, rel, n) for rel, n in files]
            recvs = [Transfer(peer, rel, n) for rel, n in files]
            into = shm / "replicas"
            into.mkdir(parents=True, exist_ok=True)
            if "-recycled" in name:  # the spare's files: written before the transfer, taken over by it
                for t in recvs:
                    t.donor = shm / "spare" / t.rel
                _fill(shm / "spare", peer, args.gb, args.files)
            with contextlib.ExitStack() as stack:
                t0 = time.monotonic()
                problems = open_all(stack, gloo, sends, lambda t: shm / "own", recvs, into)
                opened = time.monotonic() - t0
                assert not problems, problems
                dist.barrier(group=gloo)
                seconds = link.move(sends, recvs)
                equal = all(
                    torch.equal(
                        t.buf[lo : lo + (1 << 20)], _expected(peer, i, lo, min(1 << 20, t.nbytes - lo))
                    )
                    for i, t in enumerate(recvs)
                    for lo in (0, t.nbytes // 2, max(0, t.nbytes - (1 << 20)))
                )
            nbytes = sum(t.nbytes for t in sends)
            results.setdefault(name, []).append(
                {"round": rnd, "open_s": opened, "move_s": seconds, "bytes_sent": nbytes,
                 "gbps": nbytes / seconds / 1e9, "gbps_with_open": nbytes / (opened + seconds) / 1e9,
                 "equal": equal}
            )  # fmt: skip
            print(f"rank {rank} {name} round {rnd}: {nbytes / 1e9:.2f} GB in {seconds:.2f} s", flush=True)
    for link in links.values():
        link.close()
    if args.probe and nccl is not None:
        results["probe"] = [_probe(rank, shm, args.probe, nccl)]
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier(group=gloo)
    shutil.rmtree(shm, ignore_errors=True)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--gb", type=float, default=14.5, help="GB of files a rank (default 14.5: the 1.1B model)")
    p.add_argument("--files", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--links", default=",".join(LINKS))
    p.add_argument("--shm", default=f"/dev/shm/bench-replica-link-{os.getuid()}")
    p.add_argument("--base-link", help="tier/link_nccl.py of another commit, for the links named base-<link>")
    p.add_argument("--probe", type=float, default=0.0, help="GB: each hop of the NCCL link alone (0: none)")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    init = f"file://{out / 'rendezvous'}"
    t0 = time.monotonic()
    mp.start_processes(_rank, args=(args, init), nprocs=2, start_method="spawn")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    summary: dict[str, Any] = {}
    if "probe" in ranks[0]:
        summary["probe"] = [rk.pop("probe")[0] for rk in ranks]
    for name in ranks[0]:
        pairs = list(zip(ranks[0][name], ranks[1][name]))  # a round's slower rank sets its pace
        summary[name] = {
            "median_gbps": statistics.median(min(a["gbps"], b["gbps"]) for a, b in pairs),
            "median_move_s": statistics.median(max(a["move_s"], b["move_s"]) for a, b in pairs),
            "median_open_s": statistics.median(max(a.get("open_s", 0), b.get("open_s", 0)) for a, b in pairs),
            "median_gbps_with_open": statistics.median(
                min(a.get("gbps_with_open", 0), b.get("gbps_with_open", 0)) for a, b in pairs
            ),
            "all_equal": all(r["equal"] for rk in ranks for r in rk[name]),
        }
    doc = {
        "command": "bench_replica_link.py " + " ".join(sys.argv[1:]),
        "invocation": command_info(),
        "host": host_info([args.shm]),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "gb_per_rank": args.gb,
        "files": args.files,
        "summary": summary,
        "ranks": ranks,
        "wall_s": time.monotonic() - t0,
    }
    (out / "bench_replica_link.json").write_text(json.dumps(doc, indent=1))
    for r in range(2):
        (out / f"rank{r}.json").unlink()
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
