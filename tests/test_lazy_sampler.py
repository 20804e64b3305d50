"""Samplers are drawn lazily, as torch draws them: the first batch comes as soon as its indices
exist, an infinite sampler works (0 and 2 workers, persistent or not, checkpoints included),
a long sampler is not drawn whole before the first batch, and a sampler that raises mid-epoch
is an error naming it that leaves no worker."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

import mxload
from mxload.errors import EpochAbortedError

pytestmark = pytest.mark.timeout(60)

# (num_workers, thread_pool, persistent_workers)
MODES = [(0, False, False), (2, False, False), (2, False, True), (2, True, False), (2, True, True)]
MODE_IDS = ["0w", "2proc", "2proc-persistent", "2threads", "2threads-persistent"]


class Squares:
    """A map-style dataset whose sample i tells which index it was."""

    def __init__(self, n: int = 1000):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        return np.array([i, i * i % 1009], dtype=np.int64)


class Endless:
    """An infinite sampler, as iteration-based training writes them (detectron2's
    TrainingSampler, timm's _RepeatSampler): a seeded random stream of indices, no len()."""

    def __init__(self, n: int, seed: int = 0):
        self.n, self.seed = n, seed

    def __iter__(self):
        rng = np.random.default_rng(self.seed)
        while True:
            yield from rng.integers(0, self.n, 64).tolist()


class Counted:
    """A long finite sampler that counts the indices it has yielded."""

    def __init__(self, n: int):
        self.n = n
        self.yielded = 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        for i in range(self.n):
            self.yielded += 1
            yield i % 1000


class BreaksAt:
    """A sampler that raises after `good` indices."""

    def __init__(self, n: int, good: int):
        self.n, self.good = n, good

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        yield from range(self.good)
        raise ValueError("sampler index file is corrupt")


def _loader(sampler, mode, **kw):
    workers, threads, persistent = mode
    return mxload.DataLoader(Squares(), batch_size=4, sampler=sampler, num_workers=workers,
                             thread_pool=threads, persistent_workers=persistent, timeout=30, **kw)


def _firsts(it, n: int) -> list[list[int]]:
    return [b[:, 0].tolist() for b in itertools.islice(it, n)]


def _expected(sampler, n: int, skip: int = 0) -> list[list[int]]:
    flat = list(itertools.islice(iter(sampler), (skip + n) * 4))
    return [flat[i:i + 4] for i in range(skip * 4, (skip + n) * 4, 4)]


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_an_infinite_sampler_gives_batches(mode):
    sampler = Endless(1000)
    with _loader(sampler, mode) as loader:
        with pytest.raises(TypeError):
            len(loader)   # as torch: no length where the sampler has none
        for _ in range(2):   # persistent workers serve a second infinite epoch too
            it = iter(loader)
            assert _firsts(it, 25) == _expected(sampler, 25)
            with pytest.raises(TypeError):
                len(it)
            it.close()


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_an_infinite_sampler_resumes_from_a_checkpoint(mode):
    sampler = Endless(1000, seed=3)
    with _loader(sampler, mode) as loader:
        it = iter(loader)
        _firsts(it, 7)
        state = loader.state_dict()
        more = _firsts(it, 5)
    assert state["done"] == {"prefix": 7, "extra": []}
    with _loader(Endless(1000, seed=3), mode) as resumed:
        resumed.load_state_dict(state)
        got = _firsts(iter(resumed), 5)
    assert got == more == _expected(sampler, 5, skip=7)


@pytest.mark.parametrize("mode", MODES[:2], ids=MODE_IDS[:2])
@pytest.mark.parametrize("own", [True, False], ids=["BatchSampler", "batch_sampler"])
def test_a_long_sampler_is_not_drawn_before_the_first_batch(mode, own):
    sampler = Counted(10**7)
    if own:
        loader = _loader(sampler, mode)
    else:
        workers, threads, persistent = mode
        loader = mxload.DataLoader(Squares(), batch_sampler=mxload.sampler.BatchSampler(sampler, 4),
                                   num_workers=workers, thread_pool=threads, timeout=30)
    with loader:
        assert len(loader) == 10**7 // 4
        it = iter(loader)
        first = next(it)
        # The window (at most 2 batches a worker) and one batch drawn ahead: not the 10^7.
        assert sampler.yielded <= 4 * (2 * 2 + 2)
        assert first[:, 0].tolist() == [0, 1, 2, 3]
        it.close()


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_a_sampler_that_raises_mid_epoch_names_itself(mode):
    with _loader(BreaksAt(100, good=22), mode) as loader:
        it = iter(loader)
        got = _firsts(it, 5)   # 20 indices drawn fine
        assert got == [[i, i + 1, i + 2, i + 3] for i in range(0, 20, 4)]
        with pytest.raises(ValueError, match="corrupt") as raised:
            next(it)
        note = " ".join(getattr(raised.value, "__notes__", []))
        assert "BreaksAt" in note and "batch 5" in note and "epoch 0" in note, note
        with pytest.raises(EpochAbortedError, match="BreaksAt"):
            next(it)   # the epoch ended: never a normal-looking end
        engine = it.engine
        # Its workers ended with it; persistent ones stay (they hold nothing of the epoch).
        assert engine is None or engine.state == ("running" if mode[2] else "closed")
        # The loader goes on: a new epoch with a new iteration of the sampler.
        again = iter(loader)
        assert _firsts(again, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
        assert again.engine is (engine if mode[2] else again.engine)
        again.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_checkpoint_after_the_last_batch_of_a_lazy_epoch_is_the_next_epoch(workers):
    """The end of a lazily drawn epoch is known when its last batch is handed out: a state taken
    then (the loop asked no more) starts the next epoch, as with an epoch drawn whole."""
    loader = mxload.DataLoader(Squares(), batch_size=4, sampler=list(range(12)), num_workers=workers)
    it = iter(loader)
    assert len(_firsts(it, 3)) == 3
    state = loader.state_dict()
    assert state["epoch"] == 1 and state["done"] == {"prefix": 0, "extra": []}
    it.close()


def test_batch_size_none_draws_keys_lazily():
    sampler = Endless(1000, seed=5)
    loader = mxload.DataLoader(Squares(), batch_size=None, sampler=sampler)
    got = [int(b[0]) for b in itertools.islice(loader, 10)]
    assert got == list(itertools.islice(iter(sampler), 10))


def test_num_workers_auto_with_an_infinite_sampler():
    sampler = Endless(1000, seed=7)
    with mxload.DataLoader(Squares(), batch_size=4, sampler=sampler, num_workers="auto",
                           timeout=30) as loader:
        it = iter(loader)
        assert _firsts(it, 40) == _expected(sampler, 40)
        it.close()


@pytest.mark.torch
@pytest.mark.parametrize("workers", [0, 2])
def test_torch_dropin_takes_an_infinite_sampler_as_torch_does(workers):
    """mxload.torch.DataLoader with an infinite sampler (as iteration-based training passes one)
    gives torch's DataLoader's batches, and len() raises as torch's does."""
    torch = pytest.importorskip("torch")
    import mxload.torch as mt

    class Samples(torch.utils.data.Dataset):
        def __len__(self):
            return 1000

        def __getitem__(self, i):
            return torch.tensor([i, i * i % 1009])

    def batches(make):
        loader = make(Samples(), batch_size=4, sampler=Endless(1000, seed=11), num_workers=workers)
        with pytest.raises(TypeError):
            len(loader)
        it = iter(loader)
        out = [b[:, 0].tolist() for b in itertools.islice(it, 12)]
        del it
        return out
    assert batches(mt.DataLoader) == batches(torch.utils.data.DataLoader) == _expected(Endless(1000, 11), 12)


@pytest.mark.races
@pytest.mark.timeout(300)
def test_infinite_streams_resume_exactly_wherever_they_are_checkpointed(seed):
    """Checkpoints of an infinite sampler's epoch taken at random points (0 or 2 workers,
    processes or threads, persistent or not, the window at 1-4 batches a
    worker) and resumed in a fresh loader: the resumed loader's batches are exactly the next
    ones, every time."""
    import random
    rng = random.Random(seed)
    for _ in range(60):
        mode = rng.choice(MODES)
        sampler_seed, taken = rng.randrange(1000), rng.randrange(0, 30)
        extra = dict(prefetch_factor=rng.randint(1, 4)) if mode[0] else {}
        with _loader(Endless(1000, sampler_seed), mode, **extra) as loader:
            it = iter(loader)
            _firsts(it, taken)
            state = loader.state_dict()
        with _loader(Endless(1000, sampler_seed), mode, **extra) as resumed:
            resumed.load_state_dict(state)
            it = iter(resumed)
            assert _firsts(it, 6) == _expected(Endless(1000, sampler_seed), 6, skip=taken), (mode, taken)
            it.close()
