"""The save path as it reads Nanotron's objects, in the order a checkpoint goes through it: `saver` (the
request, from the trainer), `rank_files` (what each rank writes, planned once), `request` (a checkpoint until
the committer has it), `queuing` (its capture, hand-over and queuing), `commit_files` (rank 0: Nanotron's
files, the manifest, `latest.txt`), `report` (each outcome: the memory tier's mark, the log, the
observers); `memory` (the memory tier and its replicas).

What needs no Nanotron is in `nanotron_datastates.save`, which `saver` drives: `optimizer_plan` (the
optimizer's file, planned like the last), `staging` (copied on the GPU first, or not), `gate` (the optimizer
step waits for the snapshot), `queuer`, then the engine's flush, `commit` (every rank persisted: agreed
across ranks), `housekeeping` (rotation, temporaries, telemetry); the writer lock (one job per checkpoints
folder) is the store's."""
