"""Determinism independent of parallelism, and checkpoint/resume mid-epoch."""
from __future__ import annotations

import functools
import json
import os
import signal

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mxload

pytestmark = pytest.mark.timeout(180)


class AugmentedDataset(mxload.Dataset):
    """Random augmentation drawn from mxload.sample_rng()."""

    def __init__(self, n: int = 37):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        rng = mxload.sample_rng()
        noise = rng.standard_normal(3).astype(np.float32)
        flip = rng.random() < 0.5   # a second draw continues the same stream
        return np.float32(i) + noise, np.int64(i), flip


class Counter(mxload.IterableDataset):
    """A stream with a state_dict hook (its offset), sharded across workers."""

    def __init__(self, n: int = 30):
        self.n = n
        self.offset = 0

    def __iter__(self):
        info = mxload.get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(start, self.n, step):
            yield np.int64(i + self.offset)

    def state_dict(self):
        return {"offset": self.offset}

    def load_state_dict(self, state):
        self.offset = state["offset"]


def flat(batches):
    return [tuple(np.asarray(x).tobytes() for x in b) if isinstance(b, tuple) else np.asarray(b).tobytes()
            for b in batches]


def run(**kw):
    loader = mxload.DataLoader(AugmentedDataset(), batch_size=4, shuffle=True, seed=5, **kw)
    return flat(loader)


REFERENCE_MODES = [
    dict(num_workers=1), dict(num_workers=2), dict(num_workers=4),
    dict(num_workers=2, thread_pool=True), dict(num_workers=3, thread_pool=True),
    *(pytest.param(dict(num_workers=2, start_method=m), marks=pytest.mark.slow)
      for m in ("spawn", "forkserver")),
]


@pytest.mark.parametrize("mode", REFERENCE_MODES, ids=lambda m: "-".join(f"{k}={v}" for k, v in m.items()))
def test_stream_is_bit_identical_for_any_parallelism(mode):
    assert run(**mode) == run(num_workers=0)


class GlobalRngAugmented(mxload.Dataset):
    """Augmentation drawn from the global RNGs (numpy's and Python's), as most existing code draws it."""

    def __len__(self) -> int:
        return 21

    def __getitem__(self, i: int):
        import random
        return np.float32(i) + np.random.rand(3).astype(np.float32), np.float64(random.random())


def per_sample_run(**kw):
    loader = mxload.DataLoader(GlobalRngAugmented(), batch_size=4, shuffle=True, seed=8, seeding="per_sample",
                               **kw)
    return [flat(loader) for _ in range(2)]


@pytest.mark.parametrize("mode", [dict(num_workers=1), dict(num_workers=2), dict(num_workers=3),
                                  dict(num_workers=2, persistent_workers=True)],
                         ids=lambda m: "-".join(f"{k}={v}" for k, v in m.items()))
def test_per_sample_seeding_makes_the_global_rngs_the_same_for_any_num_workers(mode):
    import random
    np.random.seed(1)
    random.seed(1)
    in_process = per_sample_run(num_workers=0)
    # The training process's RNGs are its own again after each in-process batch.
    assert np.random.rand() == np.random.RandomState(1).rand()
    assert random.random() == random.Random(1).random()
    assert per_sample_run(**mode) == in_process
    assert in_process[0] != in_process[1]   # each epoch draws anew


class KeyedDraw(mxload.Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, key):
        return np.float64(np.random.rand())


def test_per_sample_seeding_with_batch_size_none_seeds_from_any_key():
    """batch_size=None: the sampler's keys (a tuple, a string, a negative index) seed the draws."""
    def draws(**kw):
        keys = [(0, 1), "a", -1, 2]
        return [float(x) for x in mxload.DataLoader(KeyedDraw(), batch_size=None, sampler=keys,
                                                    seeding="per_sample", seed=1, **kw)]
    in_process = draws()
    assert draws(num_workers=2) == in_process and len(set(in_process)) == 4


