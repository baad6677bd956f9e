"""bench_engine.py's results: medians, throughputs and ratios of the raw values, the goals judged from them,
the printed table, and the round-trip checks that failed.
"""

from __future__ import annotations

from typing import Any

from _common import GiB, format_table, gbps, summarize
from _engine_measure import DD_STREAMS

# Goals from the issue: name -> (threshold, direction). "min": value must be >= threshold, "max": <=.
GOALS = {
    "persisted_vs_dd_write": (0.9, "min"),
    "blocking_vs_torch_save": (0.1, "max"),
    "restore_speedup_vs_safetensors": (1.5, "min"),
    "gpu_d2h_vs_pinned_copy": (0.8, "min"),
    "gpu_restore_speedup_vs_safetensors": (1.5, "min"),  # the restore goal, applied to cuda:0 as well
}


def goal(name: str, value: float | None, detail: str) -> dict[str, Any]:
    threshold, direction = GOALS[name]
    if value is None:
        verdict = "SKIPPED"
    elif direction == "min":
        verdict = "PASS" if value >= threshold else "FAIL"
    else:
        verdict = "PASS" if value <= threshold else "FAIL"
    return {
        "name": name,
        "value": value,
        "threshold": threshold,
        "direction": direction,
        "verdict": verdict,
        "detail": detail,
    }


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize_cpu(raw: dict[str, Any], nbytes: int) -> tuple[dict[str, Any], dict[str, Any], list[dict]]:
    """Medians per measurement, derived throughputs and ratios, and the CPU goal verdicts."""
    med: dict[str, Any] = {}

    def field(key: str, name: str) -> list[float]:
        return [x[name] for x in raw.get(key, [])]

    med["engine_blocking_s"] = summarize(field("engine_save", "blocking_s"))
    med["engine_persisted_s"] = summarize(field("engine_save", "persisted_s"))
    med["engine_shm_blocking_s"] = summarize(field("engine_shm_save", "blocking_s"))
    med["engine_shm_persisted_s"] = summarize(field("engine_shm_save", "persisted_s"))
    for key in ("torch", "safetensors"):
        med[f"{key}_save_fsync_s"] = summarize(field(f"{key}_save", "persisted_s"))
    for key in ("dcp", "dcp_zo"):
        med[f"{key}_blocking_s"] = summarize(field(f"{key}_save", "blocking_s"))
        med[f"{key}_persisted_s"] = summarize(field(f"{key}_save", "persisted_s"))
    for key in ("engine_restore_s", "torch_load_s", "safetensors_load_s"):
        med[key] = summarize(raw.get(key, []))
        med[key + "_returned"] = summarize(raw.get(key + "_returned", []))
    med["dd_shm_write_gbps"] = summarize([x["gbps"] for x in raw["dd_shm_write"]])
    for i, streams in enumerate(DD_STREAMS):
        for op in ("write", "read"):
            med[f"dd_{op}_{streams}x_gbps"] = summarize([rep[i][op]["gbps"] for rep in raw["dd"]])

    file_bytes = raw["engine_save"][0]["file_bytes"] if raw["engine_save"] else nbytes
    m = {k: v["median"] for k, v in med.items()}
    write_ceiling = max(m[f"dd_write_{s}x_gbps"] for s in DD_STREAMS)
    read_ceiling = max(m[f"dd_read_{s}x_gbps"] for s in DD_STREAMS)
    persisted_gbps = gbps(file_bytes, m["engine_persisted_s"])
    restore_gbps = gbps(file_bytes, m["engine_restore_s"])
    derived = {
        "engine_file_bytes": file_bytes,
        "engine_persisted_gbps": persisted_gbps,
        "engine_snapshot_gbps": gbps(nbytes, m["engine_blocking_s"]),
        "engine_restore_gbps": restore_gbps,
        "engine_shm_persisted_gbps": gbps(file_bytes, m["engine_shm_persisted_s"]),
        "engine_shm_vs_dd_shm_write": ratio(
            gbps(file_bytes, m["engine_shm_persisted_s"]), m["dd_shm_write_gbps"]
        ),
        "torch_save_fsync_gbps": gbps(nbytes, m["torch_save_fsync_s"]),
        "safetensors_save_fsync_gbps": gbps(nbytes, m["safetensors_save_fsync_s"]),
        "torch_load_gbps": gbps(nbytes, m["torch_load_s"]),
        "safetensors_load_gbps": gbps(nbytes, m["safetensors_load_s"]),
        "dd_write_ceiling_gbps": write_ceiling,
        "dd_read_ceiling_gbps": read_ceiling,
        "persisted_vs_dd_write": ratio(persisted_gbps, write_ceiling),
        "restore_vs_dd_read": ratio(restore_gbps, read_ceiling),
        "blocking_vs_torch_save": ratio(m["engine_blocking_s"], m["torch_save_fsync_s"]),
        "blocking_vs_safetensors_save": ratio(m["engine_blocking_s"], m["safetensors_save_fsync_s"]),
        "persisted_speedup_vs_torch_save": ratio(m["torch_save_fsync_s"], m["engine_persisted_s"]),
        "restore_speedup_vs_safetensors": ratio(m["safetensors_load_s"], m["engine_restore_s"]),
        "restore_speedup_vs_torch_load": ratio(m["torch_load_s"], m["engine_restore_s"]),
        "blocking_vs_dcp_zo": ratio(m["engine_blocking_s"], m["dcp_zo_blocking_s"]),
        "persisted_speedup_vs_dcp_zo": ratio(m["dcp_zo_persisted_s"], m["engine_persisted_s"]),
    }
    goals = [
        goal(
            "persisted_vs_dd_write",
            derived["persisted_vs_dd_write"],
            f"engine {fmt_rate(persisted_gbps)} vs dd O_DIRECT write ceiling {fmt_rate(write_ceiling)}",
        ),
        goal(
            "blocking_vs_torch_save",
            derived["blocking_vs_torch_save"],
            f"engine {fmt_s(m['engine_blocking_s'])} vs torch.save+fsync {fmt_s(m['torch_save_fsync_s'])}",
        ),
        goal(
            "restore_speedup_vs_safetensors",
            derived["restore_speedup_vs_safetensors"],
            f"engine {fmt_s(m['engine_restore_s'])} vs safetensors {fmt_s(m['safetensors_load_s'])}",
        ),
    ]
    return med, derived, goals


