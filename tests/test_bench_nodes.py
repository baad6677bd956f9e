"""The benchmarks' simulated nodes (benchmarks/_nodes.py), on real torchrun agents: two nodes of two
workers each join one rendezvous; node k's workers are GROUP_RANK k, each takes the GPU of its global rank
(LOCAL_RANK), and each node reads its own config, its memory tier in a folder of its own."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import yaml

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import _nodes as nodes  # noqa: E402

WORKER = """
import json, os, sys
sys.path.insert(0, {bench!r})
from _nodes import take_gpu_of_rank
take_gpu_of_rank()
config = sys.argv[sys.argv.index("--config") + 1]
import yaml
tier = yaml.safe_load(open(config))["datastates"]["memory_tier_path"]
keys = ("GROUP_RANK", "RANK", "LOCAL_RANK")
out = {{k: os.environ[k] for k in keys}} | {{"tier": tier}}
open(os.path.join({out!r}, "rank" + os.environ["RANK"] + ".json"), "w").write(json.dumps(out))
"""


def test_two_simulated_nodes_of_two_workers(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(WORKER.format(bench=str(BENCH), out=str(tmp_path))))
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({"datastates": {"memory_tier": True, "memory_tier_path": "/dev/shm/t"}}))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    rc = nodes.run(
        [str(script), "--config", str(cfg), "--x"],
        cfg,
        2,
        4,
        "t",
        tmp_path / "run.log",
        cwd=tmp_path,
        env=env,
    )
    assert rc == 0, [p.read_text()[-2000:] for p in tmp_path.glob("run.node*.log")]
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert [g["GROUP_RANK"] for g in got] == ["0", "0", "1", "1"]
    assert [g["LOCAL_RANK"] for g in got] == ["0", "1", "2", "3"]  # each worker a GPU of its own
    assert [g["tier"] for g in got] == ["/dev/shm/t-node0"] * 2 + ["/dev/shm/t-node1"] * 2


def test_the_rendezvous_port_is_free_and_below_the_ephemeral_range():
    """No connection's local port can take the rendezvous port between its check and torchrun's bind."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(20):
        port = nodes.free_port()
        assert 10000 <= port < low