def test_seeding_is_checked():
    with pytest.raises(ValueError, match="seeding must be one of 'torch', 'per_worker', 'per_sample', "
                                         "got 'sample'"):
        mxload.DataLoader(GlobalRngAugmented(), seeding="sample")
    with pytest.raises(ValueError, match="worker threads .* share them"):
        mxload.DataLoader(GlobalRngAugmented(), num_workers=2, thread_pool=True, seeding="per_sample")
    with pytest.raises(ValueError, match="an IterableDataset's samples have none"):
        mxload.DataLoader(Counter(), seeding="per_sample")


def test_different_seed_or_epoch_changes_the_augmentation():
    loader = mxload.DataLoader(AugmentedDataset(), batch_size=4, seed=5)
    first, second = flat(loader), flat(loader)
    assert first != second   # epoch 1 draws other numbers
    assert flat(mxload.DataLoader(AugmentedDataset(), batch_size=4, seed=6)) != first


def test_sample_rng_outside_a_loader_is_an_error():
    with pytest.raises(RuntimeError, match="only valid while a DataLoader loads a sample"):
        mxload.sample_rng()


def test_sample_rng_in_getitems_needs_the_index():
    class Batched(mxload.Dataset):
        def __len__(self):
            return 8

        def __getitems__(self, idx):
            return [mxload.sample_rng(i).integers(0, 1 << 30) for i in idx]

    class Single(mxload.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return mxload.sample_rng().integers(0, 1 << 30)

    assert flat(mxload.DataLoader(Batched(), batch_size=4, seed=2)) == \
        flat(mxload.DataLoader(Single(), batch_size=4, seed=2))

    class Wrong(Batched):
        def __getitems__(self, idx):
            return [mxload.sample_rng().random() for _ in idx]

    with pytest.raises(RuntimeError, match="sample_rng\\(index\\)"):
        list(mxload.DataLoader(Wrong(), batch_size=4))


def test_lazy_transform_over_getitems_gets_per_sample_streams():
    base = mxload.ArrayDataset(np.arange(12, dtype=np.float64))
    ds = base.transform(lambda x: x + mxload.sample_rng().random())
    plain = mxload.SimpleDataset(list(np.arange(12, dtype=np.float64))).transform(
        lambda x: x + mxload.sample_rng().random())
    assert (flat(mxload.DataLoader(ds, batch_size=4, seed=1))
            == flat(mxload.DataLoader(plain, batch_size=4, seed=1)))


# ---------------------------------------------------------------- checkpoint / resume


def _loader(n=37, **kw):
    kw.setdefault("batch_size", 4)
    return mxload.DataLoader(AugmentedDataset(n), shuffle=True, **kw)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("last_batch", ["keep", "discard", "rollover"])
def test_resume_mid_epoch_continues_exactly(num_workers, last_batch):
    full = _loader(seed=9, last_batch=last_batch, num_workers=num_workers)
    epochs = [flat(full) for _ in range(3)]
    expected = epochs[1][5:] + epochs[2]

    first = _loader(seed=9, last_batch=last_batch, num_workers=num_workers)
    flat(first)                       # epoch 0 done
    it = iter(first)
    for _ in range(5):
        next(it)
    state = json.loads(json.dumps(first.state_dict()))   # JSON round trip
    del it
    assert len(json.dumps(state)) < 1000, "the state holds no sample data"

    fresh = _loader(seed=None, last_batch=last_batch, num_workers=num_workers)  # another seed: restored
    fresh.load_state_dict(state)
    assert flat(fresh) + flat(fresh) == expected


def test_state_between_epochs_and_after_break():
    loader = _loader(seed=3)
    reference = _loader(seed=3)
    ref_epochs = [flat(reference) for _ in range(2)]
    for i, _ in enumerate(loader):
        if i == 2:
            break
    resumed = _loader(seed=3)
    resumed.load_state_dict(loader.state_dict())
    assert flat(resumed) == ref_epochs[0][3:]
    end_state = resumed.state_dict()      # epoch finished: the state points at the next epoch
    again = _loader(seed=3)
    again.load_state_dict(end_state)
    assert flat(again) == ref_epochs[1]


def test_resume_out_of_order_skips_exactly_the_taken_batches():
    loader = _loader(seed=4, num_workers=2, in_order=False)
    it = iter(loader)
    taken = [next(it) for _ in range(4)]
    state = loader.state_dict()
    del it
    rest = _loader(seed=4, num_workers=2, in_order=False)
    rest.load_state_dict(state)
    got = sorted(flat(taken) + flat(rest))
    assert got == sorted(flat(_loader(seed=4)))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_iterable_dataset_resume_uses_the_dataset_hook(num_workers):
    ds = Counter()
    ds.offset = 100
    loader = mxload.DataLoader(ds, batch_size=4, num_workers=num_workers)
    full = [b.tolist() for b in loader]
    it = iter(loader)
    head = [next(it).tolist() for _ in range(3)]
    state = loader.state_dict()
    del it
    assert state["dataset"] == {"offset": 100}
    other = Counter()
    resumed = mxload.DataLoader(other, batch_size=4, num_workers=num_workers)
    resumed.load_state_dict(state)
    assert other.offset == 100
    assert head + [b.tolist() for b in resumed] == full


def test_resume_after_a_worker_restart(tmp_path):
    from datasets_for_tests import DyingDataset
    marker = str(tmp_path / "died")
    loader = mxload.DataLoader(DyingDataset(at=6, how="kill", n=40, only_once_file=marker), batch_size=2,
                               num_workers=2, max_worker_restarts=1)
    it = iter(loader)
    with pytest.warns(RuntimeWarning, match="restarting"):
        head = [next(it).ravel().tolist() for _ in range(8)]
    state = loader.state_dict()
    del it
    resumed = mxload.DataLoader(DyingDataset(n=40, at=-1), batch_size=2, num_workers=2)
    resumed.load_state_dict(state)
    assert head + [b.ravel().tolist() for b in resumed] == [[i, i + 1] for i in range(0, 40, 2)]


@pytest.mark.parametrize("bad,match", [
    ("nope", "must be a dict"),
    ({"version": 99}, "unsupported loader state version"),
    ({"version": 1, "seed": 1}, "lacks"),
    ({"version": 1, "seed": 1, "epoch": 0, "sampler": None, "done": {"prefix": "x"}}, "done.prefix"),
])
def test_bad_state_is_a_clear_error(bad, match):
    with pytest.raises((TypeError, ValueError), match=match):
        _loader(seed=1).load_state_dict(bad)


def _resume_equals_uninterrupted_run(n, batch_size, last_batch, num_workers, in_order, epoch, stop):
    def make():
        return mxload.DataLoader(AugmentedDataset(n), batch_size=batch_size, shuffle=True, seed=11,
                                 last_batch=last_batch, num_workers=num_workers, in_order=in_order)

    reference = make()
    ref = [flat(reference) for _ in range(epoch + 2)]
    expected = sorted(ref[epoch][min(stop, len(ref[epoch])):]) if not in_order else ref[epoch][stop:]

    loader = make()
    for _ in range(epoch):
        flat(loader)
    it = iter(loader)
    seen = []
    for _ in range(stop):
        try:
            seen.append(next(it))
        except StopIteration:
            break
    state = json.loads(json.dumps(loader.state_dict()))
    del it
    resumed = make()
    resumed.load_state_dict(state)
    rest = flat(resumed)
    if stop >= len(ref[epoch]):
        # The epoch had ended: the state points at the next one.
        assert rest == ref[epoch + 1] or sorted(rest) == sorted(ref[epoch + 1])
    elif in_order:
        assert flat(seen) == ref[epoch][:stop]
        assert rest == expected
    else:
        assert sorted(flat(seen) + rest) == sorted(ref[epoch])


_RESUMES = given(n=st.integers(1, 40), batch_size=st.integers(1, 9),
                 last_batch=st.sampled_from(["keep", "discard", "rollover"]),
                 num_workers=st.sampled_from([0, 0, 1, 2]), in_order=st.booleans(),
                 epoch=st.integers(0, 2), stop=st.integers(0, 12))
# 10 examples in the default tier (each runs up to 4 loaders' epochs, workers started for most),
# 60 more in the slow tier.
test_property_resume_equals_uninterrupted_run = settings(
    max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])(
    _RESUMES(_resume_equals_uninterrupted_run))
