"""The last drop-in gaps with torch's DataLoader (issue 27): scenarios of
PyTorch's own DataLoader tests, each written here from the scenario's
intent, replayed against mxload.torch.DataLoader.  No postponed annotations:
DataLoader[...] in an annotation must work at run time, as with torch."""


import multiprocessing
import warnings

import fresh_python
import pytest
from extras import deferred

import mxload

torch = deferred("torch")
tud = deferred("torch.utils.data")
mxtorch = deferred("mxload.torch")
cases = deferred("torch_scenarios_cases")
dropin_cases = deferred("torch_dropin_cases")   # SizedStream: every worker yields all of it

pytestmark = [pytest.mark.torch, pytest.mark.timeout(120)]


# ------------------------------------------------------------------ 1. DataLoader[...] (Generic)


def test_dataloader_is_subscriptable_like_torchs_generic():
    alias = mxtorch.DataLoader[list]
    assert alias.__origin__ is mxtorch.DataLoader
    assert mxload.DataLoader[int].__origin__ is mxload.DataLoader

    def annotated() -> mxtorch.DataLoader[tuple]:   # evaluated at definition: no __future__ annotations here
        return mxtorch.DataLoader(cases.Squares(), batch_size=2)
    assert annotated.__annotations__["return"].__origin__ is mxtorch.DataLoader
    assert [b.tolist() for b in annotated()][:2] == [[0, 1], [4, 9]]


# ------------------------------------------------------------------ 2. batch_size=None (bulk loading)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_bulk_loading_sampler_yields_index_lists(num_workers):
    sampler = cases.ChunkSampler(23, 4)
    loader = mxtorch.DataLoader(cases.RangeRows(23), batch_size=None, sampler=sampler,
                                num_workers=num_workers)
    out = list(loader)
    assert len(out) == len(loader) == 6
    assert all(isinstance(t, torch.Tensor) for t in out)
    assert torch.cat(out).tolist() == [10 * i for i in range(23)]
    assert out[-1].tolist() == [200, 210, 220]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_bulk_loading_any_key_reaches_the_dataset_as_is(num_workers):
    keys = [3, [1, 2], slice(0, 3), (4, 5)]
    class Echo(tud.Dataset):
        def __len__(self):
            return 10

        def __getitem__(self, key):
            return repr(key)

    loader = mxtorch.DataLoader(Echo(), batch_size=None, sampler=keys, num_workers=num_workers)
    assert list(loader) == [repr(k) for k in keys]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_bulk_loading_each_sample_through_collate_fn_and_default_convert(num_workers):
    out = list(mxtorch.DataLoader(cases.Squares(6), batch_size=None, num_workers=num_workers))
    assert out == [0, 1, 4, 9, 16, 25]
    got = list(mxtorch.DataLoader(cases.RangeRows(5), batch_size=None, num_workers=num_workers))
    assert all(isinstance(t, torch.Tensor) and t.shape == (1,) for t in got)
    assert [t.item() for t in got] == [0, 10, 20, 30, 40]
    calls = list(mxtorch.DataLoader(cases.Squares(4), batch_size=None, num_workers=num_workers,
                                    collate_fn=str))
    assert calls == ["0", "1", "4", "9"]


# ------------------------------------------------------------------ 3. multiprocessing_context=None


@pytest.fixture
def global_start_method():
    """Sets multiprocessing's global start method for one test, then unsets it."""
    def set_method(method):
        multiprocessing.set_start_method(method, force=True)
    yield set_method
    multiprocessing.set_start_method(None, force=True)
    cases.MAIN_ONLY["touched"] = False


@pytest.mark.parametrize("method", [pytest.param("spawn", marks=pytest.mark.faults), "fork"])
def test_no_multiprocessing_context_follows_set_start_method(global_start_method, method):
    cases.MAIN_ONLY["touched"] = True
    global_start_method(method)
    loader = mxtorch.DataLoader(cases.SeesMainState(), batch_size=2, num_workers=2)
    assert loader.multiprocessing_context is None
    with iter(loader) as it:
        started = it.engine.transport.start_method
        seen = sum((b.tolist() for b in it), [])
    assert started == method
    assert seen == ([0] * 4 if method == "spawn" else [1] * 4)


