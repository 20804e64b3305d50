"""A torch.utils.data user changes only the import: the scenarios of
PyTorch's own DataLoader test suite (test/test_dataloader.py), replayed
against mxload.DataLoader.  Each test names the torch scenario it mirrors.
The intentional divergences (numpy batches, not tensors) are asserted as such."""
from __future__ import annotations

import collections
import multiprocessing
import warnings

import numpy as np
import pytest
from conftest import start_methods
from extras import deferred

import mxload
from mxload._torch_compat import tensor_to_numpy

torch = deferred("torch")
tud = deferred("torch.utils.data")
cases = deferred("torch_dropin_cases")

pytestmark = [pytest.mark.torch, pytest.mark.timeout(120)]


def run(loader):
    return [np.asarray(b).tolist() for b in loader]


# ------------------------------------------------------ construction (test_invalid_ctor_args_combinations)


def _in_order():
    return tud.SequentialSampler(range(cases.N))


def _pairs():
    return tud.BatchSampler(_in_order(), 2, False)


# (The arguments are made in the test: torch's samplers need torch, imported at a test's first use.)
@pytest.mark.parametrize("make_kwargs,error,match", [
    (lambda: dict(num_workers=-1), ValueError, "num_workers"),
    (lambda: dict(timeout=-1), ValueError, "timeout"),
    (lambda: dict(num_workers=0, prefetch_factor=2), ValueError, "prefetch_factor.*num_workers > 0"),
    (lambda: dict(num_workers=2, prefetch_factor=-1), ValueError, "prefetch_factor"),
    # (prefetch with the prefetch_factor the loader reads back for it is one setting, as a rebuild
    # from a loader's attributes passes them: tests/test_torch_identity.py)
    (lambda: dict(num_workers=2, prefetch_factor=2, prefetch=3), ValueError, "prefetch.*not both"),
    (lambda: dict(persistent_workers=True), ValueError, "persistent_workers.*num_workers > 0"),
    (lambda: dict(multiprocessing_context="fork"), ValueError, "multiprocessing_context.*num_workers > 0"),
    (lambda: dict(start_method="spawn"), ValueError, "start_method.*num_workers > 0"),
    (lambda: dict(num_workers=1, multiprocessing_context="bogus"), ValueError, "multiprocessing_context"),
    (lambda: dict(num_workers=1, multiprocessing_context=3), TypeError, "multiprocessing_context"),
    (lambda: dict(batch_size=None, drop_last=True), ValueError, "batch_size=None.*drop_last"),
    (lambda: dict(batch_sampler=_pairs(), batch_size=3), ValueError, "batch_sampler.*batch_size"),
    (lambda: dict(batch_sampler=_pairs(), shuffle=True), ValueError, "batch_sampler.*shuffle"),
    (lambda: dict(batch_sampler=_pairs(), sampler=_in_order()), ValueError, "batch_sampler.*sampler"),
    (lambda: dict(batch_sampler=_pairs(), drop_last=True), ValueError, "batch_sampler.*drop_last"),
    (lambda: dict(sampler=_in_order(), shuffle=True), ValueError, "shuffle.*sampler"),
    (lambda: dict(seed=1, generator=torch.Generator()), ValueError, "seed or generator"),
    (lambda: dict(generator=7), TypeError, "torch.Generator"),
])
def test_invalid_ctor_args_combinations(make_kwargs, error, match):
    kwargs = make_kwargs()
    with pytest.raises(error, match=match):
        mxload.DataLoader(cases.CountingDataset(), **kwargs)


def test_invalid_ctor_args_iterable_dataset():
    with pytest.raises(ValueError, match="IterableDataset"):
        mxload.DataLoader(cases.ShardedTorchStream(), shuffle=True)
    with pytest.raises(ValueError, match="IterableDataset"):
        mxload.DataLoader(cases.ShardedTorchStream(), sampler=tud.SequentialSampler(range(3)))
    with pytest.raises(ValueError, match="IterableDataset"):
        mxload.DataLoader(cases.ShardedTorchStream(), batch_sampler=[[0, 1]])


def test_fifth_positional_batch_sampler_is_a_clear_error():
    # torch's 5th positional is batch_sampler; Gluon's (and mxload's) is last_batch.
    bs = tud.BatchSampler(tud.SequentialSampler(range(cases.N)), 4, False)
    with pytest.raises(TypeError, match="fifth positional argument is last_batch.*batch_sampler="):
        mxload.DataLoader(cases.CountingDataset(), 1, False, None, bs)
    # torch's 6th positional (num_workers) lands on batch_sampler: named, not misbound.
    with pytest.raises(TypeError, match="batch_sampler must be an iterable.*by keyword"):
        mxload.DataLoader(cases.CountingDataset(), 1, False, None, None, 2)