test_property_resume_equals_uninterrupted_run_many = pytest.mark.slow(settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])(
    _RESUMES(_resume_equals_uninterrupted_run)))


class _EpochFixedSampler:
    """torch's DistributedSampler's way: the order is a function of the
    epoch set with set_epoch(), which never advances by itself (no
    state_dict: the loader only sees its `epoch`)."""

    def __init__(self, n: int):
        self.n = n
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        return iter(np.random.default_rng([7, self.epoch]).permutation(self.n).tolist())

    def __len__(self) -> int:
        return self.n


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("sampler", ["mxload", "torch-like"])
def test_auto_reload_draws_each_epoch_after_set_epoch(sampler, num_workers):
    """auto_reload starts loading the next epoch when one ends; with the
    documented per-epoch ``sampler.set_epoch(e)`` before the loop, each
    epoch's order must be the one set_epoch(e) gives, as without
    auto_reload.  Before, the next epoch was drawn before set_epoch ran, so
    set_epoch took effect one epoch late (and a resumed run saw other
    orders than the original)."""
    from mxload.sampler import DistributedSampler

    def orders(auto_reload: bool) -> list[list[int]]:
        s = (DistributedSampler(24, num_replicas=1, rank=0, seed=3) if sampler == "mxload"
             else _EpochFixedSampler(24))
        loader = mxload.DataLoader(mxload.ArrayDataset(np.arange(24)), batch_size=4, sampler=s,
                                   num_workers=num_workers, auto_reload=auto_reload)
        try:
            got = []
            for epoch in (0, 1, 2, 5, 5):
                s.set_epoch(epoch)
                got.append(np.concatenate(list(loader)).tolist())
            return got
        finally:
            loader.close()

    plain = orders(False)
    assert len({tuple(o) for o in plain}) == 4   # set_epoch changed the order (5 twice: the same)
    assert orders(True) == plain