def summarize_gpu(raw: dict[str, Any], nbytes: int) -> tuple[dict[str, Any], dict[str, Any], list[dict]]:
    med = {
        "engine_blocking_s": summarize([x["blocking_s"] for x in raw["engine_save"]]),
        "engine_snapshot_s": summarize([x["engine_snapshot_s"] for x in raw["engine_save"]]),
        "engine_persisted_s": summarize([x["persisted_s"] for x in raw["engine_save"]]),
        "pinned_copy_s": summarize(raw["pinned_copy_s"]),
        "engine_restore_s": summarize(raw["engine_restore_s"]),
        "safetensors_load_s": summarize(raw.get("safetensors_load_s", [])),
        "safetensors_load_s_returned": summarize(raw.get("safetensors_load_s_returned", [])),
    }
    m = {k: v["median"] for k, v in med.items()}
    d2h, pinned = gbps(nbytes, m["engine_snapshot_s"]), gbps(nbytes, m["pinned_copy_s"])
    derived = {
        "engine_d2h_gbps": d2h,
        "engine_blocking_gbps": gbps(nbytes, m["engine_blocking_s"]),
        "pinned_copy_gbps": pinned,
        "engine_persisted_gbps": gbps(nbytes, m["engine_persisted_s"]),
        "engine_restore_gbps": gbps(nbytes, m["engine_restore_s"]),
        "safetensors_load_gbps": gbps(nbytes, m["safetensors_load_s"]),
        "gpu_d2h_vs_pinned_copy": ratio(d2h, pinned),
        "restore_speedup_vs_safetensors": ratio(m["safetensors_load_s"], m["engine_restore_s"]),
    }
    goals = [
        goal(
            "gpu_d2h_vs_pinned_copy",
            derived["gpu_d2h_vs_pinned_copy"],
            f"engine D2H {fmt_rate(d2h)} (snapshot {fmt_s(m['engine_snapshot_s'])}) vs pinned copy_ "
            f"{fmt_rate(pinned)}",
        ),
        goal(
            "gpu_restore_speedup_vs_safetensors",
            derived["restore_speedup_vs_safetensors"],
            f"engine {fmt_s(m['engine_restore_s'])} vs safetensors {fmt_s(m['safetensors_load_s'])}",
        ),
    ]
    return med, derived, goals


