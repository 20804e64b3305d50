"""The last drop-in gaps with torch's DataLoader (issue 27): scenarios of
PyTorch's own DataLoader tests, each written here from the scenario's
intent, replayed against mxload.torch.DataLoader.  No postponed annotations:
DataLoader[...] in an annotation must work at run time, as with torch."""


import multiprocessing

import pytest

torch = pytest.importorskip("torch")
from torch.utils.data import Dataset, Sampler  # noqa: E402

import mxload  # noqa: E402
from mxload.torch import DataLoader  # noqa: E402

pytestmark = pytest.mark.timeout(120)


# ------------------------------------------------------------ datasets (module level: spawn pickles them)


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


# ------------------------------------------------------------------ 1. DataLoader[...] (Generic)


def test_dataloader_is_subscriptable_like_torchs_generic():
    alias = DataLoader[list]
    assert alias.__origin__ is DataLoader
    assert mxload.DataLoader[int].__origin__ is mxload.DataLoader

    def annotated() -> DataLoader[tuple]:   # evaluated at definition: no __future__ annotations here
        return DataLoader(Squares(), batch_size=2)
    assert annotated.__annotations__["return"].__origin__ is DataLoader
    assert [b.tolist() for b in annotated()][:2] == [[0, 1], [4, 9]]


# ------------------------------------------------------------------ 2. batch_size=None (bulk loading)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_bulk_loading_sampler_yields_index_lists(num_workers):
    sampler = ChunkSampler(23, 4)
    loader = DataLoader(RangeRows(23), batch_size=None, sampler=sampler, num_workers=num_workers)
    out = list(loader)
    assert len(out) == len(loader) == 6
    assert all(isinstance(t, torch.Tensor) for t in out)
    assert torch.cat(out).tolist() == [10 * i for i in range(23)]
    assert out[-1].tolist() == [200, 210, 220]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_bulk_loading_any_key_reaches_the_dataset_as_is(num_workers):
    keys = [3, [1, 2], slice(0, 3), (4, 5)]
    class Echo(Dataset):
        def __len__(self):
            return 10

        def __getitem__(self, key):
            return repr(key)

    loader = DataLoader(Echo(), batch_size=None, sampler=keys, num_workers=num_workers)
    assert list(loader) == [repr(k) for k in keys]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_bulk_loading_each_sample_through_collate_fn_and_default_convert(num_workers):
    out = list(DataLoader(Squares(6), batch_size=None, num_workers=num_workers))
    assert out == [0, 1, 4, 9, 16, 25]
    got = list(DataLoader(RangeRows(5), batch_size=None, num_workers=num_workers))
    assert all(isinstance(t, torch.Tensor) and t.shape == (1,) for t in got)
    assert [t.item() for t in got] == [0, 10, 20, 30, 40]
    calls = list(DataLoader(Squares(4), batch_size=None, num_workers=num_workers, collate_fn=str))
    assert calls == ["0", "1", "4", "9"]


# ------------------------------------------------------------------ 3. multiprocessing_context=None


MAIN_ONLY = {"touched": False}   # set in the test's process; a spawned worker imports this module afresh


class SeesMainState(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return int(MAIN_ONLY["touched"])


@pytest.fixture
def global_start_method():
    """Sets multiprocessing's global start method for one test, then unsets it."""
    def set_method(method):
        multiprocessing.set_start_method(method, force=True)
    yield set_method
    multiprocessing.set_start_method(None, force=True)
    MAIN_ONLY["touched"] = False


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_no_multiprocessing_context_follows_set_start_method(global_start_method, method):
    MAIN_ONLY["touched"] = True
    global_start_method(method)
    loader = DataLoader(SeesMainState(), batch_size=2, num_workers=2)
    assert loader.multiprocessing_context is None
    with iter(loader) as it:
        started = it.engine.transport.start_method
        seen = sum((b.tolist() for b in it), [])
    assert started == method
    assert seen == ([0] * 4 if method == "spawn" else [1] * 4)


def test_no_set_start_method_keeps_the_platform_default():
    assert multiprocessing.get_start_method(allow_none=True) is None
    with iter(DataLoader(SeesMainState(), batch_size=2, num_workers=1)) as it:
        started = it.engine.transport.start_method
    assert started == "fork"
    assert multiprocessing.get_start_method(allow_none=True) is None   # asking did not fix it