def _tampered(path: str, value):
    """A real mid-epoch state with the entry at `path` (keys joined by '.') set to `value`."""
    loader = _loader(seed=1)
    it = iter(loader)
    next(it)
    next(it)
    state = json.loads(json.dumps(loader.state_dict()))
    del it
    *parents, last = path.split(".")
    entry = state
    for key in parents:
        entry = entry[key]
    entry[last] = value
    return state


@pytest.mark.parametrize("path,value", [
    ("done.prefix", -1), ("done.prefix", 1.0), ("done.prefix", True), ("done.prefix", 10_000),
    ("done.extra", [-3]), ("done.extra", [1]), ("done.extra", [5, 5]), ("done.extra", ["7"]),
    ("done.extra", [10_000]), ("done.extra", 5),
    ("epoch", -1), ("epoch", "0"), ("epoch", 2.5), ("epoch", None),
    ("seed", -7), ("seed", "1"), ("seed", [1]),
    ("sampler", "x"), ("sampler.sampler.epoch", -2), ("sampler.sampler.seed", "s"),
    ("done", None),
])
def test_tampered_state_is_refused_naming_the_field(path, value):
    """load_state_dict() validates the whole state and names the field.
    Before, a negative position yielded the last batches twice, a negative
    epoch killed every worker while seeding ("worker died unexpectedly"),
    and wrong types failed later, somewhere else."""
    loader = _loader(seed=1)
    field = path.split(".")[-1] if path != "done" else "done"
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        loader.load_state_dict(_tampered(path, value))
    assert loader.load_state_dict(_tampered("done.prefix", 2)) is None   # a valid one still loads