def test_no_set_start_method_keeps_the_platform_default():
    assert multiprocessing.get_start_method(allow_none=True) is None
    with iter(mxtorch.DataLoader(cases.SeesMainState(), batch_size=2, num_workers=1)) as it:
        started = it.engine.transport.start_method
    assert started == "fork"
    assert multiprocessing.get_start_method(allow_none=True) is None   # asking did not fix it


# ------------------------------------------------------------------ 4. constructor errors as torch's


def _seq():
    return torch.utils.data.SequentialSampler(range(20))


def _batches():
    return torch.utils.data.BatchSampler(_seq(), 3, False)


BATCH_SAMPLER_EXCLUSIVE = r"batch_sampler option is mutually exclusive with"

# (dataset, arguments (made in the test: torch's samplers need torch), what the message says:
# the words torch's own message has, so a program or test matching torch's text matches mxload's)
CTOR_ERRORS = [
    ("Counting", lambda: dict(num_workers=-1), r"num_workers option should be non-negative"),
    ("Counting", lambda: dict(timeout=-1), r"timeout option should be non-negative"),
    ("Counting", lambda: dict(batch_size=None, drop_last=True),
     r"batch_size=None option disables auto-batching and is mutually exclusive"),
    ("Counting", lambda: dict(num_workers=0, multiprocessing_context="spawn"),
     r"multi-process loading \(num_workers > 0\), but got"),
    ("Counting", lambda: dict(num_workers=1, multiprocessing_context="bad"),
     r"should specify a valid start method in"),
    ("Counting", lambda: dict(num_workers=1, multiprocessing_context=object()),
     r"multiprocessing_context option should be a valid context "),
    ("Counting", lambda: dict(batch_size=11, sampler=_seq(), shuffle=True),
     r"sampler option is mutually exclusive with shuffle"),
    ("Counting", lambda: dict(batch_sampler=_batches(), sampler=_seq(), shuffle=True),
     r"sampler option is mutually exclusive with shuffle"),
    ("Counting", lambda: dict(batch_sampler=_batches(), sampler=_seq(), shuffle=3),
     r"sampler option is mutually exclusive with shuffle"),
    ("Counting", lambda: dict(batch_size=11, batch_sampler=_batches()), BATCH_SAMPLER_EXCLUSIVE),
    ("Counting", lambda: dict(shuffle=True, batch_sampler=_batches()), BATCH_SAMPLER_EXCLUSIVE),
    ("Counting", lambda: dict(drop_last=True, batch_sampler=_batches()), BATCH_SAMPLER_EXCLUSIVE),
    ("Counting", lambda: dict(drop_last=3, batch_sampler=_batches()), BATCH_SAMPLER_EXCLUSIVE),
    ("CountingStream", lambda: dict(shuffle=True),
     r"DataLoader with IterableDataset: expected unspecified shuffle"),
    ("CountingStream", lambda: dict(shuffle=3),
     r"DataLoader with IterableDataset: expected unspecified shuffle"),
    ("CountingStream", lambda: dict(sampler=_seq()),
     r"DataLoader with IterableDataset: expected unspecified sampler"),
    ("CountingStream", lambda: dict(sampler=3),
     r"DataLoader with IterableDataset: expected unspecified sampler"),
    ("CountingStream", lambda: dict(batch_sampler=_batches()),
     r"DataLoader with IterableDataset: expected unspecified batch_sampler"),
    ("CountingStream", lambda: dict(batch_sampler=3),
     r"DataLoader with IterableDataset: expected unspecified batch_sampler"),
    ("Counting", lambda: dict(num_workers=0, prefetch_factor=2),
     r"prefetch_factor option could only be specified in multiproc"),
    ("Counting", lambda: dict(num_workers=2, prefetch_factor=-1),
     r"prefetch_factor option should be non-negative"),
    ("Counting", lambda: dict(persistent_workers=True), r"persistent_workers option needs num_workers > 0"),
]


@pytest.mark.parametrize("dataset,make_kwargs,says", CTOR_ERRORS,
                         ids=[str(i) for i in range(len(CTOR_ERRORS))])
