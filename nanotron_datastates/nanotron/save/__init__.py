"""The save path, in the order a checkpoint goes through it: `saver` (the request, from the trainer),
`staging` (copied on the GPU first, or not), `gate` (the optimizer step waits for the snapshot), the engine's
flush, `commit` (every rank persisted: agreed across ranks), `commit_files` (rank 0: Nanotron's files, the
manifest, `latest.txt`), `housekeeping` (rotation, temporaries, telemetry); `writer_lock`: one job per
checkpoints folder."""
