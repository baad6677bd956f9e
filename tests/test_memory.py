"""Memory: the host cache is the engine's only large allocation. A 4 GiB state saved through a 256 MiB cache
raises the process's peak RSS by at most the cache plus 10%, measured in a fresh process (the peak is reset
once the state exists, through /proc/self/clear_refs)."""

import json
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import json, os, sys, torch
    from nanotron_datastates import DataStatesConfig, DataStatesEngine

    def status(key):
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key + ":"))

    state = {f"t{i}": torch.full((64 << 20,), float(i)) for i in range(16)}  # 16 x 256 MiB = 4 GiB
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak RSS to the current RSS
    base = status("VmRSS")
    cache = 256 << 20
    with DataStatesEngine(DataStatesConfig(host_cache_size=0.25, chunk_size=16)) as engine:
        engine.save(state, sys.argv[1]).wait_persisted()
        engine.save(state, sys.argv[1]).wait_persisted()  # the cache is reused, not grown
        peak = status("VmHWM")
    os.unlink(sys.argv[1])
    print(json.dumps({"base": base, "peak": peak, "cache": cache}))
    """
)


@pytest.mark.slow
def test_saving_4gib_through_a_256mib_cache_stays_within_the_cache(tmp_path):
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "big.safetensors")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    m = json.loads(r.stdout.strip().splitlines()[-1])
    grew = m["peak"] - m["base"]
    print(f"peak RSS above baseline: {grew / 2**20:.0f} MiB (cache {m['cache'] / 2**20:.0f} MiB)")
    assert grew <= 1.10 * m["cache"], m