@pytest.mark.parametrize("method", start_methods("fork", "spawn"))
def test_every_torch_keyword_is_accepted(method):
    loader = mxload.DataLoader(
        cases.CountingDataset(), batch_size=4, shuffle=True, sampler=None, batch_sampler=None, num_workers=2,
        collate_fn=None, pin_memory=False, drop_last=True, timeout=0, worker_init_fn=None,
        multiprocessing_context=multiprocessing.get_context(method),
        generator=torch.Generator().manual_seed(0),
        prefetch_factor=3, persistent_workers=True, pin_memory_device="", in_order=False)
    with loader:
        assert loader.prefetch == 6 and loader.prefetch_factor == 3
        assert loader.start_method == method and loader.timeout is None
        batches = run(loader)
    assert sorted(sum(batches, [])) == list(range(cases.N))


def test_invalid_assign_after_init():
    loader = mxload.DataLoader(cases.CountingDataset(), batch_size=2)
    for attr in ("batch_size", "sampler", "batch_sampler", "drop_last", "dataset", "persistent_workers"):
        with pytest.raises(ValueError, match=f"{attr} attribute should not be set"):
            setattr(loader, attr, {})
    loader.num_workers = 0   # torch allows the others


def test_read_only_torch_attributes():
    g = torch.Generator().manual_seed(1)
    loader = mxload.DataLoader(cases.CountingDataset(), batch_size=2, drop_last=True, num_workers=1,
                               generator=g, multiprocessing_context="fork")
    assert loader.drop_last is True and loader.batch_size == 2
    assert loader.collate_fn is mxload.batchify.default_batchify
    assert loader.prefetch_factor == 2 and loader.pin_memory is False and loader.generator is g
    assert loader.multiprocessing_context == "fork" and loader.pin_memory_device == ""
    assert isinstance(loader.sampler, mxload.sampler.SequentialSampler)
    assert mxload.DataLoader(cases.CountingDataset()).batch_size == 1   # torch's default
    assert mxload.DataLoader(cases.CountingDataset(), batch_sampler=[[0, 1]]).batch_size is None


# ------------------------------------------------------------------ sequential / shuffle / batch_size=None


@pytest.mark.parametrize("num_workers", [0, 2])
def test_sequential_nonbatch(num_workers):
    # batch_size=None: no automatic batching, each sample passes through default_convert.
    loader = mxload.DataLoader(cases.CountingDataset(), batch_size=None, num_workers=num_workers)
    out = list(loader)
    assert out == list(range(cases.N)) and len(loader) == cases.N
    assert loader.collate_fn is mxload.batchify.default_convert


@pytest.mark.parametrize("num_workers", [0, 2])
def test_sequential_batch(num_workers):
    loader = mxload.DataLoader(cases.CountingDataset(), batch_size=3, num_workers=num_workers)
    assert run(loader) == [list(range(i, min(i + 3, cases.N))) for i in range(0, cases.N, 3)]
    loader = mxload.DataLoader(cases.CountingDataset(), batch_size=3, drop_last=True, num_workers=num_workers)
    assert len(run(loader)) == cases.N // 3 == len(loader)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_nonbatch_tensors_converted_and_collate_fn_gets_one_sample(num_workers):
    out = list(mxload.DataLoader(cases.TensorPairs(), batch_size=None, num_workers=num_workers))
    x, y = out[5]
    assert isinstance(x, np.ndarray) and x.tolist() == [15.0, 16.0, 17.0] and int(y) == 5
    seen = list(mxload.DataLoader(cases.TensorPairs(6), batch_size=None, collate_fn=type,
                                  num_workers=num_workers))
    assert seen == [tuple] * 6   # torch calls collate_fn with the sample itself


def test_nonbatch_iterable_dataset():
    assert list(mxload.DataLoader(cases.ShardedTorchStream(7), batch_size=None)) == list(range(7))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_shuffle_reproducibility(num_workers):
    def epoch(seed):
        g = torch.Generator().manual_seed(seed)
        return run(mxload.DataLoader(cases.CountingDataset(), batch_size=4, shuffle=True, generator=g,
                                     num_workers=num_workers))
    assert epoch(42) == epoch(42)
    assert epoch(42) != epoch(43)
    assert sorted(sum(epoch(42), [])) == list(range(cases.N))


