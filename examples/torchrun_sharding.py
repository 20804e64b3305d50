"""Shard a data set across torchrun ranks with mxload.

Run (CPU only, gloo backend; torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT):

    torchrun --nproc_per_node=2 examples/torchrun_sharding.py --out DIR

Every rank builds ``mxload.DataLoader(..., distributed=True)`` over the same
synthetic ``ArrayDataset`` (sample ``i`` is the integer ``i``, so a batch *is*
its indices), once with ``drop_last=False`` and once with ``drop_last=True``,
and runs ``--epochs`` epochs, calling ``loader.sampler.set_epoch(epoch)``
before each as in PyTorch.  The sampler takes rank and world size from the
initialised process group.  Each rank writes ``DIR/rank{R}.json``:

    {"rank": R, "world_size": W, "n": ..., "batch_size": ..., "seed": ...,
     "sampler": {"rank": R, "num_replicas": W},
     "runs": {"drop_last=False": {"epochs": [[batch, ...], ...],   # per epoch, batches of indices
                                   "batch_counts": [[...], ...]},   # per rank, per epoch (all-gathered)
              "drop_last=True": {...}}}

Ranks all-gather their per-epoch batch counts and exit non-zero if they
differ (an uneven count would hang the first collective op of a real training
step).  The default n=103 is odd, so with drop_last=False the last shard is
padded with the epoch's first index.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

import mxload


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for rank{R}.json")
    p.add_argument("--num-samples", type=int, default=103, help="data set size (default 103)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args(argv)


def run(args, drop_last: bool) -> dict:
    dataset = mxload.ArrayDataset(np.arange(args.num_samples, dtype=np.int64))
    loader = mxload.DataLoader(dataset, batch_size=args.batch_size, shuffle=True, seed=args.seed,
                               drop_last=drop_last, num_workers=args.num_workers, distributed=True)
    sampler = loader.sampler
    if (sampler.rank, sampler.num_replicas) != (dist.get_rank(), dist.get_world_size()):
        raise RuntimeError(f"sampler has rank {sampler.rank}/{sampler.num_replicas}, process group "
                           f"{dist.get_rank()}/{dist.get_world_size()}")
    epochs = []
    with loader:
        for epoch in range(args.epochs):
            loader.sampler.set_epoch(epoch)  # same value on every rank
            epochs.append([batch.tolist() for batch in loader])

    # Every rank must see the same number of batches per epoch.
    counts = torch.tensor([len(batches) for batches in epochs], dtype=torch.int64)
    gathered = [torch.zeros_like(counts) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, counts)
    batch_counts = [g.tolist() for g in gathered]
    if any(c != batch_counts[0] for c in batch_counts):
        raise RuntimeError(f"ranks disagree on batches per epoch (drop_last={drop_last}): {batch_counts}")
    return {"epochs": epochs, "batch_counts": batch_counts,
            "sampler": {"rank": sampler.rank, "num_replicas": sampler.num_replicas}}


def main(argv=None) -> int:
    args = parse_args(argv)
    dist.init_process_group("gloo")  # env:// rendezvous from torchrun's variables
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        runs = {f"drop_last={d}": run(args, d) for d in (False, True)}
        result = {"rank": rank, "world_size": world, "n": args.num_samples, "batch_size": args.batch_size,
                  "seed": args.seed, "runs": runs}
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"rank{rank}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(result, f)
        os.replace(path + ".tmp", path)  # a reader never sees half a file
        dist.barrier()
        if rank == 0:
            counts = {k: v["batch_counts"][0] for k, v in runs.items()}
            print(f"{world} ranks, n={args.num_samples}: batches per epoch {counts}; wrote {args.out}")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
