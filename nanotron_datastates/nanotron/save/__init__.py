"""The save path, in the order a checkpoint goes through it: `saver` (the request, from the trainer),
`rank_files` (what each rank writes, planned once) and `optimizer_plan` (the optimizer's file, planned like
the last), `request` (a checkpoint until the committer has it), `staging` (copied on the GPU first, or not),
`gate` (the optimizer step waits for the snapshot), the engine's flush, `commit` (every rank persisted:
agreed across ranks), `commit_files` (rank 0: Nanotron's files, the manifest, `latest.txt`), `report` (each
outcome: the memory tier's mark, the log, the observers), `housekeeping` (rotation, temporaries,
telemetry); `memory` (the memory tier and its replicas), `writer_lock`: one job per checkpoints folder.

`staging`, `gate`, `commit`, `housekeeping` and `writer_lock` need no Nanotron: they live in
`nanotron_datastates.save`, and the names here re-export them."""
