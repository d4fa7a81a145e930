"""A worker for tests/parallel/test_processes.py: rank 1 writes ``payload["noise"]`` characters to stderr (or
raises), then every rank joins one all-reduce."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from fxforge.parallel.processes import worker_main


def run_rank(payload, rank, world, device):
    if rank == 1:
        if payload.get("fail"):
            raise ValueError("rank one refuses")
        sys.stderr.write("w" * payload["noise"])
        sys.stderr.flush()
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    return {"total": total.item()}


def main(argv):
    return worker_main(argv, run_rank)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
