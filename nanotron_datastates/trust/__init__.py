"""The trust boundary: every path the package acts on in a folder it shares with others, checked here and
nowhere else (docs/SECURITY.md says what is trusted and why).

- `step_number`: the one parser of step numbers (folder names, `latest.txt`): canonical ASCII decimal only.
- `relative_name`: a name read from a file (a marker, a manifest) as a path under a folder: relative, no
  `..`, no empty or `.` part (`name_parts`: the same check, giving the parts). Files list names, never paths.
- `walk_dir` / `unlink_in` / `remove_tree` / `walk_tree` / `remove_files` / `write_in` / `rename_in` /
  `link_in`: act inside a folder without following a link anywhere below it (each component opened with
  O_NOFOLLOW from its parent's descriptor, files created O_EXCL), never recursing on the Python stack.
- `private_dir`: a folder only its owner can use (created 0700; refused if it is a link, has another owner,
  or lets the group or others write or enter it), under folders no other user can change.
- `open_regular` / `read_regular`: a file opened without following a link (its last component, or every one
  below a folder), checked to be a regular file (owned by this user, where asked), read to a bound;
  `open_to_read`: a path the caller chose, a link followed. Both check the file on a handle that opens
  nothing (O_PATH), then open that very file: a FIFO or device swapped in after the check is never opened.

Imports neither torch nor Nanotron (the core's module, `_core`, neither).
"""

from __future__ import annotations

from ..errors import UntrustedPath
from .files import open_regular, open_to_read, read_regular
from .inside import (
    DIR_FLAGS,
    NEW_FILE,
    is_real_dir,
    link_in,
    remove_files,
    remove_tree,
    rename_in,
    unlink_in,
    walk_dir,
    walk_tree,
    write_in,
)
from .names import name_parts, relative_name, step_number
from .private import private_dir

__all__ = [
    "DIR_FLAGS",
    "NEW_FILE",
    "UntrustedPath",
    "is_real_dir",
    "link_in",
    "name_parts",
    "open_regular",
    "open_to_read",
    "private_dir",
    "read_regular",
    "relative_name",
    "remove_files",
    "remove_tree",
    "rename_in",
    "step_number",
    "unlink_in",
    "walk_dir",
    "walk_tree",
    "write_in",
]
