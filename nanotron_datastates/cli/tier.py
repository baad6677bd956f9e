"""`tier`: the memory tier's job folders, listed or cleared."""

from __future__ import annotations

import argparse
import json
import os

from .words import human_bytes, plural


def cmd_tier(args: argparse.Namespace) -> int:
    from ..tier import jobs as tier_jobs
    from ..tier.memory import job_folder

    args.path = args.path.replace("{uid}", str(os.geteuid()))
    if args.action == "list":
        jobs = tier_jobs.jobs(args.path)
        if args.json:
            print(json.dumps(jobs, indent=1))
            return 0
        if not jobs:
            print(f"{args.path}: no checkpoint held in memory")
        for j in jobs:
            steps = ", ".join(map(str, j["steps"])) or "none"
            print(
                f"{j['folder']}: {j['checkpoints'] or '(checkpoints folder unknown)'}, "
                f"{plural(len(j['steps']), 'step')} ({steps}), {human_bytes(j['bytes'])}"
            )
            for step, ranks in j["replicas"].items():
                print(
                    f"  replicas of step {step} for rank(s) {', '.join(map(str, ranks)) or '(none marked)'} "
                    f"of other nodes ({human_bytes(j['replica_bytes'])} in all replicas)"
                )
        return 0
    if not os.path.lexists(args.path):
        raise FileNotFoundError(f"{args.path}: no such folder (the memory tier's, --path): nothing to clear")
    folders = [job_folder(args.path, args.checkpoints)] if args.checkpoints else None
    if folders and not os.path.lexists(folders[0]):
        raise FileNotFoundError(f"{folders[0]}: the tier holds no job of {args.checkpoints}")
    removed = tier_jobs.clear_jobs(args.path, folders)
    print(f"{args.path}: removed {plural(len(removed), 'job folder')}")
    return 0
