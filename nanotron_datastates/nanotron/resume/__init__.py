"""The resume path as it reads Nanotron's objects, in the order a restart goes through it: `source` (which
checkpoint, before the process groups exist), `early` (its files read onto the GPU while the model is built),
`resume` (`weights`, then the rest), `scheduler_and_rng`, `optimizer_state` (the optimizer state, resharded
now or loaded at the first step), `fallback` (memory or storage; an older checkpoint where one cannot be read
whole); on another layout, `saved_layout` (the saved layout, from the files) and `reshard`.

What needs no Nanotron is in `nanotron_datastates.resume`: `read_ahead` (the reads `early` starts),
`deferred_optimizer` (the load at the first step), `reshard_plan` (the ranges a reshard reads)."""