def test_constructor_errors_are_torchs(dataset, make_kwargs, says):
    make, kwargs = getattr(cases, dataset), make_kwargs()
    with pytest.raises(Exception) as theirs:
        torch.utils.data.DataLoader(make(), **kwargs)
    with pytest.raises(theirs.type, match=says):
        mxtorch.DataLoader(make(), **kwargs)


def test_excessive_worker_warning_fires_where_torchs_does(monkeypatch):
    import mxload._cpus
    monkeypatch.setattr(mxload._cpus, "usable_cores", lambda: 1)
    excessive = "excessive worker creation might get DataLoader running slow or even freeze"
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        loader = mxtorch.DataLoader(cases.Counting(), batch_size=10, num_workers=3)
        # each loader, as torch's (not once a process)
        mxtorch.DataLoader(cases.Counting(), batch_size=10, num_workers=3)
    assert [excessive in str(w.message) for w in record] == [True, True]
    loader.num_workers = 2
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert len(list(loader)) == 2   # iter() checks the workers it starts, as torch's does
    assert [excessive in str(w.message) for w in record] == [True]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        mxtorch.DataLoader(cases.Counting(), batch_size=10, num_workers=1)
        mxtorch.DataLoader(cases.Counting(), batch_size=10, num_workers=4, thread_pool=True)
    assert not record


# ---------------------------------------------------- 5. a stream longer than its len(); a growing dataset


def _next_warnings(it):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        next(it)
    return [str(w.message) for w in record if "Length of IterableDataset" in str(w.message)]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stream_longer_than_its_len_warns_past_the_length_and_goes_on(num_workers):
    loader = mxtorch.DataLoader(dropin_cases.SizedStream(20), num_workers=num_workers)
    with iter(loader) as it:   # len() not asked yet: no warning however many come
        assert all(not _next_warnings(it) for _ in range(20 * max(num_workers, 1)))
    assert len(loader) == 20
    with iter(loader) as it:
        assert all(not _next_warnings(it) for _ in range(20))
        if num_workers == 0:
            with pytest.raises(StopIteration):
                next(it)
            return
        for _ in range(3):   # as torch: each batch past the reported length says so
            (message,) = _next_warnings(it)
            assert "was reported to be 20" in message and "samples have been fetched" in message
            assert "For multiprocessing data-loading" in message
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rest = list(it)
    assert len(rest) == 20 * num_workers - 23   # and it goes on to the end of every worker's stream


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("shuffle", [False, True])
def test_len_and_epochs_follow_a_growing_dataset(num_workers, shuffle):
    ds = cases.Growing(6)
    loader = mxtorch.DataLoader(ds, batch_size=4, shuffle=shuffle, num_workers=num_workers)
    assert len(loader) == 2 and sorted(sum((b.tolist() for b in loader), [])) == list(range(6))
    ds.n = 11   # torch's default samplers read len(dataset) each time
    assert len(loader) == 3
    assert sorted(sum((b.tolist() for b in loader), [])) == list(range(11))
    ds.n = 3
    assert len(loader) == 1 and sorted(sum((b.tolist() for b in loader), [])) == [0, 1, 2]


def test_stream_len_is_read_again():
    ds = dropin_cases.SizedStream(5)
    loader = mxtorch.DataLoader(ds, batch_size=2)
    assert len(loader) == 3
    ds.n = 9
    assert len(loader) == 5 and len(list(loader)) == 5


# ------------------------------------------------ 6. torch's get_worker_info() in workers; partial workers


def _init_records_info(worker_id):
    info = torch.utils.data.get_worker_info()
    assert info is not None and info.id == worker_id, (info, worker_id)
    info.dataset.init_saw = (info.id, info.num_workers)


# A start of fresh interpreters (spawn, forkserver) takes seconds: the fault tier's.
SLOW_STARTS = [pytest.param(m, marks=pytest.mark.faults) for m in ("spawn", "forkserver")]


