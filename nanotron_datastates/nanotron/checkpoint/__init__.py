"""A checkpoint on disk: `layout` (the names of `nanotron_datastates.checkpoint`, where each file goes and
the manifest, re-exported), `folder` (what a path holds: kind, step folders, `latest.txt`; re-exported from
`nanotron_datastates.checkpoint.folder`), `verify` (whether it is whole), `convert` (to and from Nanotron's
stock layout: `convert_to_stock`, `convert_from_stock`, `stock_pickles`)."""
