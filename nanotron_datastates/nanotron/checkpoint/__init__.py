"""A checkpoint on disk, without Nanotron: `layout` (where each file goes; the manifest), `folder` (what a
path holds: kind, step folders, `latest.txt`), `verify` (whether it is whole), `convert` (to and from
Nanotron's stock layout)."""
