"""The save path: `plan` (what a file holds, where each tensor goes), `stage` (the state copied where it is,
before the step changes it), `staged_save` (a staged save queued later), `handle` (one save in flight) and
`in_flight` (every save the engine has not seen end); and the mechanisms that need no Nanotron, which the
adapter's `nanotron/save/` drives:
`optimizer_plan` (the optimizer's file, planned at each checkpoint like the last), `staging` (whether a
checkpoint is copied on the GPU first), `gate` (the optimizer step waits for the snapshot, and nothing else
does), `queuer` (a thread that queues what the training thread captured), `commit` (every rank persisted:
agreed across ranks over gloo, rank 0 finalizing), `housekeeping` (rotation, temporaries left by dead
processes, telemetry). The writer lock (one job per checkpoints folder) is the store's
(`store/writer_lock.py`)."""
