"""The resume path, in the order a restart goes through it: `source` (which checkpoint, before the process
groups exist), `early` and `read_ahead` (its files read onto the GPU while the model is built), `resume`
(`weights`, then the rest), `scheduler_and_rng`, `optimizer_state` and `deferred_optimizer` (the optimizer
state, resharded now or at the first step),
`fallback` (memory or storage; an older checkpoint where one cannot be read whole); on another layout,
`saved_layout`, `reshard_plan` and `reshard`."""
