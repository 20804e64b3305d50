"""mxload.torch.DataLoader is a torch.utils.data.DataLoader: isinstance holds, every attribute
torch's loader has reads as torch's does, its samplers are torch's own (so the shuffle order is
torch's for the same generator or global seed), and code that rebuilds a loader from its
attributes and ``__init__`` signature (Lightning's ``_update_dataloader``, accelerate's
``prepare_data_loader``) gets an mxload loader back that uses what it injected."""
from __future__ import annotations

import gc
import inspect
import json
import warnings

import fresh_python
import numpy as np
import pytest
from conftest import end_child, race_rounds, start_methods
from extras import deferred
from test_torch_tensors import _same

import mxload

torch = deferred("torch")
tdata = deferred("torch.utils.data")
mxtorch = deferred("mxload.torch")
cases = deferred("torch_identity_cases")
scenarios = deferred("torch_scenarios_cases")   # WorkerSized: worker k yields range(sizes[k])

pytestmark = [pytest.mark.torch, pytest.mark.timeout(60)]


# Arguments both loaders take, covering each way torch makes its samplers (made in the test).
CONSTRUCTIONS = {
    "default": lambda: dict(),
    "batched": lambda: dict(batch_size=4, drop_last=True),
    "shuffled": lambda: dict(batch_size=4, shuffle=True),
    "shuffled-generator": lambda: dict(batch_size=4, shuffle=True,
                                       generator=torch.Generator().manual_seed(3)),
    "unbatched": lambda: dict(batch_size=None),
    "unbatched-shuffled": lambda: dict(batch_size=None, shuffle=True),
    "batch_sampler": lambda: dict(batch_sampler=[[0, 1], [2, 3, 4]]),
    "sampler": lambda: dict(sampler=[5, 4, 3], batch_size=2),
    "workers": lambda: dict(batch_size=2, num_workers=2, persistent_workers=True, prefetch_factor=3,
                            worker_init_fn=cases.worker_init, multiprocessing_context="spawn", timeout=5,
                            pin_memory=True, in_order=False),
    "stream": lambda: dict(dataset=cases.Stream(), batch_size=3),
    "stream-unbatched": lambda: dict(dataset=cases.Stream(), batch_size=None),
}

# torch's DataLoader attributes and what "the same" means for each: equal, or the same type.
SAME_VALUE = ("dataset", "batch_size", "num_workers", "generator", "drop_last", "worker_init_fn",
              "prefetch_factor", "persistent_workers", "pin_memory", "pin_memory_device", "in_order",
              "_auto_collation", "_dataset_kind", "_iterator", "_IterableDataset_len_called", "collate_fn")
SAME_TYPE = ("sampler", "batch_sampler", "_index_sampler", "multiprocessing_context")


def _pair(kwargs):
    kwargs = dict(kwargs)
    dataset = kwargs.pop("dataset", None) or cases.Counting()
    return tdata.DataLoader(dataset, **kwargs), mxtorch.DataLoader(dataset, **kwargs)


@pytest.mark.parametrize("construction", CONSTRUCTIONS)
def test_is_a_torch_dataloader_and_reads_as_torchs(construction):
    theirs, ours = _pair(CONSTRUCTIONS[construction]())
    assert isinstance(ours, tdata.DataLoader)
    for name in SAME_VALUE:
        assert getattr(ours, name) == getattr(theirs, name), name
    # (timeout: mxload's default is 120 s, not torch's 0 = forever; given, it reads as given.)
    assert ours.timeout == CONSTRUCTIONS[construction]().get("timeout", 120)
    for name in SAME_TYPE:
        assert type(getattr(ours, name)) is type(getattr(theirs, name)), name
    if isinstance(theirs.sampler, tdata.RandomSampler):
        assert ours.sampler.generator is theirs.sampler.generator and ours.sampler.data_source is ours.dataset
    if isinstance(theirs.batch_sampler, tdata.BatchSampler):
        assert (ours.batch_sampler.batch_size, ours.batch_sampler.drop_last) == (
            theirs.batch_sampler.batch_size, theirs.batch_sampler.drop_last)
        assert ours.batch_sampler.sampler is ours.sampler
    # What a rebuild reads (Lightning: vars(loader)) holds torch's public attributes.
    public = {k for k in vars(theirs) if not k.startswith("_")}
    assert public <= set(vars(ours)), public - set(vars(ours))
    for name in public:
        assert type(vars(ours)[name]) is type(vars(theirs)[name]), name
    if not ours.num_workers:
        assert len(list(ours)) == len(list(theirs))


