"""The torch datasets of test_torch_seeding.py, in a module of their own: the test module imports
torch only when a test first uses it (NOTE [ torch last ] in conftest.py)."""
from __future__ import annotations

import random

import numpy as np
import torch
import torch.utils.data as tud

N = 22   # not a multiple of the batch size: a short last batch


class RandomAugment:
    """A torchvision-style random transform: a flip decided by torch's RNG
    (as RandomHorizontalFlip), noise from torch.randn, a scale from Python's
    ``random`` (as older torchvision and many user transforms) and an offset
    from numpy's global RNG (as imgaug-style code)."""

    def __call__(self, x):
        if torch.rand(1).item() < 0.5:
            x = x.flip(-1)
        x = x + 0.1 * torch.randn(x.shape)
        x = x * random.uniform(0.5, 1.5)
        return x + torch.from_numpy(np.random.rand(*x.shape).astype(np.float32))


class AugmentedImages(tud.Dataset):
    """Sample i: an augmented 3x4 "image", its label, and what the worker
    says of its seeding (torch's get_worker_info().seed, torch.initial_seed())."""

    def __init__(self, n=N):
        self.n = n
        self.transform = RandomAugment()

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        image = torch.arange(12, dtype=torch.float32).reshape(3, 4) + i
        info = tud.get_worker_info()
        seeding = torch.tensor([-1 if info is None else info.seed, torch.initial_seed()])
        return self.transform(image), i, seeding


class UnevenShards(tud.IterableDataset):
    """Worker k yields 2 + 3k augmented samples (its own shard), so the workers' streams end apart."""

    def __iter__(self):
        info = tud.get_worker_info()
        k = 0 if info is None else info.id
        for j in range(2 + 3 * k):
            yield RandomAugment()(torch.full((2,), float(100 * k + j)))


class WhoSeeded(tud.Dataset):
    """What a worker says of its seeding (mxload's get_worker_info: thread workers have it too)."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        import mxload
        info = mxload.get_worker_info()
        return torch.tensor([info.id, info.seed])
