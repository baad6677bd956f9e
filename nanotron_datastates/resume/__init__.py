"""The resume path's mechanisms that need no Nanotron, which the adapter's `nanotron/resume/` drives:
`read_ahead` (a rank's files read onto its GPU, or the node's into the page cache, while the model is built:
through the engine, shared out by torchrun's environment), `deferred_optimizer` (the optimizer state loaded
at its first use), `reshard_plan` (on another layout: which ranges of which saved tensors rebuild a rank's
piece of a parameter, and putting them together)."""
