"""The torch datasets and samplers of test_torch_scenarios.py, at a module's top level (spawn
pickles them by reference) in a module of their own: the test module imports torch only when a
test first uses it (NOTE [ torch last ] in conftest.py)."""
from __future__ import annotations

import os
import signal
import time

import torch
from torch.utils.data import Dataset, IterableDataset, Sampler

import mxload


class Squares(Dataset):
    def __init__(self, n=12):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i * i


class RangeRows(Dataset):
    """Bulk loading: a key is a list of indices (or an int); one tensor per key."""

    def __init__(self, n=23):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, key):
        if isinstance(key, list):
            return torch.tensor(key) * 10
        if isinstance(key, slice):
            return torch.arange(self.n)[key] * 10
        return torch.tensor([key * 10])


class ChunkSampler(Sampler):
    """Yields lists of `size` consecutive indices (the last one shorter)."""

    def __init__(self, n, size):
        self.n, self.size = n, size

    def __len__(self):
        return -(-self.n // self.size)

    def __iter__(self):
        for start in range(0, self.n, self.size):
            yield list(range(start, min(start + self.size, self.n)))


MAIN_ONLY = {"touched": False}   # set in the test's process; a spawned worker imports this module afresh


class SeesMainState(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return int(MAIN_ONLY["touched"])


class Counting(Dataset):
    def __len__(self):
        return 20

    def __getitem__(self, i):
        return i


class CountingStream(IterableDataset):
    def __len__(self):
        return 20

    def __iter__(self):
        return iter(range(20))


class Growing(Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i >= self.n:
            raise IndexError(i)
        return i


class InfoProbe(Dataset):
    init_saw = None

    def __len__(self):
        return 8

    def __getitem__(self, i):
        info = torch.utils.data.get_worker_info()
        return torch.tensor([info.id, info.num_workers, info.seed % 2 ** 31, info.dataset is self,
                             torch.initial_seed() == info.seed, self.init_saw == (info.id, info.num_workers),
                             mxload.get_worker_info().seed == info.seed])


class WorkerSized(IterableDataset):
    """Worker k yields range(sizes[k]): some workers run out before others."""

    def __init__(self, sizes):
        self.sizes = sizes

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        assert info is not None and info.num_workers == len(self.sizes)
        return iter(range(self.sizes[info.id]))


STRAGGLE_S = 0.6


class SlowFirst(Dataset):
    """Sample 0 takes STRAGGLE_S; the others are instant."""

    def __len__(self):
        return 16

    def __getitem__(self, i):
        if i == 0:
            time.sleep(STRAGGLE_S)
        return i


class SlowFirstWorkerStream(IterableDataset):
    """Worker 0's stream starts with a slow item; worker 1's are instant."""

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        if info.id == 0:
            time.sleep(STRAGGLE_S)
            return iter([100])
        return iter(range(12))


class DiesAt(Dataset):
    def __init__(self, how):
        self.how = how

    def __len__(self):
        return 8

    def __getitem__(self, i):
        if i == 3:
            if self.how == "segfault":
                os.kill(os.getpid(), signal.SIGSEGV)
            os._exit(3)
        return i


class EmptySamples(Dataset):
    def __len__(self):
        return 6

    def __getitem__(self, i):
        return torch.empty(0)
