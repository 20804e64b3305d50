"""The torch classes of test_torch_identity.py (torch datasets, timm's loader subclass), in a module
of their own: the test module imports torch only when a test first uses it (NOTE [ torch last ]
in conftest.py)."""
from __future__ import annotations

import collections
import os

import torch
import torch.utils.data as tdata
from torch_dropin_cases import CountingDataset

from mxload.torch import DataLoader

N = 23

class Counting(CountingDataset):
    """Sample i is i (a torch-style map dataset), N of them by default."""

    def __init__(self, n=N):
        super().__init__(n)


class Stream(tdata.IterableDataset):
    def __iter__(self):
        return iter(range(10))


def worker_init(worker_id):
    pass


class KeysSeen(tdata.Dataset):
    """Records the type of what __getitems__ gets (as an SQLite dataset binding them would)."""

    def __len__(self):
        return 12

    def __getitem__(self, i):
        return i

    def __getitems__(self, keys):
        assert type(keys) is list and all(type(k) is int for k in keys), (type(keys), keys)
        return [k for k in keys]


class RepeatSampler:
    """timm's (timm/data/loader.py): repeats a sampler for ever."""

    def __init__(self, sampler):
        self.sampler = sampler

    def __iter__(self):
        while True:
            yield from iter(self.sampler)


class MultiEpochsDataLoader(DataLoader):
    """timm's MultiEpochsDataLoader (copied into many training repos), over mxload's loader: it
    replaces the batch sampler through torch's private initialized flag, keeps one iterator over
    the endless sampler and yields len(self) batches of it per epoch."""

    def __init__(self, *args, iterate=True, **kwargs):
        super().__init__(*args, **kwargs)
        self._DataLoader__initialized = False
        if self.batch_sampler is None:
            self.sampler = RepeatSampler(self.sampler)
        else:
            self.batch_sampler = RepeatSampler(self.batch_sampler)
        self._DataLoader__initialized = True
        if iterate:   # (timm always does; iterate=False: the attribute protocol alone)
            self.iterator = super().__iter__()

    def __len__(self):
        return len(self.sampler) if self.batch_sampler is None else len(self.batch_sampler.sampler)

    def __iter__(self):
        for _ in range(len(self)):
            yield next(self.iterator)


class WorkerPids(tdata.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        return torch.tensor([tdata.get_worker_info().id, os.getpid()])


Pair = collections.namedtuple("Pair", "x y")


class Containers(tdata.Dataset):
    """Samples nesting every container default_collate treats on its own: a tuple (collated into
    a list), a list, a namedtuple, a dict, a tuple of a tuple."""

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int):
        t = torch.full((2,), float(i))
        return (t, [i, t], Pair(t, i), {"a": (i, (t, 1.5)), "s": "x"})