def test_frozen_attributes_are_torchs_and_initialized_flag_is_torchs():
    """torch's __setattr__ rules, and timm's MultiEpochsDataLoader way around them:
    ``_DataLoader__initialized = False`` lets batch_sampler/sampler be replaced."""
    loader = mxtorch.DataLoader(cases.Counting(), batch_size=2)
    for attr in ("batch_size", "sampler", "batch_sampler", "drop_last", "dataset", "persistent_workers"):
        with pytest.raises(ValueError, match=f"^{attr} attribute should not be set after DataLoader is "
                                             f"initialized"):
            setattr(loader, attr, None)
    loader.num_workers = 0   # torch allows the others
    loader._DataLoader__initialized = False
    replaced = tdata.BatchSampler(tdata.SequentialSampler(range(4)), 2, False)
    loader.batch_sampler = replaced
    loader.sampler = replaced.sampler
    loader._DataLoader__initialized = True
    with pytest.raises(ValueError, match="batch_sampler attribute should not be set"):
        loader.batch_sampler = None
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3]]


def test_setting_torchs_attributes_after_construction_takes_effect():
    """torch reads collate_fn, timeout, worker_init_fn ... at each iter(): set on the loader,
    they apply to the next epoch, and read back as set."""
    loader = mxtorch.DataLoader(cases.Counting(4), batch_size=2)
    loader.collate_fn = lambda samples: ("mine", samples)
    assert [b for b in loader] == [("mine", [0, 1]), ("mine", [2, 3])]
    loader.collate_fn = tdata.default_collate
    assert loader.collate_fn is tdata.default_collate
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3]]
    loader.timeout = 0
    assert loader.timeout == 0 and [b.tolist() for b in loader] == [[0, 1], [2, 3]]


# ------------------------------------------------------------------ torch's samplers, torch's order


def _epochs(loader, epochs=2):
    return [[b.tolist() for b in loader] for _ in range(epochs)]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("with_generator", [False, True])
def test_shuffle_order_is_torchs(with_generator, drop_last, num_workers):
    """The same generator (or global seed) gives torch's order, epoch after epoch, whatever the
    number of workers (torch's order does not depend on it), and leaves torch's RNGs where
    torch's loader leaves them."""
    results = []
    for make, workers in ((tdata.DataLoader, 0), (mxtorch.DataLoader, num_workers)):
        torch.manual_seed(11)
        generator = torch.Generator().manual_seed(5) if with_generator else None
        loader = make(cases.Counting(), batch_size=4, shuffle=True, drop_last=drop_last, generator=generator,
                      num_workers=workers)
        batches = _epochs(loader)
        after = (torch.randint(1 << 30, (2,)).tolist(),
                 None if generator is None else torch.randint(1 << 30, (2,), generator=generator).tolist())
        results.append((batches, after))
    assert results[0] == results[1]
    assert results[1][0][0] != results[1][0][1]   # reshuffled each epoch


def test_samplers_made_by_torch_classes_are_drawn_from_the_dataset_length():
    """torch's samplers read len(dataset) at each epoch: a dataset that grows is followed."""
    dataset = cases.Counting(4)
    loader = mxtorch.DataLoader(dataset, batch_size=3)
    assert [b.tolist() for b in loader] == [[0, 1, 2], [3]]
    dataset.n = 6
    assert len(loader) == 2 and [b.tolist() for b in loader] == [[0, 1, 2], [3, 4, 5]]