def test_global_torch_seed_fixes_the_shuffle():
    # Without a generator torch draws from its global RNG: torch.manual_seed fixes the order.
    torch.manual_seed(0)
    a = run(mxload.DataLoader(cases.CountingDataset(), batch_size=4, shuffle=True))
    torch.manual_seed(0)
    b = run(mxload.DataLoader(cases.CountingDataset(), batch_size=4, shuffle=True))
    assert a == b


# ------------------------------------------------------------ torch datasets and samplers work unchanged


@pytest.mark.parametrize("num_workers", [0, 2])
def test_tensor_concat_subset_datasets(num_workers):
    td = tud.TensorDataset(torch.arange(10).reshape(5, 2), torch.arange(5) * 10)
    x, y = next(iter(mxload.DataLoader(td, batch_size=5, num_workers=num_workers)))
    assert x.tolist() == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]] and y.tolist() == [0, 10, 20, 30, 40]
    cat = tud.ConcatDataset([cases.CountingDataset(3), cases.CountingDataset(2)])
    assert run(mxload.DataLoader(cat, batch_size=5, num_workers=num_workers)) == [[0, 1, 2, 0, 1]]
    sub = tud.Subset(cases.CountingDataset(), [9, 3, 5])
    assert run(mxload.DataLoader(sub, batch_size=2, num_workers=num_workers)) == [[9, 3], [5]]
    stack = tud.StackDataset(a=cases.CountingDataset(5), b=td)
    batch = next(iter(mxload.DataLoader(stack, batch_size=4, num_workers=num_workers)))
    assert batch["a"].tolist() == [0, 1, 2, 3] and batch["b"][1].tolist() == [0, 10, 20, 30]


def test_chain_iterable_style_dataset():
    chain = tud.ChainDataset([cases.ShardedTorchStream(3), cases.ShardedTorchStream(2)])
    assert run(mxload.DataLoader(chain, batch_size=2)) == [[0, 1], [2, 0], [1]]


@pytest.mark.parametrize("num_workers", [0, 1, 2, 3])
def test_iterable_style_dataset_sharded_with_torch_get_worker_info(num_workers):
    # torch.utils.data.get_worker_info() inside mxload workers: every item exactly once.
    items = sum(run(mxload.DataLoader(cases.ShardedTorchStream(40), batch_size=3,
                                      num_workers=num_workers)), [])
    assert sorted(items) == list(range(40))


def test_torch_get_worker_info_and_worker_seeding():
    rows = np.concatenate(list(mxload.DataLoader(cases.WorkerInfoProbe(), batch_size=2, num_workers=2)))
    assert sorted(set(rows[:, 0].tolist())) == [0, 1]
    assert (rows[:, 1] == 2).all() and rows[:, 2].all()        # same seed as mxload's info
    assert (rows[:, 0] == rows[:, 3]).all() and rows[:, 4].all()  # torch's RNG seeded with it
    assert torch.utils.data.get_worker_info() is None          # the main process is untouched


def test_worker_seed_reproducibility_with_generator():
    def draws(seed):
        g = torch.Generator().manual_seed(seed)
        return np.concatenate(list(mxload.DataLoader(cases.Seeds(), batch_size=2, num_workers=2,
                                                     generator=g)))
    a, b, c = draws(3), draws(3), draws(4)
    np.testing.assert_array_equal(a, b)
    assert (a != c).any()
    # workers draw different torch streams
    assert len(set(a[:, 0].tolist())) == len(a)


def test_iterabledataset_len_warning():
    loader = mxload.DataLoader(cases.SizedStream(6), batch_size=2, num_workers=2)
    assert len(loader) == 3
    with pytest.warns(UserWarning, match="Length of IterableDataset .* reported to be 3 .* 4 batches"):
        batches = list(loader)
    assert len(batches) == 6   # unsharded: both workers yield everything, as in torch
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(mxload.DataLoader(cases.SizedStream(6), batch_size=2))   # no len() asked: no warning


