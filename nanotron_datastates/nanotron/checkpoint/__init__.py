"""A checkpoint on disk: `layout` (the names of `nanotron_datastates.checkpoint`, where each file goes and
the manifest, re-exported), `folder` and `verify` (what a path holds: kind, step folders, `latest.txt`;
whether it is whole; both re-exported from `nanotron_datastates.checkpoint`), `convert` (to and from
Nanotron's stock layout: `convert_to_stock`, `convert_from_stock`, `stock_pickles`)."""