def test_numpy_face_keeps_its_own_samplers():
    loader = mxload.DataLoader(cases.Counting(), batch_size=4, shuffle=True, seed=1)
    assert isinstance(loader.sampler, mxload.sampler.RandomSampler)
    assert not isinstance(loader, tdata.DataLoader)
    again = mxload.DataLoader(cases.Counting(), batch_size=4, shuffle=True, seed=1)
    assert _epochs(loader) == _epochs(again)


def test_rollover_keeps_mxloads_batch_sampler():
    """last_batch="rollover" (mxload's) carries the incomplete batch into the next epoch:
    torch's BatchSampler cannot, so mxload's makes the batches."""
    loader = mxtorch.DataLoader(cases.Counting(5), batch_size=2, last_batch="rollover")
    assert _epochs(loader) == [[[0, 1], [2, 3]], [[4, 0], [1, 2], [3, 4]]]


def test_seed_opts_into_mxloads_order():
    """seed= (mxload's, not torch's): the order is mxload's, fixed by the seed whatever torch's RNG."""
    a = mxtorch.DataLoader(cases.Counting(), batch_size=4, shuffle=True, seed=9)
    torch.manual_seed(123)
    b = mxtorch.DataLoader(cases.Counting(), batch_size=4, shuffle=True, seed=9)
    assert _epochs(a) == _epochs(b)
    assert isinstance(a.sampler, mxload.sampler.RandomSampler)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("with_generator", [False, True])
def test_a_checkpoint_of_torchs_shuffle_resumes_its_order(with_generator, num_workers):
    """torch's RandomSampler has no state: the checkpoint records the state of the generator it
    draws from, so a fresh loader (its torch RNG elsewhere) resumes the same order, and the
    epochs after it are the checkpointed run's too."""
    def make(seed):
        torch.manual_seed(seed)
        generator = torch.Generator().manual_seed(seed) if with_generator else None
        return mxtorch.DataLoader(cases.Counting(), batch_size=4, shuffle=True, generator=generator,
                          num_workers=num_workers)

    loader = make(1)
    first = _epochs(loader, 1)[0]
    it = iter(loader)
    taken = [next(it).tolist() for _ in range(2)]
    state = json.loads(json.dumps(loader.state_dict()))
    rest = [b.tolist() for b in it] + _epochs(loader, 1)[0]
    resumed = make(99)
    resumed.load_state_dict(state)
    assert [b.tolist() for b in resumed] + _epochs(resumed, 1)[0] == rest
    assert taken + rest[:len(first) - 2] != first   # (a new order each epoch: the state mattered)


# ------------------------------------------------------------------ a trainer's rebuild