@pytest.mark.parametrize("make_sampler", [
    lambda: tud.SubsetRandomSampler([1, 4, 9]),
    lambda: tud.WeightedRandomSampler([0.0, 1.0, 0.0, 1.0], 6, replacement=True),
    lambda: tud.RandomSampler(range(cases.N), generator=torch.Generator().manual_seed(0)),
], ids=["SubsetRandomSampler", "WeightedRandomSampler", "RandomSampler"])
def test_torch_samplers(make_sampler):
    sampler = make_sampler()
    for num_workers in (0, 2):
        items = sum(run(mxload.DataLoader(cases.CountingDataset(), batch_size=2, sampler=sampler,
                                          num_workers=num_workers)), [])
        assert len(items) == len(sampler)
        if isinstance(sampler, tud.SubsetRandomSampler):
            assert sorted(items) == [1, 4, 9]
        if isinstance(sampler, tud.WeightedRandomSampler):
            assert set(items) <= {1, 3}


def test_torch_batch_sampler():
    bs = tud.BatchSampler(tud.SequentialSampler(range(7)), 3, drop_last=False)
    loader = mxload.DataLoader(cases.CountingDataset(), batch_sampler=bs, num_workers=2)
    assert run(loader) == [[0, 1, 2], [3, 4, 5], [6]] and len(loader) == 3


# ------------------------------------------------------------------ contexts, persistent workers, in_order


@pytest.mark.parametrize("method", start_methods("fork", "spawn", "forkserver"))
@pytest.mark.parametrize("as_object", [False, True])
def test_multiprocessing_contexts(method, as_object):
    ctx = multiprocessing.get_context(method) if as_object else method
    loader = mxload.DataLoader(cases.TensorPairs(), batch_size=5, num_workers=2, multiprocessing_context=ctx)
    assert loader.start_method == method
    assert [y.tolist() for _, y in loader] == [list(range(i, i + 5)) for i in range(0, cases.N, 5)]


def test_persistent_workers_reshuffle_each_epoch():
    loader = mxload.DataLoader(cases.CountingDataset(), batch_size=5, shuffle=True, num_workers=2,
                               persistent_workers=True, generator=torch.Generator().manual_seed(0))
    with loader:
        first, second = run(loader), run(loader)
    assert first != second and sorted(sum(second, [])) == list(range(cases.N))


def test_out_of_order():
    loader = mxload.DataLoader(cases.CountingDataset(), batch_size=2, num_workers=2, in_order=False)
    assert sorted(sum(run(loader), [])) == list(range(cases.N))


# ------------------------------------------------------------------ collation (test_default_collate_*)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_default_collate_keeps_types(num_workers):
    (batch,) = list(mxload.DataLoader(cases.TypedSamples(), batch_size=4, num_workers=num_workers))
    assert type(batch["point"]) is cases.Point and batch["point"].x.tolist() == [0, 1, 2, 3]
    assert batch["point"].y.dtype == np.float64   # Python floats collate to float64, as in torch
    assert type(batch["ordered"]) is collections.OrderedDict and list(batch["ordered"]) == ["a", "b"]
    assert [a.tolist() for a in batch["ordered"]["b"]] == [[0, 1, 2, 3]] * 2
    assert batch["name"] == ["s0", "s1", "s2", "s3"]           # strings become lists
    assert type(batch["span"]) is list and [a.tolist() for a in batch["span"]] == [
        [0, 1, 2, 3], [1, 2, 3, 4], [2, 3, 4, 5]]               # range collates like a sequence
    assert isinstance(batch["t"], np.ndarray) and batch["t"].tolist() == [[i, i] for i in range(4)]


class MyList(list):
    pass


def test_default_collate_mapping_and_sequence_keep_type():
    dd = collections.defaultdict(int, a=1)
    out = mxload.batchify.default_batchify([dd, dd])
    assert type(out) is collections.defaultdict and out.default_factory is int
    out = mxload.batchify.default_batchify([MyList([1, 2]), MyList([3, 4])])
    assert type(out) is MyList and [a.tolist() for a in out] == [[1, 3], [2, 4]]

    class LocalList(list):   # cannot be named in a layout that crosses processes: a plain list
        pass

    assert type(mxload.batchify.default_batchify([LocalList([1]), LocalList([2])])) is list


def test_default_collate_tensors_zero_copy_and_with_grad():
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert tensor_to_numpy(t).__array_interface__["data"][0] == t.data_ptr()
    g = torch.ones(3, requires_grad=True)
    out = mxload.batchify.default_batchify([g, g * 2])   # torch.stack's own result, as default_collate's
    assert out.tolist() == [[1, 1, 1], [2, 2, 2]] and out.grad_fn is not None
    out = mxload.batchify.default_batchify([torch.ones(2, dtype=torch.bfloat16)] * 2)
    assert out.dtype == torch.bfloat16 and out.tolist() == [[1, 1], [1, 1]]


