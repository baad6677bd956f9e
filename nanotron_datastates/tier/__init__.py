"""Checkpoints kept in node memory, without Nanotron: `memory` (a rank's copy of the newest committed
checkpoint in the node's tmpfs: its folder, room check, commit, what a restart may read), `folders` (what the
tier's folders hold, read without trusting them), `jobs` (the job folders listed and cleared), `replicas`
(those copies replicated to other nodes after each commit), `replica_transfer` (files moved between ranks,
checked before placed), `links` and `link_nccl` (the way their bytes travel: NCCL through the GPUs, or gloo),
`replica_restore` (a restart pulling what its node lacks)."""