class _HandlerRaised(Exception):
    """What a signal handler raises (a SIGTERM handler that checkpoints and exits, say)."""


@pytest.mark.torch
def test_a_checkpoint_taken_while_a_batch_never_reached_the_loop_does_not_count_it(monkeypatch):
    """A signal handler's exception between the epoch giving out a batch and the loop receiving
    it keeps the batch for the next call; a state_dict() taken meanwhile (in the except block)
    must not count it, or the resumed loader skips it.  (The handler's moment is simulated: it
    raises in the conversion to tensors, the last Python code before the loop.)"""
    pytest.importorskip("torch")
    import mxload.dataloader as dataloader_module
    from mxload.torch import DataLoader
    convert, calls = dataloader_module.to_tensors, []

    def interrupted_once(batch):
        calls.append(1)
        if len(calls) == 3:
            raise _HandlerRaised
        return convert(batch)

    monkeypatch.setattr(dataloader_module, "to_tensors", interrupted_once)
    for num_workers in (0, 2):
        calls.clear()
        loader = DataLoader(mxload.ArrayDataset(np.arange(20)), batch_size=2, num_workers=num_workers)
        it, received = iter(loader), []
        with pytest.raises(_HandlerRaised):
            while True:
                received.append(next(it).tolist())
        state = json.loads(json.dumps(loader.state_dict()))
        assert received == [[0, 1], [2, 3]] and state["done"] == {"prefix": 2, "extra": []}
        assert next(it).tolist() == [4, 5]              # kept for the loop
        assert loader.state_dict()["done"] == {"prefix": 3, "extra": []}
        loader.close()
        resumed = DataLoader(mxload.ArrayDataset(np.arange(20)), batch_size=2, num_workers=num_workers)
        resumed.load_state_dict(state)
        assert [b.tolist() for b in resumed][0] == [4, 5]


def test_a_checkpoint_after_the_last_batch_carries_rollover_leftovers_before_the_loop_asks_again():
    # The loop took the epoch's last batch and asked no more: the state is the next epoch's,
    # with this epoch's leftover samples carried into it.
    loader = _loader(n=7, batch_size=3, seed=4, last_batch="rollover")
    reference = _loader(n=7, batch_size=3, seed=4, last_batch="rollover")
    ref = [flat(reference) for _ in range(2)]
    it = iter(loader)
    assert flat([next(it), next(it)]) == ref[0]
    resumed = _loader(n=7, batch_size=3, seed=4, last_batch="rollover")
    resumed.load_state_dict(json.loads(json.dumps(loader.state_dict())))
    assert flat(resumed) == ref[1]


class _StatefulDataset(mxload.Dataset):
    def __init__(self):
        self.version = 1

    def __len__(self) -> int:
        return 20

    def __getitem__(self, i: int):
        return np.int64(i)

    def state_dict(self):
        return {"version": self.version}

    def load_state_dict(self, state):
        if type(state.get("version")) is not int:
            raise ValueError("dataset state field 'version' must be an int")
        self.version = state["version"]


def test_a_state_the_dataset_refuses_leaves_the_loader_and_its_live_epoch_unchanged():
    loader = mxload.DataLoader(_StatefulDataset(), batch_size=2, shuffle=True, seed=5, num_workers=2)
    list(loader)
    it = iter(loader)
    first = next(it)
    before = loader.state_dict()
    refused = dict(before, seed=77, epoch=9, sampler={"carry": [], "sampler": {"epoch": 0, "seed": 3}},
                   dataset={"version": "x"})
    with pytest.raises(ValueError, match="dataset state field 'version'"):
        loader.load_state_dict(refused)
    assert loader.state_dict() == before and (loader.seed, loader.epoch) == (5, 2)
    rest = list(it)
    assert len(rest) == 9
    reference = mxload.DataLoader(_StatefulDataset(), batch_size=2, shuffle=True, seed=5)
    list(reference)
    assert flat([first] + rest) == flat(reference)


