"""A checkpoint on disk, without Nanotron: `names` (where each file goes, the names Nanotron gives them),
`manifest` (the file that marks a datastates checkpoint: written, read, checked), `topology` (the parallel
layout a checkpoint was written with, and what changed since), `checksums` (what a manifest holds for each
file), `reads` (which files a rank reads on resume), `file_io` (atomic writes, fsync, JSON and YAML read
without trusting them), `folder_copy` (a checkpoint folder's files listed, copied and made durable, as
converting does), `folder` (what a path holds: its kind, step folders, `latest.txt`, described), `verify`
(whether it is whole: every file and tensor checked). Only `folder` and `verify` need torch (to read
safetensors headers; `verify` reads through the engine)."""
