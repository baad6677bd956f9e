"""Simulated nodes on one machine, for the benchmarks that need several (memory replicas go to other nodes):
one `torchrun` agent per node, `per_node` workers each, joined by one c10d rendezvous on this host, so that
each worker's GROUP_RANK is its node's (torchrun's own variable, which the engine reads to tell nodes apart).
Each node gets a config of its own (`node_config`: its memory tier in a folder of its own, as a node's
/dev/shm is), and each worker the GPU of its global rank (`take_gpu_of_rank`: Nanotron takes LOCAL_RANK as
the rank in the node of up to 8 GPUs).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import IO, Any

import yaml

SIMULATED = "DATASTATES_BENCH_SIMULATED_NODE"  # set for the workers of simulated nodes
TIER_DEFAULT = "/dev/shm/nanotron-datastates-{uid}"  # TrainerSettings.memory_tier_path's default

Agent = tuple[subprocess.Popen, IO[str]]


def free_port(tries: int = 200) -> int:
    """A port free now, below the kernel's range of ephemeral ports: between this check and torchrun's bind,
    no connection's local port takes it (a job's gloo groups hold dozens of connections; a rendezvous port
    taken so leaves both agents clients of a store that no agent serves, and they time out)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(tries):
        port = random.randrange(10000, max(10001, low))
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port below {low} in {tries} tries")


def node_config(cfg: Path, node: int) -> Path:
    """`cfg` for node `node`: with the memory tier on, its `datastates.memory_tier_path` (or the default)
    suffixed `-node<k>`."""
    doc = yaml.safe_load(cfg.read_text())
    ds = doc.get("datastates") or {}
    if ds.get("memory_tier"):
        ds["memory_tier_path"] = f"{ds.get('memory_tier_path') or TIER_DEFAULT}-node{node}"
    out = cfg.with_name(f"{cfg.stem}.node{node}{cfg.suffix}")
    out.write_text(yaml.safe_dump(doc, sort_keys=False))
    return out


def start(
    script: list[list[str]],
    nodes: int,
    per_node: int,
    run_id: str,
    logs: list[Path],
    cwd: Path,
    env: dict[str, str],
) -> list[Agent]:
    """The agents of `nodes` nodes running `script` (a list per node: its arguments, the config first
    differing), started in node order a second apart: the rendezvous ranks agents by process id, so node k
    is GROUP_RANK k each time."""
    port, agents = free_port(), []
    for k in range(nodes):
        cmd = ["torchrun", f"--nnodes={nodes}", f"--nproc-per-node={per_node}", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={run_id}", "--max-restarts=0",
               *script[k]]  # fmt: skip
        log = open(logs[k], "w")  # noqa: SIM115 (closed by wait or stop)
        # A process group of its own: a signal stops the agent and its workers together.
        agent = subprocess.Popen(
            cmd, env={**env, SIMULATED: "1"}, stdout=log, stderr=subprocess.STDOUT, cwd=cwd,
            start_new_session=True,
        )  # fmt: skip
        agents.append((agent, log))
        time.sleep(1)
    return agents


def wait(agents: list[Agent]) -> list[int]:
    """Each agent's exit status, once all have ended."""
    rcs = [a.wait() for a, _ in agents]
    for _, log in agents:
        log.close()
    return rcs


def stop(agents: list[Agent], first_wait_s: float = 400, then_s: float = 15) -> None:
    """Once any agent ended (a node lost) or `first_wait_s` passed, `then_s` more for the others, then every
    agent and its workers stopped (SIGTERM, then SIGKILL)."""
    give_up = time.monotonic() + first_wait_s
    while all(a.poll() is None for a, _ in agents) and time.monotonic() < give_up:
        time.sleep(0.5)
    deadline = time.monotonic() + then_s
    while any(a.poll() is None for a, _ in agents) and time.monotonic() < deadline:
        time.sleep(0.5)
    for a, _ in agents:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(a.pid, sig)
            try:
                a.wait(timeout=30)
                break
            except subprocess.TimeoutExpired:
                continue
    for _, log in agents:
        log.close()


def run(script: list[str], cfg: Path, nodes: int, gpus: int, run_id: str, log: Path, **kw: Any) -> int:
    """`script` (its config after `--config`) on `nodes` simulated nodes of `gpus // nodes` GPUs, each with
    its own config; the worst exit status. Logs: `log` with `.node<k>` before its suffix."""
    i = script.index("--config") + 1
    scripts = [[*script[:i], str(node_config(cfg, k)), *script[i + 1 :]] for k in range(nodes)]
    logs = [log.with_name(f"{log.stem}.node{k}{log.suffix}") for k in range(nodes)]
    return max(wait(start(scripts, nodes, gpus // nodes, run_id, logs, **kw)))


def take_gpu_of_rank() -> None:
    """In a worker of a simulated node: LOCAL_RANK its global rank, so that each worker of the machine takes
    a GPU of its own (Nanotron reads LOCAL_RANK as the rank in a node of up to 8 GPUs)."""
    if os.environ.get(SIMULATED):
        os.environ["LOCAL_RANK"] = os.environ["RANK"]
