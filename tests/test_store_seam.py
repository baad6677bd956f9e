"""The Python side of the storage seam (nanotron_datastates/store/): every rename, every removal and every
write of `latest.txt` or a manifest that the package does itself goes through a `Store`, so that a new
storage target is one new module there. Read from the sources (their syntax tree): such an operation anywhere
else fails here, naming the file and line. Outside the seam by design: `trust/` (the checks and acts
by descriptor the store is made of), `checkpoint/file_io.py` (the atomic write), `tier/` (the node-memory
tier's own folders, not a checkpoints folder)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "nanotron_datastates"
EXEMPT = ("store/", "trust/", "checkpoint/file_io.py", "tier/")

OS_CALLS = {"replace", "rename", "renames", "unlink", "remove", "rmdir", "removedirs"}  # os.<name>(...)
SHUTIL_CALLS = {"rmtree", "move"}
PATH_METHODS = {"unlink", "rmdir", "rename"}  # p.<name>(...), on any object; `replace` with one argument
TRUST_ACTS = {"unlink_in", "remove_tree", "remove_files", "rename_in", "write_in", "link_in"}
MARKERS = {"LATEST", "MANIFEST", "latest.txt", "datastates.json"}
WRITE_FLAGS = {"O_WRONLY", "O_RDWR", "O_CREAT", "O_APPEND", "O_TRUNC"}


def _name(node: ast.AST) -> str:
    """`a.b.c` of a name or attribute chain ('' for anything else)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _name(node.value)
        return f"{base}.{node.attr}" if base else f"?.{node.attr}"
    return ""


def _names_a_marker(node: ast.AST) -> bool:
    """`latest.txt` or the manifest named in `node`: by their constants or their literal names."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and sub.id in MARKERS:
            return True
        if isinstance(sub, ast.Attribute) and sub.attr in MARKERS:
            return True
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str) and sub.value in MARKERS:
            return True
    return False


def _writes(call: ast.Call, name: str) -> bool:
    """Whether `call` opens or writes a file for writing."""
    attr = name.rsplit(".", 1)[-1]
    if attr in ("write_text", "write_bytes", "touch"):
        return True
    if name in ("open", "io.open") or (attr == "open" and name != "os.open"):
        modes = [a for a in call.args[1:2]] + [k.value for k in call.keywords if k.arg == "mode"]
        return any(
            not (isinstance(m, ast.Constant) and isinstance(m.value, str)) or set(m.value) & set("wax+")
            for m in modes
        )
    if name == "os.open":
        flags = [a for a in call.args[1:2]] + [k.value for k in call.keywords if k.arg == "flags"]
        return any(isinstance(s, ast.Attribute) and s.attr in WRITE_FLAGS for f in flags for s in ast.walk(f))
    return False


def offences(rel: str, source: str) -> list[str]:
    """Each rename, removal, atomic write or write of a marker file in `source`: `file:line: what: code`."""
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source, rel)):
        if not isinstance(node, ast.Call):
            continue
        name = _name(node.func)
        attr = name.rsplit(".", 1)[-1]
        what = None
        if (name.startswith("os.") and attr in OS_CALLS and name.count(".") == 1) or name in {
            f"shutil.{c}" for c in SHUTIL_CALLS
        }:
            what = f"{name}() renames or removes"
        elif "." in name and not name.startswith("os.") and attr in PATH_METHODS:
            what = f".{attr}() renames or removes"
        elif "." in name and attr == "replace" and len(node.args) + len(node.keywords) == 1:
            what = ".replace() renames"
        elif attr in TRUST_ACTS and (name == attr or name.startswith("trust.")):
            what = f"{name}() removes, renames or writes inside a folder"
        elif name in ("write_atomic", "file_io.write_atomic"):
            what = "write_atomic() writes a checkpoint's file"
        elif _writes(node, name) and _names_a_marker(node):
            what = "writes latest.txt or a manifest"
        if what:
            found.append(f"nanotron_datastates/{rel}:{node.lineno}: {what}: {lines[node.lineno - 1].strip()}")
    return sorted(found, key=lambda f: int(f.split(":")[1]))


def test_the_scanner_finds_each_kind_and_leaves_reads_and_the_store_alone():
    sample = """
import os, shutil
os.replace(tmp, path)
os.unlink(path)
shutil.rmtree(folder, ignore_errors=True)
(root / "10").rename(root / "11")
p.unlink(missing_ok=True)
p.replace(q)
write_atomic(folder / "config.yaml", text)
trust.remove_tree(root, "10")
(root / LATEST).write_text("10")
with open(folder / MANIFEST, "w") as f: pass
fd = os.open(root / "latest.txt", os.O_WRONLY | os.O_CREAT)
text.replace("a", "b")
names.remove("x")
store.write_atomic(f"{step}/{MANIFEST}", doc)
store.set_latest(10)
store.remove_step(10)
with open(folder / MANIFEST) as f: pass
raw = trust.read_regular(root / LATEST, 64)
(path / LATEST).is_file()
"""
    got = [line.split(": ")[1] for line in offences("sample.py", sample)]
    assert got == [
        "os.replace() renames or removes",
        "os.unlink() renames or removes",
        "shutil.rmtree() renames or removes",
        ".rename() renames or removes",
        ".unlink() renames or removes",
        ".replace() renames",
        "write_atomic() writes a checkpoint's file",
        "trust.remove_tree() removes, renames or writes inside a folder",
        "writes latest.txt or a manifest",
        "writes latest.txt or a manifest",
        "writes latest.txt or a manifest",
    ], got


def test_no_module_outside_the_store_renames_removes_or_writes_latest_or_a_manifest():
    sources = sorted(PACKAGE.rglob("*.py"))
    rels = [p.relative_to(PACKAGE).as_posix() for p in sources]
    assert "store/__init__.py" in rels and "store/posix.py" in rels
    found = []
    for path, rel in zip(sources, rels):
        if not rel.startswith(EXEMPT):
            found += offences(rel, path.read_text())
    assert not found, "checkpoint folder operations outside nanotron_datastates/store/:\n" + "\n".join(found)


def test_every_method_of_the_store_says_what_it_guarantees_and_the_posix_store_has_them_all():
    from nanotron_datastates.store import Store
    from nanotron_datastates.store.posix import FolderStore

    tree = ast.parse((PACKAGE / "store" / "__init__.py").read_text())
    (protocol,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Store"]
    methods = [n for n in protocol.body if isinstance(n, ast.FunctionDef)]
    assert len(methods) >= 10
    for m in methods:
        doc = ast.get_docstring(m)
        where = f"nanotron_datastates/store/__init__.py:{m.lineno}"
        assert doc and len(doc) > 40, f"{where}: Store.{m.name} says nothing of what it guarantees"
        assert callable(getattr(FolderStore, m.name, None)), f"FolderStore lacks {m.name} of {Store.__name__}"
