"""Does a gloo group come up in workers that torchrun restarted in place? Plain torch, no engine (CPU):

    torchrun --standalone --nproc-per-node=2 --max-restarts=1 benchmarks/micro/torchrun_restart_gloo.py

Each worker makes a gloo group and sums over it; in the first incarnation rank 1 then SIGKILLs itself and
torchrun restarts both. Each incarnation prints what it reached. With torch 2.13 (CPU) the restarted
workers fail in `init_process_group` ("Gloo connectFullMesh failed ... Connection refused"): the store they
are handed still holds the dead workers' addresses (pytorch/pytorch#167288). The engine's groups are gloo,
so a job of several ranks restarted this way fails as the trainer is built.
"""

import os
import signal
import time

import torch
import torch.distributed as dist

restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
dist.init_process_group("gloo")
print(f"incarnation {restart}, rank {dist.get_rank()}: default group up", flush=True)
group = dist.new_group(backend="gloo")
total = torch.ones(1)
dist.all_reduce(total, group=group)
print(f"incarnation {restart}, rank {dist.get_rank()}: gloo group up, sum {total.item()}", flush=True)
if restart == 0:
    dist.barrier()
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(5)
