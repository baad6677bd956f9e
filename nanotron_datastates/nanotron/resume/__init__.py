"""The resume path, in the order a restart goes through it: `source` (which checkpoint, before the process
groups exist), `read_ahead` (its files read onto the GPU while the model is built), `resume` (the weights,
then the rest), `scheduler_and_rng`, `deferred_optimizer` (the optimizer state, at the first step),
`fallback` (memory or storage; an older checkpoint where one cannot be read whole); on another layout,
`saved_layout`, `reshard_plan` and `reshard`."""