@pytest.mark.parametrize("other,match", [
    ({"batch_size": 8}, "epoch of 10 batches; this loader makes 5"),
    ({"batch_size": 2}, "epoch of 10 batches; this loader makes 20"),
    ({"n": 12}, "dataset of 40 samples; this loader's has 12"),
    ({"last_batch": "discard", "n": 41}, "dataset of 40 samples; this loader's has 41"),
])
def test_a_state_from_a_loader_that_cuts_its_epoch_otherwise_is_refused_naming_the_difference(other, match):
    loader = _loader(n=40, batch_size=4, seed=1)
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = json.loads(json.dumps(loader.state_dict()))
    kw = {"n": 40, "batch_size": 4, "seed": 1, **other}
    mismatched = _loader(**kw)
    with pytest.raises(ValueError, match=match):
        mismatched.load_state_dict(state)
    assert flat(mismatched) == flat(_loader(**kw))   # unchanged: its own first epoch
    legacy = {k: v for k, v in state.items() if k not in ("batches", "samples")}   # written before them
    _loader(n=40, batch_size=4, seed=1).load_state_dict(legacy)


def test_the_loader_keeps_its_own_copy_of_a_loaded_state():
    loader = _loader(n=20, batch_size=2, seed=3)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    del it
    resumed = _loader(n=20, batch_size=2, seed=3)
    resumed.load_state_dict(state)
    state["done"]["prefix"] = -3      # the caller's dict, changed after it was checked
    handed = resumed.state_dict()
    handed["done"]["prefix"] = 7      # the copy state_dict() returned
    assert len(list(resumed)) == 9


def test_an_epoch_number_the_core_cannot_count_is_refused():
    state = _loader(seed=1).state_dict()
    with pytest.raises(ValueError, match="'epoch' must be an int >= 0 and < 2\\*\\*63"):
        _loader(seed=1).load_state_dict(dict(state, epoch=2**63))


class _SignalsItselfOnce(mxload.Dataset):
    """Loading sample `at` the first time sends this process SIGUSR1: its handler runs (and
    raises) in the middle of the dataset's code, as a timer's would."""

    def __init__(self, at: int):
        self.at, self.sent = at, False

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int):
        if i == self.at and not self.sent:
            self.sent = True
            os.kill(os.getpid(), signal.SIGUSR1)
        return np.int64(i)


def test_a_signal_handler_s_exception_while_loading_in_process_loses_no_batch():
    def handler(signum, frame):
        raise _HandlerRaised

    previous = signal.signal(signal.SIGUSR1, handler)
    try:
        loader = mxload.DataLoader(_SignalsItselfOnce(at=5), batch_size=2, num_workers=0)
        it, got, caught = iter(loader), [], 0
        while True:
            try:
                got.append(next(it).tolist())
            except _HandlerRaised:
                caught += 1
                assert loader.state_dict()["done"] == {"prefix": 2, "extra": []}
            except StopIteration:
                break
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert caught == 1 and got == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    # The dataset's own exception still uses its batch up, as torch's does.
    raising = mxload.DataLoader(mxload.ArrayDataset(np.arange(6)), batch_size=2, num_workers=0,
                                batchify_fn=lambda samples: 1 / 0 if 2 in samples else np.array(samples))
    it, got = iter(raising), []
    for _ in range(3):
        try:
            got.append(next(it).tolist())
        except ZeroDivisionError:
            got.append("failed")
    assert got == [[0, 1], "failed", [4, 5]]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_with_auto_reload_a_state_taken_after_set_epoch_is_the_epoch_the_loop_will_draw(num_workers):
    """auto_reload draws the next epoch as one ends; set_epoch(e) before the loop makes the
    next iter() draw it again.  A state taken in between is that redrawn epoch's."""
    def make():
        return _loader(n=37, batch_size=4, seed=5, num_workers=num_workers, auto_reload=True)

    loader, states, epochs = make(), [], []
    for e in range(3):
        loader.sampler.set_epoch(e * 10)
        states.append(json.loads(json.dumps(loader.state_dict())))
        epochs.append(flat(loader))
    loader.close()
    for state, expected in zip(states, epochs):
        resumed = make()
        resumed.load_state_dict(state)
        assert flat(resumed) == expected, state["sampler"]
        resumed.close()