@pytest.mark.parametrize("method", ["fork", *SLOW_STARTS])
def test_torch_get_worker_info_in_every_start_method(method):
    loader = mxtorch.DataLoader(cases.InfoProbe(), batch_size=2, num_workers=2,
                                multiprocessing_context=method, worker_init_fn=_init_records_info)
    rows = torch.cat(list(loader)).tolist()
    assert sorted({r[0] for r in rows}) == [0, 1] and all(r[1] == 2 for r in rows)
    assert all(r[3:] == [1, 1, 1, 1] for r in rows), rows
    assert len({r[2] for r in rows}) == 2   # a seed of its own per worker
    assert torch.utils.data.get_worker_info() is None


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("batch_size", [None, 7])
def test_partial_workers_every_sample_once_and_the_next_epoch_clean(persistent, batch_size):
    sizes = [0, 4, 20]
    loader = mxtorch.DataLoader(cases.WorkerSized(sizes), batch_size=batch_size, num_workers=3,
                        persistent_workers=persistent, prefetch_factor=3)
    with loader:
        for _ in range(3):
            got = list(loader)
            if batch_size is None:
                assert sorted(got) == sorted(list(range(4)) + list(range(20)))
            else:
                assert sorted(tuple(b.tolist()) for b in got) == sorted(
                    [tuple(range(4)), tuple(range(7)), tuple(range(7, 14)), tuple(range(14, 20))])


# ---------------------------------------------------------------- 7. the seed is drawn at iter(), as torch's


def _training_script(loader_class, shuffle, num_workers, persistent, generator):
    """What a script sees of torch's global RNG around its loader: the model
    built after the loader, then two epochs, each followed by a draw."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(5) if generator else None
    loader = loader_class(cases.Counting(), batch_size=5, shuffle=shuffle, num_workers=num_workers,
                          persistent_workers=persistent, generator=g)
    draws = [torch.rand(2)]   # the model's initialisation
    batches = []
    for _ in range(2):
        batches.append([b.tolist() for b in loader])
        draws.append(torch.rand(2))
    if hasattr(loader, "close"):
        loader.close()
    return torch.stack(draws), batches


@pytest.mark.parametrize("shuffle,num_workers,persistent,generator", [
    (False, 0, False, False), (True, 0, False, False), (True, 2, False, False), (True, 2, True, False),
    (True, 0, False, True), (False, 2, True, True)])
def test_torch_rng_is_drawn_when_torch_draws_it(shuffle, num_workers, persistent, generator):
    theirs, _ = _training_script(torch.utils.data.DataLoader, shuffle, num_workers, persistent, generator)
    ours, batches = _training_script(mxtorch.DataLoader, shuffle, num_workers, persistent, generator)
    assert torch.equal(theirs, ours)   # model init and later draws as with torch's loader
    again, batches_again = _training_script(mxtorch.DataLoader, shuffle, num_workers, persistent, generator)
    assert batches == batches_again   # torch.manual_seed still fixes the batches
    if shuffle:
        assert batches[0] != batches[1]


def test_seed_given_draws_nothing_and_state_dict_fixes_a_drawn_seed():
    torch.manual_seed(0)
    expected = torch.rand(2)
    torch.manual_seed(0)
    loader = mxtorch.DataLoader(cases.Counting(), batch_size=5, shuffle=True, seed=3)
    list(loader)
    assert torch.equal(torch.rand(2), expected)
    torch.manual_seed(1)
    loader = mxtorch.DataLoader(cases.Counting(), batch_size=5, shuffle=True)
    state = loader.state_dict()   # the seed is drawn now: the state must reproduce the epoch
    first = [b.tolist() for b in loader]
    resumed = mxtorch.DataLoader(cases.Counting(), batch_size=5, shuffle=True)
    resumed.load_state_dict(state)
    assert [b.tolist() for b in resumed] == first


# ------------------------------------------------------------ 8. a spawn worker that cannot start says why


_LOCAL_CLASS_PROGRAM = """
import torch
from mxload.torch import DataLoader
class OnlyInMain(torch.utils.data.Dataset):
    def __len__(self):
        return 4
    def __getitem__(self, i):
        return i
try:
    list(DataLoader(OnlyInMain(), batch_size=2, num_workers=1, multiprocessing_context="spawn", timeout=30))
except Exception as e:
    print("RAISED", type(e).__name__, isinstance(e, RuntimeError))
    print(e)
"""

_UNGUARDED_SCRIPT = """
import sys
import torch
from mxload.torch import DataLoader

def report(kind, error, tb):   # the training process's error, on stdout; a worker's goes to stderr
    if __name__ != "__main__":
        return sys.__excepthook__(kind, error, tb)
    print("RAISED", kind.__name__, isinstance(error, RuntimeError))
    print(error)

