"""`inspect`, `verify` and `convert`: what a checkpoint holds, whether it is sound, and the other layout."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..checkpoint import folder as checkpoint
from ..checkpoint import verify
from ..checkpoint.described import (
    CheckpointInfo,
    Described,
    FileInfo,
    FolderInfo,
    ListedFile,
    RootInfo,
    TensorInfo,
)
from .words import human_bytes, plural, print_lines, printable


def cmd_inspect(args: argparse.Namespace) -> int:
    """Prints what the path holds; 1 where a file in it could not be read (its line says ERROR)."""
    info = checkpoint.describe(args.path, tensors=args.tensors)
    if args.json:
        print(json.dumps(info, indent=1))
    elif info["kind"] == "file":
        print_lines(_file_text(info, args.tensors))
    elif info["kind"] == "folder":
        print_lines(_folder_text(info))
    elif info["kind"] == "checkpoint":
        print_lines(_checkpoint_text(info))
    else:
        print_lines(_root_text(info, args.tensors))
    return 1 if _unreadable_files(info) else 0


def _unreadable_files(info: Described) -> int:
    if info["kind"] == "root":
        listings = [ck["files"] for ck in info["checkpoints"]]
    else:
        listings = [info["files"]] if info["kind"] != "file" else []
    return sum("error" in f for files in listings for f in files)


def _root_text(info: RootInfo, tensors: bool) -> list[str]:
    latest = info["latest"]
    named = f"latest.txt names {latest}" if latest is not None else "no readable latest.txt"
    lines = [f"{info['path']}: {plural(len(info['checkpoints']), 'checkpoint')}, {named}"]
    for ck in info["checkpoints"]:
        lines.append(_checkpoint_line(ck))
        if tensors:
            lines.extend(_files_lines(ck["files"], "    "))
    return lines


def _checkpoint_line(ck: CheckpointInfo) -> str:
    topo = ", ".join(f"{k}={v}" for k, v in ck["topology"].items() if v is not None) or "?"
    state = "committed" if ck["committed"] else "NOT committed"
    latest = ", latest" if ck["latest"] else ""
    step = "?" if ck["step"] is None else ck["step"]
    return (
        f"  {Path(ck['path']).name}: step {step}, {ck['engine'] or 'unknown engine'}, {state}{latest}; "
        f"{plural(len(ck['files']), 'file')}, {plural(ck['tensors'], 'tensor')}, {human_bytes(ck['bytes'])}; "
        f"{topo}"
    )


def _checkpoint_text(ck: CheckpointInfo) -> list[str]:
    lines = [f"{ck['path']}:", _checkpoint_line(ck), *_files_lines(ck["files"], "    ")]
    lines.extend(_temporaries_lines(ck["temporaries"]))
    return lines


def _folder_text(info: FolderInfo) -> list[str]:
    files = info["files"]
    lines = [
        f"{info['path']}: {plural(len(files), 'safetensors file')}, {plural(info['tensors'], 'tensor')}, "
        f"{human_bytes(info['bytes'])}"
    ]
    lines.extend(_files_lines(files, "  "))
    lines.extend(_temporaries_lines(info["temporaries"]))
    return lines


def _files_lines(files: list[ListedFile], indent: str) -> list[str]:
    """One line per file; under a safetensors file read with its tensors, one line per tensor."""
    lines = []
    for f in files:
        desc = [human_bytes(f["bytes"])]
        if "tensors" in f:
            desc.append(f"{plural(f['tensors'], 'tensor')} {'/'.join(f['dtypes'])}".rstrip())
            desc.append(_writer_text(f["engine"], f["checksums"], f.get("checksums_in_manifest", False)))
        error = f"  ERROR {f['error']}" if "error" in f else ""
        lines.append(f"{indent}{f['file']}: {', '.join(desc)}{error}")
        lines.extend(_tensor_lines(f.get("tensor_list", []), indent + "  "))
    return lines


def _tensor_lines(tensors: list[TensorInfo], indent: str) -> list[str]:
    return [f"{indent}{t['name']}: {t['dtype']} {t['shape']} ({human_bytes(t['bytes'])})" for t in tensors]


def _temporaries_lines(temporaries: list[str]) -> list[str]:
    if not temporaries:
        return []
    n = plural(len(temporaries), "temporary", "temporaries")
    return [f"  {n} left by a process that died mid-save: {', '.join(temporaries)}"]


def _writer_text(engine: str, checksums: bool, in_manifest: bool = False) -> str:
    if checksums:
        return f"{engine}, CRC-32C per tensor"
    return f"{engine}, {'CRC-32C per tensor in datastates.json' if in_manifest else 'no checksums'}"


def _file_text(info: FileInfo, tensors: bool) -> list[str]:
    listed = info["tensors"]
    dtypes = "/".join(sorted({t["dtype"] for t in listed}))
    size = sum(t["bytes"] for t in listed)
    count = f"{plural(len(listed), 'tensor')} {dtypes}".rstrip()
    lines = [
        f"{info['path']}: {human_bytes(info['bytes'])}, {count} ({human_bytes(size)} of data), "
        f"{_writer_text(info['engine'], info['checksums'])}"
    ]
    if tensors:
        lines.extend(_tensor_lines(listed, "  "))
    for k, v in info["metadata"].items():
        lines.append(f"  metadata {k} = {v[:100]}{'...' if len(v) > 100 else ''}")
    return lines


def cmd_verify(args: argparse.Namespace) -> int:
    if checkpoint.kind_of(args.path) not in checkpoint.KINDS:
        raise checkpoint.NotACheckpoint(checkpoint.explain(args.path))
    report = verify.verify(args.path)
    if args.json:
        print(json.dumps(report.as_dict(), indent=1))
    else:
        lines = [f"note: {n}" for n in report.notes] + [f"PROBLEM: {p}" for p in report.problems]
        print_lines([*lines, _verify_summary(report)])
    return 0 if report.ok else 1


def _verify_summary(r: verify.Report) -> str:
    verdict = "OK" if r.ok else f"FAILED ({plural(len(r.problems), 'problem')})"
    files = plural(r.files_checked, "file") + " checked"
    if r.files_failed:
        files += f" ({r.files_failed} failed)"
    tensors = plural(r.tensors_checksummed, "tensor") + " checksummed"
    if r.tensors_failed:
        tensors += f" ({r.tensors_failed} failed)"
    parts = [files, tensors]
    if r.files_without_checksums:
        parts.append(f"{plural(r.files_without_checksums, 'file')} without checksums (structure checked)")
    return f"{r.path}: {verdict}; {', '.join(parts)}"


def cmd_convert(args: argparse.Namespace) -> int:
    from ..nanotron.checkpoint.convert import convert

    out = convert(args.src, args.out, to=args.to, allow_pickle=args.allow_pickle)
    print(printable(f"{args.src} -> {out} ({args.to} layout)"))
    return 0
