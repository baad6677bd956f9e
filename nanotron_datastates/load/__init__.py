"""The load path, on the caller's thread and the core's: `opening` (a file opened once, its header parsed and
checked), `ranges` (which bytes a read needs), `host` and `device` (the core's reads into host memory or
GPU tensors), `checksums` (each piece checked as it lands), `verify` (a file checked end to end), `restore`
(the reads as the engine offers them) and `engine_reads` (the engine's reading methods)."""