def test_default_collate_bad_sequence_type():
    with pytest.raises(ValueError, match="sample 1 is length 1, expected a tuple/list of length 2"):
        mxload.batchify.default_batchify([[1, 2], [3]])


def test_default_convert_keeps_types():
    conv = mxload.batchify.default_convert
    out = conv({"a": torch.ones(2), "p": cases.Point(torch.zeros(1), 3)})
    assert isinstance(out["a"], np.ndarray) and type(out["p"]) is cases.Point and out["p"].y == 3


# ------------------------------------------------------------------ errors (test_error, test_error_workers)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_error_raised_as_its_type(num_workers):
    it = iter(mxload.DataLoader(cases.FailingDataset(), batch_size=2, num_workers=num_workers))
    next(it)
    with pytest.raises(KeyError, match="bad sample 3"):
        next(it)


def _drain(it, exc_type):
    got, errors = [], []
    while True:
        try:
            got.append(np.asarray(next(it)).tolist())
        except StopIteration:
            return got, errors
        except exc_type as e:
            errors.append(str(e))
        assert len(errors) <= cases.N, "the iterator does not advance past failing batches"


@pytest.mark.parametrize("mode", ["in-process", "processes", "threads"])
@pytest.mark.parametrize("in_order", [True, False])
def test_error_then_keep_iterating_gets_every_other_batch(mode, in_order):
    # torch: an exception raised for one batch leaves the iterator usable; the
    # loop may catch it and take the remaining batches.
    kw = {"in-process": {}, "processes": {"num_workers": 2},
          "threads": {"num_workers": 2, "thread_pool": True}}
    loader = mxload.DataLoader(cases.FailingDataset(), batch_size=2, in_order=in_order, **kw[mode])
    got, errors = _drain(iter(loader), KeyError)
    assert len(errors) == 3 and all("bad sample" in e for e in errors)
    good = [i for i in range(cases.N) if i // 2 not in (3 // 2, 7 // 2, 13 // 2)]
    assert sorted(sum(got, [])) == good
    if in_order:
        assert sum(got, []) == good
    # The next epoch is whole again up to its failures.
    assert len(_drain(iter(loader), KeyError)[0]) == 7


@pytest.mark.parametrize("as_tensors", [False, True])
def test_a_loop_left_by_an_error_ends_its_workers_while_the_error_is_kept(as_tensors):
    # The error's traceback must not keep the epoch (and its workers) alive.
    from mxload.torch import DataLoader as TorchFacing
    cls = TorchFacing if as_tensors else mxload.DataLoader
    loader = cls(cases.FailingDataset(), batch_size=2, num_workers=2)
    with pytest.raises(KeyError) as info:
        for _ in loader:
            pass
    assert "bad sample 3" in str(info.value)
    assert loader._iterations.newest() is None


def test_error_counts_as_a_taken_batch_in_checkpoints():
    loader = mxload.DataLoader(cases.FailingDataset(), batch_size=2, num_workers=2)
    it = iter(loader)
    next(it)
    with pytest.raises(KeyError):
        next(it)
    state = loader.state_dict()
    assert state["done"]["prefix"] == 2
    del it
    resumed = mxload.DataLoader(cases.FailingDataset(), batch_size=2, num_workers=2)
    resumed.load_state_dict(state)
    assert _drain(iter(resumed), KeyError)[0][0] == [4, 5]


def test_pin_memory_without_accelerator_warns_once_as_torch_and_continues():
    if torch.cuda.is_available():
        pytest.skip("an accelerator exists: tests/test_pin_memory.py covers pinning")
    loader = mxload.DataLoader(cases.CountingDataset(), batch_size=5, pin_memory=True)
    with pytest.warns(UserWarning) as record:
        assert run(loader) == run(loader)
    texts = [str(w.message) for w in record]
    assert texts == ["'pin_memory' argument is set as true but no accelerator is found, "
                     "then device pinned memory won't be used."]


def test_more_workers_than_cores_warns():
    from mxload._cpus import usable_cores
    many = usable_cores() + 7   # a count no other test uses (the warning comes once per count)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        mxload.DataLoader(cases.CountingDataset(), batch_size=2, num_workers=many)
        mxload.DataLoader(cases.CountingDataset(), batch_size=2, num_workers=usable_cores())
    assert [str(w.message).split(",")[0] for w in record] == [
        f"This DataLoader will create {many} worker processes in total"]