class ResumableShards(mxload.IterableDataset):
    """As a Hugging Face IterableDataset: shards of uneven sizes split between the workers by
    get_worker_info() (so the workers' streams end at different batches), an order drawn from
    its epoch, and its own state_dict()/load_state_dict() (its epoch).  Each sample sleeps up
    to `jitter` s (drawn per process: the workers' pace differs from run to run)."""

    def __init__(self, shards: list[int], jitter: float = 0.0):
        self.shards = shards
        self.jitter = jitter
        self.epoch = 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = state["epoch"]

    def samples(self) -> list[int]:
        return list(range(sum(self.shards)))

    def stream(self, worker: int, workers: int) -> list[int]:
        """Worker `worker`'s samples, in order."""
        bounds = np.cumsum([0, *self.shards])
        order = np.random.default_rng(self.epoch).permutation(len(self.shards))
        return [i for shard in order[worker::workers] for i in range(bounds[shard], bounds[shard + 1])]

    def __iter__(self):
        import random
        import time
        info = mxload.get_worker_info()
        pace = random.Random()
        for i in self.stream(*((0, 1) if info is None else (info.id, info.num_workers))):
            if self.jitter:
                time.sleep(pace.random() * self.jitter)
            yield np.int64(i)


@pytest.mark.races
@pytest.mark.timeout(900)
def test_iterable_datasets_resumed_mid_epoch_at_random_points_yield_every_sample_once(seed):
    """A stream with its own state_dict, 2 workers, interrupted after a random number of batches
    (before the first, after the last, anywhere between; in a first epoch or a later one of
    persistent workers), its state through JSON, then resumed in a fresh loader or in the same
    one: every sample exactly once across both runs, in race_rounds(20) rounds.  The loaders'
    timeout is short, so a stall (once in 23 runs of a Hugging Face dataset's resume, both
    workers alive until the 120 s timeout) fails the round at once, naming it."""
    import random

    from conftest import race_rounds

    rng = random.Random(seed)
    for r in range(race_rounds(20)):
        shards = [rng.randint(0, 12) for _ in range(rng.randint(1, 6))]
        batch_size = rng.randint(1, 4)
        persistent = rng.random() < 0.5
        later_epoch = rng.random() < 0.3
        same_loader = rng.random() < 0.5
        jitter = rng.choice([0.0, 0.0005, 0.002])
        threads = rng.random() < 0.25
        what = (f"round {r}: shards {shards}, batch_size {batch_size}, persistent {persistent}, "
                f"later epoch {later_epoch}, same loader {same_loader}, jitter {jitter}, threads {threads}")

        loader_of = functools.partial(mxload.DataLoader, batch_size=batch_size, num_workers=2,
                                      persistent_workers=persistent, thread_pool=threads, timeout=10)
        ds = ResumableShards(shards, jitter)
        loader = first = loader_of(ds, prefetch=rng.randint(1, 6))
        try:
            if later_epoch:
                assert sorted(np.concatenate([b for b in loader] or [[]]).tolist()) == ds.samples(), what
            total = sum(-(-len(ds.stream(k, 2)) // batch_size) for k in range(2))
            stop = rng.randint(0, total)
            taken: list[int] = []
            it = iter(loader)
            for _ in range(stop):
                taken += next(it).tolist()
            state = json.loads(json.dumps(loader.state_dict()))
            if rng.random() < 0.5:
                del it   # or left to the load_state_dict below (which closes the loader's epochs)
            if not same_loader:
                if rng.random() < 0.5:
                    loader.close()   # or still loading while the resumed one starts and runs
                loader = loader_of(ResumableShards(shards, jitter), prefetch=rng.randint(1, 6))
            loader.load_state_dict(state)
            rest = [b.tolist() for b in loader]
        finally:
            loader.close()
            first.close()
        got = taken + [i for b in rest for i in b]
        assert sorted(got) == ds.samples(), f"{what}: stopped after {stop} of {total} batches; got {got}"



class UnevenStream(mxload.IterableDataset):
    """Worker k yields `counts[k]` samples, 100 * k + j, each after a random pause up to `jitter`."""

    def __init__(self, counts: list[int], jitter: float):
        self.counts = counts
        self.jitter = jitter

    def __iter__(self):
        import random
        import time
        k = mxload.get_worker_info().id
        pace = random.Random()
        for j in range(self.counts[k]):
            if self.jitter:
                time.sleep(pace.random() * self.jitter)
            yield np.int64(100 * k + j)


@pytest.mark.races
@pytest.mark.timeout(600)
def test_streams_that_end_apart_interleave_in_one_order_whenever_their_ends_are_learnt(seed):
    """Workers' streams of different lengths, random pauses, any window: the batches come
    round-robin over the workers, each worker's next batch in turn, skipping those whose stream
    ended (torch's order), in race_rounds(30) rounds.  Dispatching by `batch index % workers left`
    made the order depend on when an end was learnt (a worker twice in a row)."""
    import random

    from conftest import race_rounds

    rng = random.Random(seed)
    for r in range(race_rounds(30)):
        workers = rng.randint(2, 4)
        counts = [rng.randint(0, 9) for _ in range(workers)]
        batch_size, prefetch = rng.randint(1, 3), rng.randint(1, 8)
        jitter = rng.choice([0.0, 0.0005, 0.002])
        per_worker = [[list(range(100 * k + j, 100 * k + min(j + batch_size, n)))
                       for j in range(0, n, batch_size)] for k, n in enumerate(counts)]
        expected = [batches[i] for i in range(max(map(len, per_worker)))
                    for batches in per_worker if i < len(batches)]
        loader = mxload.DataLoader(UnevenStream(counts, jitter), batch_size=batch_size, num_workers=workers,
                                   prefetch=prefetch, timeout=20)
        got = [b.tolist() for b in loader]
        assert got == expected, (f"round {r}: counts {counts}, batch_size {batch_size}, prefetch {prefetch}, "
                                 f"jitter {jitter}")


class _TwoDraws(mxload.Dataset):
    """Each load of a sample draws twice from sample_rng(): the second draw continues the load's
    stream, and a second load of the same sample starts it afresh."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int):
        return np.array([mxload.sample_rng().random(), mxload.sample_rng().random()])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_sample_loaded_twice_starts_its_stream_afresh_each_time(num_workers):
    """A sampler that repeats an index (with replacement, or a batch sampler naming it twice) loads
    the sample twice: the same numbers both times, as two workers loading it once each draw."""
    loader = mxload.DataLoader(_TwoDraws(), batch_sampler=[[1, 1, 2], [1]], num_workers=num_workers, seed=5)
    first, second = list(loader)
    assert first[0][0] != first[0][1]                # two draws of one load continue its stream
    np.testing.assert_array_equal(first[0], first[1])   # the second load starts afresh
    np.testing.assert_array_equal(first[0], second[0])  # and in another batch (another worker)
    assert not np.array_equal(first[0], first[2])


def test_a_narrowed_sample_scope_leaves_the_enclosing_loads_streams_going_on():
    """Inside __getitems__, a transform narrowed to one sample (sample_scope, as lazy transforms
    over a batch fetch do) draws from that sample's stream; the batch's own streams then go on
    where they were, as if the narrowed draw had not happened."""
    from mxload import _rng

    def draws(narrow):
        _rng.set_sample(7, 0, None)   # a whole batch through __getitems__
        try:
            first = mxload.sample_rng(3).random()
            if narrow:
                with _rng.sample_scope(5):
                    mxload.sample_rng().random()
            return first, mxload.sample_rng(3).random()
        finally:
            _rng.clear_sample()

    assert draws(narrow=True) == draws(narrow=False)