def fmt_s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f} s"


def fmt_rate(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f} GB/s"


def fmt_row(label: str, s: dict[str, Any], nbytes: int) -> list[str]:
    """One table row: median seconds, every value, and the throughput of the median."""
    if not s["n"]:
        return [label, "-", "-", "-"]
    values = " ".join(f"{v:.3f}" for v in s["values"])
    return [label, f"{s['median']:.3f}", values, fmt_rate(gbps(nbytes, s["median"]))]


def print_report(result: dict[str, Any]) -> None:
    nbytes = result["state"]["total_bytes"]
    rows: list[list[str]] = []
    cpu = result.get("cpu")
    if cpu:
        med = cpu["summary"]
        labels = {
            "engine_blocking_s": "engine blocking (save+wait_snapshot)",
            "engine_persisted_s": "engine save -> persisted",
            "engine_restore_s": "engine cold restore",
            "engine_shm_persisted_s": "engine -> /dev/shm persisted",
            "torch_save_fsync_s": "torch.save + fsync",
            "safetensors_save_fsync_s": "safetensors save_file + fsync",
            "dcp_blocking_s": "DCP async_save: blocking",
            "dcp_persisted_s": "DCP async_save: persisted",
            "dcp_zo_blocking_s": "DCP zero-overhead: blocking (staged)",
            "dcp_zo_persisted_s": "DCP zero-overhead: persisted",
            "torch_load_s": "torch.load (cold)",
            "safetensors_load_s": "safetensors load_file (cold, resident)",
            "safetensors_load_s_returned": "  of which until load_file returned",
        }
        rows += [fmt_row(label, med[k], nbytes) for k, label in labels.items()]
        dd_rows = {
            f"dd_{op}_{n}x_gbps": f"dd O_DIRECT {op}, {n} stream(s)"
            for op in ("write", "read")
            for n in DD_STREAMS
        }
        dd_rows["dd_shm_write_gbps"] = "dd to /dev/shm (buffered + fsync)"
        for key, label in dd_rows.items():
            values = " ".join(f"{v:.2f}" for v in med[key]["values"])
            rows.append([label, "", f"GB/s: {values}", fmt_rate(med[key]["median"])])
    gpu = result.get("cuda")
    if gpu:
        med = gpu["summary"]
        labels = {
            "engine_blocking_s": "cuda: engine blocking",
            "engine_snapshot_s": "cuda: engine snapshot (D2H)",
            "pinned_copy_s": "cuda: pinned copy_ (D2H)",
            "engine_persisted_s": "cuda: engine save -> persisted",
            "engine_restore_s": "cuda: engine cold restore",
            "safetensors_load_s": "cuda: safetensors load_file (cold)",
        }
        rows += [fmt_row(label, med[k], nbytes) for k, label in labels.items()]
    drop = result["cache_drop"]
    restores = f"cold ({drop})" if drop != "none" else "WARM (--no-drop-caches)"
    print()
    print(
        f"state: {result['state']['n_tensors']} tensors, {nbytes / GiB:.3f} GiB; "
        f"restores: {restores}; engine io: {result['engine']['io_backend']}; "
        f"load average {result['loadavg_start'][0]:.1f} -> {result['loadavg_end'][0]:.1f}"
    )
    print(format_table(["measurement", "median s", "values", "rate (median)"], rows))
    print()
    goal_rows = [
        [
            g["name"],
            g["verdict"],
            "-" if g["value"] is None else f"{g['value']:.3f}",
            f"{'>=' if g['direction'] == 'min' else '<='} {g['threshold']}",
            g["detail"],
        ]
        for g in result["goals"]
    ]
    print(format_table(["goal", "verdict", "value", "target", "detail"], goal_rows))


def failed_checks(result: dict[str, Any]) -> list[str]:
    """Names of the round-trip checks (restored == saved) that failed."""
    bad = []
    for part in ("cpu", "cuda"):
        for checks in result.get(part, {}).get("raw", {}).get("verified", []):
            bad += [name for name, ok in checks.items() if not ok]
    return bad