def _rebuild_with_sampler(loader, sampler):
    """What Lightning's ``_update_dataloader`` (and accelerate's ``prepare_data_loader``) does
    to inject a DistributedSampler: read the instance's attributes (``vars``), keep those its
    ``__init__`` takes whose value is not the parameter's default, replace the samplers, and
    call ``type(loader)(**kwargs)``."""
    attrs = {k: v for k, v in vars(loader).items() if not k.startswith("_")}
    attrs["multiprocessing_context"] = loader.multiprocessing_context   # a property: not in vars
    params = dict(inspect.signature(loader.__init__).parameters)
    variadic = any(p.kind is p.VAR_KEYWORD for p in params.values())
    if variadic:
        params.update(inspect.signature(tdata.DataLoader.__init__).parameters)
        params.pop("self", None)
    non_defaults = {name for name, p in params.items() if name in attrs and p.default is not attrs[name]}
    non_defaults.add("dataset")
    kwargs = {k: v for k, v in attrs.items() if k in non_defaults}
    if isinstance(kwargs["dataset"], tdata.IterableDataset):
        kwargs.update(sampler=None, batch_sampler=None)
    else:
        assert loader.batch_sampler is None or type(loader.batch_sampler) is tdata.BatchSampler
        kwargs.update(sampler=sampler, shuffle=False, batch_sampler=None)
    required = {p.name for p in params.values()
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
                and p.name not in kwargs}
    assert not required, f"the rebuild cannot find {required} among the loader's attributes"
    if not variadic:
        assert not set(kwargs) - params.keys(), set(kwargs) - params.keys()
    return type(loader)(**kwargs)


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_trainers_rebuild_injects_a_distributed_sampler(shuffle):
    dataset = cases.Counting()
    loader = mxtorch.DataLoader(dataset, batch_size=3, shuffle=shuffle, drop_last=True, num_workers=2,
                        thread_pool=True, max_worker_restarts=0, timeout=30, in_order=False,
                        collate_fn=None)
    injected = tdata.DistributedSampler(dataset, num_replicas=2, rank=1, shuffle=False)
    rebuilt = _rebuild_with_sampler(loader, injected)
    assert type(rebuilt) is mxtorch.DataLoader and rebuilt.sampler is injected
    assert type(rebuilt.batch_sampler) is tdata.BatchSampler and rebuilt.batch_sampler.sampler is injected
    # torch's arguments and mxload's own (thread_pool) came through.
    assert (rebuilt.batch_size, rebuilt.drop_last, rebuilt.num_workers, rebuilt.thread_pool, rebuilt.timeout,
            rebuilt.in_order) == (3, True, 2, True, 30, False)
    expected = list(injected)   # rank 1's half: 1, 3, 5, ...
    got = sorted(i for b in rebuilt for i in b.tolist())
    assert got == sorted(expected[:len(expected) // 3 * 3])


def test_a_rebuild_keeps_mxloads_own_arguments_and_a_custom_collate():
    def collate(samples):
        return [s * 10 for s in samples]
    loader = mxtorch.DataLoader(cases.Counting(6), batch_size=2, collate_fn=collate, last_batch="discard",
                                prefetch=3, num_workers=1, max_worker_restarts=2, start_method="spawn")
    rebuilt = _rebuild_with_sampler(loader, tdata.SequentialSampler(range(5)))
    assert rebuilt.collate_fn is collate and rebuilt.last_batch == "discard" and rebuilt.drop_last
    assert (rebuilt.prefetch, rebuilt.max_worker_restarts, rebuilt.start_method) == (3, 2, "spawn")


def test_a_rebuild_of_a_stream_loader():
    loader = mxtorch.DataLoader(cases.Stream(), batch_size=4)
    rebuilt = _rebuild_with_sampler(loader, None)
    assert type(rebuilt) is mxtorch.DataLoader
    assert [b.tolist() for b in rebuilt] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


# ------------------------------------------------------------------ an empty dataset, __getitems__'s keys


@pytest.mark.parametrize("seed", [None, 3])
def test_an_empty_dataset_shuffled_raises_as_torchs(seed):
    with pytest.raises(ValueError) as theirs:
        tdata.DataLoader(cases.Counting(0), shuffle=True)
    with pytest.raises(type(theirs.value)) as ours:
        mxtorch.DataLoader(cases.Counting(0), shuffle=True, seed=seed)
    assert str(ours.value) == str(theirs.value)
    assert list(mxtorch.DataLoader(cases.Counting(0))) == [] == list(tdata.DataLoader(cases.Counting(0)))


@pytest.mark.parametrize("mode", [dict(), dict(num_workers=2), dict(num_workers=2, thread_pool=True),
                                  dict(shuffle=True), dict(batch_sampler=[[3, 1], [2]])])
@pytest.mark.parametrize("face", ["torch", "numpy"])
def test_getitems_receives_a_list_of_python_ints_as_from_torch(mode, face):
    make = mxtorch.DataLoader if face == "torch" else mxload.DataLoader
    kwargs = dict(mode)
    if "batch_sampler" not in kwargs:
        kwargs["batch_size"] = 5
    batches = [list(np.asarray(b).tolist()) for b in make(cases.KeysSeen(), **kwargs)]
    assert sorted(i for b in batches for i in b) == (sorted([3, 1, 2]) if "batch_sampler" in kwargs
                                                      else list(range(12)))


# ------------------------------------------------------------------ timm's MultiEpochsDataLoader


def test_timm_multi_epochs_loader_replaces_its_batch_sampler():
    loader = cases.MultiEpochsDataLoader(cases.Counting(10), batch_size=4, iterate=False)
    assert isinstance(loader.batch_sampler, cases.RepeatSampler) and len(loader) == 3
    with pytest.raises(ValueError, match="batch_sampler attribute should not be set"):
        loader.batch_sampler = None


@pytest.mark.timeout(5)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_timm_multi_epochs_loader_yields_each_epoch_from_one_iterator(num_workers):
    loader = cases.MultiEpochsDataLoader(cases.Counting(10), batch_size=4, num_workers=num_workers)
    try:
        assert [[b.tolist() for b in loader] for _ in range(2)] == [
            [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]], [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]]
    finally:
        loader.iterator.close()
        loader.close()


# ------------------------------------------------------------------ torch's iterator internals code reads


@pytest.mark.parametrize("method", start_methods("fork", "spawn", "forkserver"))
def test_iterator_workers_are_torchs_process_handles(method):
    """``it._workers`` as torch's iterator holds them (torch's own tests and user code read it):
    each worker's pid (the one get_worker_info() runs in), is_alive(), join(), exitcode, kept
    once the workers ended; an iterator left early ends them too."""
    loader = mxtorch.DataLoader(cases.WorkerPids(), batch_size=2, num_workers=2,
                                multiprocessing_context=method)
    it = iter(loader)
    workers = it._workers
    assert len(workers) == 2 and all(w.is_alive() and w.exitcode is None for w in workers)
    data = torch.cat(list(it)).tolist()
    assert {tuple(d) for d in data} == {(wid, w.pid) for wid, w in enumerate(it._workers)}
    del it
    gc.collect()
    for w in workers:
        w.join(10)
        assert not w.is_alive() and w.exitcode is not None
        w.terminate()   # (torch's tests end theirs so: a no-op once ended)
    it = iter(loader)
    workers = it._workers
    next(it)
    del it
    for w in workers:
        w.join(10)
        assert not w.is_alive()
    assert iter(mxtorch.DataLoader(cases.WorkerPids(), batch_size=2))._workers == []


# Load as a test session makes it: processes that fork and reap a process carrying torch's
# memory again and again (kernel time: page tables copied and torn down), where busy loops
# alone leave a woken worker its turn at once.
_FORKING_HOG = """
import os
import torch
while True:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
"""


@pytest.mark.races
@pytest.mark.timeout(300)
def test_workers_of_an_epoch_that_ended_exit_0_on_a_loaded_machine():
    """torch's test_iterable_style_dataset ("workers exit gracefully"): once an epoch has ended
    (every worker's stream drained, 3 workers, one of them empty) and its iterator is dropped,
    every worker's exit code is 0.  The stop message reaches workers that are between tasks; a
    loaded machine may not run them within the 20 ms grace that a worker still inside a batch
    gets before SIGTERM (exit code -15 here before), so such workers are waited for longer (up to
    the terminate point, still within the shutdown's one deadline).  Tried race_rounds(20) times
    with 2 processes loading the machine as a test session does."""
    hogs = [fresh_python.start(_FORKING_HOG, prelude=False) for _ in range(2)]
    try:
        for round_ in range(race_rounds(20)):
            loader = mxtorch.DataLoader(scenarios.WorkerSized([0, 4, 20]), batch_size=None, num_workers=3,
                                        prefetch_factor=2 + round_ % 3)
            it = iter(loader)
            assert sorted(it) == sorted(list(range(4)) + list(range(20)))
            workers = it._workers
            del it, loader
            for w in workers:
                w.join(10)
            assert [w.exitcode for w in workers] == [0, 0, 0], f"round {round_}"
    finally:
        for hog in hogs:
            end_child(hog)


def test_an_unpicklable_worker_argument_warns_as_torch_then_raises():
    loader = mxtorch.DataLoader(cases.Counting(), batch_size=2, num_workers=2, worker_init_fn=lambda i: None,
                        multiprocessing_context="forkserver")
    with pytest.warns(UserWarning, match="^Got pickle error when attempting to start a worker Process"):
        with pytest.raises(TypeError, match="cannot be pickled"):
            iter(loader)


def test_an_iter_datapipe_takes_shuffle_as_torch():
    """torch's DataLoader takes shuffle= for an IterDataPipe (it switches the graph's shufflers);
    any other stream refuses it."""
    from torch.utils.data.datapipes.iter import IterableWrapper
    pipe = IterableWrapper(range(40)).shuffle()
    torch.manual_seed(0)
    shuffled = [i for b in mxtorch.DataLoader(pipe, batch_size=8, shuffle=True) for i in b.tolist()]
    assert sorted(shuffled) == list(range(40))
    assert [b.tolist() for b in mxtorch.DataLoader(pipe, batch_size=8, shuffle=False)][0] == list(range(8))
    with pytest.raises(ValueError, match="expected unspecified shuffle"):
        mxtorch.DataLoader(cases.Stream(), shuffle=True)


def _shuffled_pipe():
    """A shuffled, sharded IterDataPipe of 0..59."""
    from torch.utils.data.datapipes.iter import IterableWrapper
    return IterableWrapper(range(60)).shuffle(buffer_size=16).sharding_filter()


def _datapipe_epochs(loader_type, num_workers, persistent, context=None):
    """Three epochs of _shuffled_pipe under torch.manual_seed(7), and the next number torch's
    global RNG gives after them."""
    loader = loader_type(_shuffled_pipe(), batch_size=4, shuffle=True, num_workers=num_workers,
                         persistent_workers=persistent, multiprocessing_context=context)
    torch.manual_seed(7)
    epochs = [[b.tolist() for b in loader] for _ in range(3)]
    after = torch.rand(1).item()
    if hasattr(loader, "close"):   # mxload's persistent workers end now
        loader.close()
    return epochs, after


@pytest.mark.parametrize("num_workers,persistent,context", [
    (0, False, None), (1, False, None), (2, False, None), (2, True, None), (2, True, "spawn")])
def test_an_iter_datapipe_is_sharded_and_seeded_as_torch(num_workers, persistent, context):
    """torch's DataLoader shards a DataPipe's sharding_filter across its workers and seeds its
    shufflers with one seed per iter() drawn from torch's RNG before the base seed, persistent
    workers too: every worker shuffles alike and each takes its shard.  The same batches as
    torch's, epoch after epoch, and the same draws left to the program (before: with workers
    each worker yielded the whole stream; persistent workers never reseeded the shufflers)."""
    want = _datapipe_epochs(tdata.DataLoader, num_workers, persistent, context)
    got = _datapipe_epochs(mxtorch.DataLoader, num_workers, persistent, context)
    assert sorted(i for batch in got[0][0] for i in batch) == list(range(60))
    assert got == want


@pytest.mark.parametrize("shuffle", ["unspecified", True, False])
@pytest.mark.parametrize("shuffler", [True, False])
def test_an_iter_datapipe_is_shuffled_as_torch_whatever_shuffle_says(shuffle, shuffler):
    """shuffle= left out leaves a DataPipe's shufflers as they are (on: torch's default is None,
    not False), and shuffle=True on a graph without a shuffler shuffles nothing (torch's
    DataLoader drops the shuffler graph_settings adds): torch's batches either way (before:
    unspecified meant False, and the added shuffler shuffled)."""
    from torch.utils.data.datapipes.iter import IterableWrapper

    def epochs(loader_type):
        pipe = IterableWrapper(range(30))
        pipe = pipe.shuffle(buffer_size=10) if shuffler else pipe
        kwargs = {} if shuffle == "unspecified" else {"shuffle": shuffle}
        loader = loader_type(pipe.sharding_filter(), batch_size=4, **kwargs)
        torch.manual_seed(5)
        return [[b.tolist() for b in loader] for _ in range(2)], torch.rand(1).item()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # torch's "no Shuffler found" warning
        assert epochs(mxtorch.DataLoader) == epochs(tdata.DataLoader)


@pytest.mark.parametrize("num_workers,persistent", [(0, False), (2, False), (2, True)])
def test_a_shuffled_iter_datapipe_resumes_from_a_state_dict(num_workers, persistent):
    """A state_dict() taken mid-epoch of a shuffled IterDataPipe records the epoch's shared seed
    (drawn from torch's RNG at iter()): a fresh loader given it, whatever torch's RNG holds then,
    yields the batches the first had not yielded (before: its iter() drew another seed, and the
    replayed stream was shuffled otherwise)."""

    def loader():
        return mxtorch.DataLoader(_shuffled_pipe(), batch_size=4, num_workers=num_workers,
                                  persistent_workers=persistent)

    torch.manual_seed(7)
    with loader() as first:
        it = iter(first)
        [next(it) for _ in range(3)]
        state = json.loads(json.dumps(first.state_dict()))
        rest = [b.tolist() for b in it]
    torch.manual_seed(99)
    with loader() as resumed:
        resumed.load_state_dict(state)
        assert [b.tolist() for b in resumed] == rest


@pytest.mark.parametrize("num_workers", [1, 2])
def test_an_iter_datapipe_refuses_worker_threads(num_workers):
    """Worker threads (thread_pool=True) would share one DataPipe graph, which allows one
    iterator at a time and is sharded per worker: refused when the loader is made, naming
    thread_pool (before: the first epoch died on torch's "iterator has been invalidated")."""
    from torch.utils.data.datapipes.iter import IterableWrapper
    pipe = IterableWrapper(range(20)).shuffle().sharding_filter()
    with pytest.raises(ValueError, match="thread_pool"):
        mxtorch.DataLoader(pipe, batch_size=4, num_workers=num_workers, thread_pool=True)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_iter_datapipe_takes_rank_0s_shared_seed_under_torch_distributed(tmp_path, num_workers):
    """Under torch.distributed torch's DataLoader broadcasts rank 0's shared seed of an
    IterDataPipe (over a gloo group), so every rank shuffles alike and the ranks' shards
    partition the stream, however each rank seeded torch: two gloo ranks seeded otherwise get
    torch's batches, which cover the stream once (before: each rank kept its own seed, and the
    shards overlapped)."""
    body = f"""
    import torch, torch.distributed as dist, torch.multiprocessing as mp
    import torch.utils.data as tdata, mxload.torch as mxtorch
    from torch.utils.data.datapipes.iter import IterableWrapper

    def rank_main(rank, queue):
        dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=rank, world_size=2)
        got = []
        for loader_type in (tdata.DataLoader, mxtorch.DataLoader):
            torch.manual_seed(100 + rank)
            pipe = IterableWrapper(range(60)).shuffle(buffer_size=16).sharding_filter()
            loader = loader_type(pipe, batch_size=4, num_workers={num_workers})
            got.append(([[b.tolist() for b in loader] for _ in range(2)], torch.rand(1).item()))
        queue.put((rank, got))
        dist.destroy_process_group()

    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    ranks = [ctx.Process(target=rank_main, args=(r, queue)) for r in range(2)]
    for p in ranks:
        p.start()
    results = dict(queue.get(timeout=60) for _ in ranks)
    for p in ranks:
        p.join()
    for rank in range(2):
        want, got = results[rank]
        assert got == want, (rank, want, got)
    items = sorted(i for r in range(2) for batch in results[r][1][0][0] for i in batch)
    assert items == list(range(60)), items
    print("ok")
    """
    result = fresh_python.run(body, timeout=90)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stdout + result.stderr


@pytest.mark.parametrize("num_workers", [0, 1])
@pytest.mark.parametrize("batch_size", [2, None])
def test_batches_have_torchs_containers_tuples_collated_into_lists(batch_size, num_workers):
    """torch's default_collate and default_convert make a list of a tuple's fields (at every
    depth; a namedtuple stays one): mxload.torch gave tuples, so `batch[0] = batch[0].to(device)`
    raised TypeError where torch's loader let it run.  TensorDataset's gathered batches too."""
    for dataset in (cases.Containers(), tdata.TensorDataset(torch.arange(6.0), torch.arange(6))):
        want, got = (list(loader(dataset, batch_size=batch_size, num_workers=num_workers))
                     for loader in (tdata.DataLoader, mxtorch.DataLoader))
        assert len(got) == len(want)
        for k, (g, w) in enumerate(zip(got, want)):
            _same(g, w, f"batch {k}")
        got[0][0] = got[0][0] * 2   # torch's batches take an assignment