sys.excepthook = report

class Squares(torch.utils.data.Dataset):
    def __len__(self):
        return 4
    def __getitem__(self, i):
        return i * i

print(list(DataLoader(Squares(), batch_size=2, num_workers=1, multiprocessing_context=sys.argv[1],
                      timeout=30)))
"""


def _run_program(args, cwd):
    """The program's stdout: what it printed of the error raised in it (a
    worker's own stderr goes to stderr, so it cannot satisfy the test)."""
    out = fresh_python.run_args(*args, timeout=90, cwd=cwd)
    return out.stdout


@pytest.mark.faults
def test_spawn_worker_of_a_class_only_in_main_names_the_cause(tmp_path):
    # A program given with -c has no file a spawn worker could import its __main__ from.
    out = _run_program(["-c", _LOCAL_CLASS_PROGRAM], tmp_path)
    assert "RAISED WorkerError True" in out, out
    assert "Can't get attribute 'OnlyInMain'" in out, out   # the worker's own error text
    assert "died unexpectedly" not in out


@pytest.mark.faults
@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_a_worker_of_an_unguarded_script_names_the_cause(tmp_path, context):
    script = tmp_path / "train.py"
    script.write_text(_UNGUARDED_SCRIPT)
    out = _run_program([str(script), context], tmp_path)
    # The worker imports the script, which starts a loader of its own: refused there (no
    # endless chain of workers), and the main process says why.  (A forkserver worker fails
    # in multiprocessing's bootstrap, before mxload's code: the main process finds the cause
    # in the script itself.)
    assert "RAISED WorkerError True" in out, out
    assert "bootstrapping phase" in out and 'if __name__ == "__main__":' in out, out
    assert out.count("RAISED") == 1, out


# ---------------------------------------------------------- 9. in_order=False routes work around a straggler



def test_out_of_order_map_style_batches_go_around_a_straggler():
    loader = mxtorch.DataLoader(cases.SlowFirst(), batch_size=1, num_workers=2, in_order=False,
                                prefetch_factor=2)
    order = [int(b) for b in loader]
    assert sorted(order) == list(range(16))
    # Only what was handed to the straggler before it stalled waits for it (its share of the
    # window, prefetch_factor tasks); every other batch comes first.
    assert order.index(0) >= 16 - 2, order


def test_out_of_order_stream_items_go_around_a_straggler():
    loader = mxtorch.DataLoader(cases.SlowFirstWorkerStream(), batch_size=None, num_workers=2, in_order=False)
    order = list(loader)
    assert order == list(range(12)) + [100], order


def test_in_order_keeps_the_sampler_order_with_a_straggler():
    loader = mxtorch.DataLoader(cases.SlowFirst(), batch_size=1, num_workers=2)
    assert [int(b) for b in loader] == list(range(16))


# --------------------------------------------------------- a worker's death in torch's words (test_segfault)



@pytest.mark.faults
@pytest.mark.parametrize("how,says", [
    ("segfault", r"^DataLoader worker \(pid \d+\) is killed by signal: Segmentation fault\. mxload worker 1"),
    ("exit", r"^DataLoader worker \(pid\(s\) \d+\) exited unexpectedly: mxload worker 1 \(pid \d+\) died "
             r"\(exit code 3\)"),
])
def test_worker_death_in_torchs_words(how, says):
    with pytest.raises(RuntimeError, match=says):
        list(mxtorch.DataLoader(cases.DiesAt(how), batch_size=1, num_workers=2))


# ------------------------------------------------- batches of zero bytes (test_large_sampler_indices' data)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_zero_byte_batches_are_writable_tensors_without_warning(num_workers):
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # torch warns of a tensor over a read-only array
        batches = list(mxtorch.DataLoader(cases.EmptySamples(), batch_size=3, num_workers=num_workers))
    assert [tuple(b.shape) for b in batches] == [(3, 0), (3, 0)]
    batches[0].add_(1)   # writable, as torch's batches are
    # torch warns once per process: the arrays themselves say it for every later test too.
    arrays = list(mxload.DataLoader(cases.EmptySamples(), batch_size=3, num_workers=num_workers))
    assert all(a.flags.writeable for a in arrays)
