"""A typical PyTorch training script whose only mxload line is the import.

Swap the DataLoader import back to torch's (the commented line) and it runs
the same: tests/test_examples.py runs it both ways.  A tiny synthetic problem
(two Gaussian blobs), so it trains in seconds on a CPU:

    python examples/torch_train.py --epochs 3 --workers 2
"""
from __future__ import annotations

import argparse
import random

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, Subset

# from torch.utils.data import DataLoader
from mxload.torch import DataLoader


class Blobs(Dataset):
    """Two classes of 8-dimensional points around +1 and -1, made on the fly."""

    def __init__(self, n: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, 2, (n,), generator=g)
        self.points = torch.randn(n, 8, generator=g) + (self.labels[:, None] * 2 - 1)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        x = self.points[i]
        if torch.rand(()) < 0.5:            # augmentation from torch's (per-worker seeded) RNG
            x = x + 0.01 * torch.randn(8)
        return x, self.labels[i]


def seed_worker(worker_id):
    # PyTorch's reproducibility recipe: numpy and random from torch's worker seed.
    worker_seed = torch.initial_seed() % 2 ** 32
    np.random.seed(worker_seed)
    random.seed(worker_seed)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--samples", type=int, default=2048)
    args = parser.parse_args()

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    data = Blobs(args.samples)
    split = int(0.8 * len(data))
    train_set, val_set = Subset(data, range(split)), Subset(data, range(split, len(data)))
    g = torch.Generator()
    g.manual_seed(0)
    workers = args.workers
    train_loader = DataLoader(train_set, batch_size=64, shuffle=True, num_workers=workers,
                              pin_memory=device == "cuda", drop_last=True, worker_init_fn=seed_worker,
                              generator=g, persistent_workers=workers > 0,
                              prefetch_factor=2 if workers > 0 else None)
    val_loader = DataLoader(val_set, batch_size=256, num_workers=workers)

    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    print(f"{len(train_loader)} training batches per epoch, {len(val_loader)} validation batches")
    for epoch in range(args.epochs):
        model.train()
        total, count = 0.0, 0
        for inputs, targets in train_loader:
            inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(inputs), targets)
            loss.backward()
            optimizer.step()
            total += loss.item() * len(targets)
            count += len(targets)
        model.eval()
        correct = seen = 0
        with torch.no_grad():
            for inputs, targets in val_loader:
                predicted = model(inputs.to(device)).argmax(dim=1)
                correct += (predicted == targets.to(device)).sum().item()
                seen += len(targets)
        print(f"epoch {epoch}: loss {total / count:.4f}, validation accuracy {correct / seen:.3f}")


if __name__ == "__main__":
    main()
