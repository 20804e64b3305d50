"""The torch datasets of test_torch_dropin.py, at a module's top level (spawn pickles them by
reference) in a module of their own: the test module imports torch only when a test first uses it
(NOTE [ torch last ] in conftest.py)."""
from __future__ import annotations

import collections

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset

import mxload

N = 20


class CountingDataset(Dataset):
    """torch.utils.data.Dataset subclass: sample i is i."""

    def __init__(self, n=N):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


class TensorPairs(Dataset):
    def __init__(self, n=N):
        self.x = torch.arange(n * 3, dtype=torch.float32).reshape(n, 3)
        self.y = torch.arange(n)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class ShardedTorchStream(IterableDataset):
    """torch.utils.data.IterableDataset sharded with *torch's* get_worker_info()."""

    def __init__(self, n=40):
        self.n = n

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        return iter(range(start, self.n, step))


class SizedStream(IterableDataset):
    """Reports a length but, unsharded, every worker yields all of it."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __iter__(self):
        return iter(range(self.n))


class FailingDataset(Dataset):
    """Raises in the samples of some batches (batch_size 2): 3, 7 and 13."""
    bad = (3, 7, 13)

    def __len__(self):
        return N

    def __getitem__(self, i):
        if i in self.bad:
            raise KeyError(f"bad sample {i}")
        return i


class WorkerInfoProbe(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        info = torch.utils.data.get_worker_info()
        mine = mxload.get_worker_info()
        return np.array([info.id, info.num_workers, info.seed == mine.seed, mine.id,
                         torch.initial_seed() == mine.seed])


class Seeds(Dataset):
    """Draws from the RNGs a torch user seeds: torch's, numpy's, random's."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        import random
        return np.array([torch.randint(0, 2 ** 30, ()).item(), np.random.randint(2 ** 30),
                         random.randrange(2 ** 30)])


Point = collections.namedtuple("Point", "x y")


class TypedSamples(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return {"point": Point(i, float(i)), "ordered": collections.OrderedDict(a=i, b=[i, i]),
                "name": f"s{i}", "span": range(i, i + 3), "t": torch.full((2,), i)}
