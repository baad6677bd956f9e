"""The core's storage seam (ext/storage.hpp): every file a save writes or a restore reads is created, opened,
sized, renamed and removed by the storage target (ext/storage_posix.cpp), so that a new target is one new
file. Read from the sources: a call of those system functions, or an open flag, anywhere else in ext/ fails
here, naming the file and line. What stays outside touches no file by name: cuda.cpp's dlopen of the
driver, fault.cpp's readlink of /proc/self/fd (test-only fault injection), the fstat, mmap and
posix_fallocate of descriptors the target handed out (mirror_file.cpp, restore.cpp), and the readers' pread
and io_uring reads."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXT = ROOT / "ext"
TARGET = "storage_posix.cpp"
INTERFACE = "storage.hpp"

# The system calls that name, create, size, move or remove a file, or open one.
CALLS = re.compile(
    r"(?<![\w.>])(?:::|std::)?\b(open|openat|open64|creat|fopen|freopen|rename|renameat|renameat2|unlink|"
    r"unlinkat|remove|truncate|ftruncate|mkdir|mkdirat|link|linkat|symlink|fstatfs|statfs)\s*\("
)
# The open flags that only an open of a checkpoint file uses.
FLAGS = re.compile(r"\bO_(?:CREAT|EXCL|DIRECT|NOFOLLOW|DIRECTORY|TRUNC|WRONLY|RDWR)\b")


def code_of(text: str) -> str:
    """The text without comments and string or character literals (each line kept, for line numbers)."""
    text = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group().count("\n"), text, flags=re.S)
    text = re.sub(r'"(?:\\.|[^"\\\n])*"', '""', text)
    text = re.sub(r"'(?:\\.|[^'\\\n])+'", "''", text)
    return re.sub(r"//[^\n]*", "", text)


def offences(name: str, text: str) -> list[str]:
    found = []
    for n, line in enumerate(code_of(text).splitlines(), 1):
        for m in CALLS.finditer(line):
            found.append(f"ext/{name}:{n}: {m.group(1)}(): {line.strip()}")
        for m in FLAGS.finditer(line):
            found.append(f"ext/{name}:{n}: {m.group()}: {line.strip()}")
    return found


def test_the_scanner_finds_calls_and_flags_and_skips_the_seam():
    sample = """
        // rename(a, b) in a comment
        const char* s = "unlink(x)";
        int fd = ::open(p.c_str(), O_RDONLY | O_DIRECT);
        if (rename(a, b) != 0) unlink(c);
        std::remove(p);
        storage_->open(file_, Access::Direct);
        storage.truncate(fd, n);
        void* lib = dlopen("libcuda.so.1", RTLD_NOW);
    """
    got = offences("sample.cpp", sample)
    assert [g.split(": ")[1] for g in got] == ["open()", "O_DIRECT", "rename()", "unlink()", "remove()"], got


def test_no_file_outside_the_storage_target_opens_renames_or_removes_checkpoint_files():
    sources = sorted(p for p in EXT.iterdir() if p.suffix in (".cpp", ".hpp"))
    assert (EXT / TARGET) in sources and (EXT / INTERFACE) in sources
    found = []
    for path in sources:
        if path.name not in (TARGET, INTERFACE):
            found += offences(path.name, path.read_text())
    assert not found, "file operations outside ext/" + TARGET + ":\n" + "\n".join(found)


def test_the_target_implements_every_method_of_the_interface():
    interface = code_of((EXT / INTERFACE).read_text())
    declared = set(re.findall(r"virtual\s+[\w:<>]+\s+(\w+)\s*\([^;]*\)\s*(?:noexcept\s*)?=\s*0;", interface))
    needed = {"create", "open", "truncate", "close", "publish", "open_folder", "discard", "open_read"}
    assert needed <= declared, f"ext/{INTERFACE} lacks {sorted(needed - declared)}"
    target = code_of((EXT / TARGET).read_text())
    overridden = set(re.findall(r"(\w+)\s*\([^;{]*\)\s*(?:const\s*)?(?:noexcept\s*)?override", target))
    assert declared == overridden, f"ext/{TARGET} overrides {sorted(overridden)}, declared {sorted(declared)}"


def test_every_method_of_the_interface_says_what_it_guarantees():
    lines = (EXT / INTERFACE).read_text().splitlines()
    for n, line in enumerate(lines):
        if re.search(r"\bvirtual\b.*\(", line) and "~" not in line:
            where = f"ext/{INTERFACE}:{n + 1}"
            assert lines[n - 1].strip().startswith("//"), f"{where}: no comment above {line.strip()}"
