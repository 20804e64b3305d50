"""One batch's error never costs the epoch (issue 40, items 1, 2, 3 and 6; issue 39): whatever
the dataset or batchify_fn raises for a batch, the training loop gets an error for that batch
(its own type where it can be rebuilt, else a WorkerError naming it, the batch and the worker),
the batch is used up, and the loop may go on with the next ones: with 0 workers, worker
processes, worker threads and num_workers="auto" alike."""
from __future__ import annotations

import functools
import os
import pickle
import signal

import numpy as np
import pytest
from conftest import exception_text
from datasets_for_tests import (
    CorruptSample,
    CountingStream,
    ForgivingError,
    PicklingInterruptedError,
    RaisingDataset,
    StopsInGetitems,
    TupleNotesError,
    UnprintableError,
    batchify_stopping_at,
)

import mxload
from mxload._runtime import messages as m
from mxload._runtime.remote_errors import rebuild_exception
from mxload.errors import WorkerTraceback

pytestmark = pytest.mark.timeout(60)

MODES = {
    "in-process": {"num_workers": 0},
    "processes": {"num_workers": 2, "start_method": "fork"},
    "threads": {"num_workers": 2, "thread_pool": True},
    "auto": {"num_workers": "auto"},
}
WORKER_MODES = ["processes", "threads"]


def outcomes(loader, limit: int = 20) -> list:
    """One epoch taken by a loop that catches every error and goes on: each next()'s batch
    (its sample values) or the exception it raised, until the epoch ends (or is aborted)."""
    got: list = []
    it = iter(loader)
    for _ in range(limit):
        try:
            batch = next(it)
        except StopIteration:
            return got
        except BaseException as e:   # noqa: BLE001 - what the loop gets is the test's subject
            got.append(e)
            if isinstance(e, mxload.EpochAbortedError):
                return got
            continue
        got.append([int(x) for x in np.asarray(batch).ravel()])
    it.close()
    raise AssertionError(f"the epoch did not end within {limit} calls: {got}")


def loader_for(dataset, mode: str, **kwargs) -> mxload.DataLoader:
    # timeout: a lost batch fails the test in seconds instead of hanging it
    return mxload.DataLoader(dataset, batch_size=2, timeout=20, **MODES[mode], **kwargs)


def assert_batch_1_failed(got: list) -> BaseException:
    """The epoch of 8 samples in batches of 2 went on around batch 1's error: that error."""
    assert len(got) == 4 and got[0] == [0, 1] and got[2:] == [[4, 5], [6, 7]], got
    assert isinstance(got[1], BaseException), got
    return got[1]


# ---------------------------------------------------------------- item 1: StopIteration


STOPPING = {
    "__getitem__": lambda: (RaisingDataset(at=2, exc_kind="stop", n=8), {}),
    "__getitems__": lambda: (StopsInGetitems(at=2, n=8), {}),
    "batchify_fn": lambda: (RaisingDataset(at=-1, n=8),
                            {"batchify_fn": functools.partial(batchify_stopping_at, 2)}),
}


@pytest.mark.parametrize("where", list(STOPPING))
@pytest.mark.parametrize("mode", list(MODES))
def test_a_stop_iteration_out_of_the_dataset_is_that_batchs_error_not_the_epochs_end(mode, where):
    """A StopIteration escaping the dataset or batchify_fn is batch 1's RuntimeError, chained
    from it (as PEP 479 does for generators).  Before, `for batch in loader` ended after batch
    0 of 4 as if the epoch were over; the same iterator then yielded batches 2 and 3."""
    dataset, kwargs = STOPPING[where]()
    loader = loader_for(dataset, mode, **kwargs)
    with pytest.raises(RuntimeError, match="batch 1") as info:
        for _ in loader:
            pass
    assert isinstance(info.value.__cause__, StopIteration), exception_text(info.value)
    assert loader.state_dict()["done"]["prefix"] == 2   # batches 0 and 1 used up, the epoch not over
    error = assert_batch_1_failed(outcomes(loader))
    assert type(error) is RuntimeError, exception_text(error)
    assert "StopIteration" in str(error) and "batch 1" in str(error), str(error)
    assert isinstance(error.__cause__, StopIteration) and "sample 2" in str(error.__cause__)
    if mode in WORKER_MODES:   # the worker is named too (by the StopIteration's note and cause)
        assert "Raised in worker" in exception_text(error), exception_text(error)


@pytest.mark.parametrize("mode", ["in-process", "processes", "threads"])
def test_an_iterable_datasets_own_stop_iteration_still_ends_its_stream(mode):
    """The stream's iterator raising StopIteration is its normal end, not an error; a
    StopIteration out of its batchify_fn is that batch's error."""
    workers = {"num_workers": 1} if mode != "in-process" else {}
    options = {**MODES[mode], **workers}
    loader = mxload.DataLoader(CountingStream(8), batch_size=2, timeout=20, **options)
    assert [b.ravel().tolist() for b in loader] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    loader = mxload.DataLoader(CountingStream(8), batch_size=2, timeout=20, **options,
                               batchify_fn=functools.partial(batchify_stopping_at, 2))
    error = assert_batch_1_failed(outcomes(loader))
    assert type(error) is RuntimeError and isinstance(error.__cause__, StopIteration), exception_text(error)


# ---------------------------------------------------------------- item 2: str() or pickling fails


@pytest.mark.parametrize("kind,cls", [("unprintable", UnprintableError),
                                      ("pickle-interrupt", PicklingInterruptedError)])
@pytest.mark.parametrize("mode", ["in-process", *WORKER_MODES])
def test_an_exception_that_cannot_be_printed_or_pickled_is_still_that_batchs_error(mode, kind, cls):
    """An exception whose str() raises, or whose pickling raises a BaseException, reaches the
    loop as batch 1's error and the epoch goes on.  Before, the worker died reporting it (every
    replacement the same way until max_worker_restarts was spent; a worker thread ended), and
    the exception never reached the loop."""
    restarts = {"max_worker_restarts": 2} if mode in WORKER_MODES else {}
    loader = loader_for(RaisingDataset(at=2, exc_kind=kind, n=8), mode, **restarts)
    error = assert_batch_1_failed(outcomes(loader))
    assert isinstance(error, cls), exception_text(error)
    if mode in WORKER_MODES:
        assert loader.stats["worker_restarts"] == 0
        text = exception_text(error)
        assert "Raised in worker 1" in text and "batch 1" in text, text


@pytest.mark.parametrize("mode", WORKER_MODES)
def test_a_worker_init_fn_error_that_cannot_be_printed_still_ends_the_epoch_as_itself(mode):
    """The failure of worker_init_fn ends the epoch with its own exception, even where its
    str() raises (before: that ValueError from recording it, in its place)."""
    from datasets_for_tests import unprintable_init
    with pytest.raises(UnprintableError):
        list(loader_for(RaisingDataset(at=-1, n=8), mode, worker_init_fn=unprintable_init))


def test_the_report_of_an_exception_never_fails_and_still_names_it():
    """ExceptionInfo.of, which every worker calls for a batch's error, never raises."""
    info = m.ExceptionInfo.of(UnprintableError("x"))
    assert info.qualname == "UnprintableError" and "UnprintableError" in info.message
    assert "str() raised ValueError" in info.message, info.message
    assert info.pickled is not None   # it pickles: only its text is broken
    # Its __reduce__ raises KeyboardInterrupt: it travels as its class, args and attributes.
    info = m.ExceptionInfo.of(PicklingInterruptedError("x"))
    assert type(pickle.loads(info.pickled)) is PicklingInterruptedError and info.message == "x"

    class Local(PicklingInterruptedError):   # nor that: a local class pickles by a name nobody can import
        pass
    info = m.ExceptionInfo.of(Local("z"))
    assert info.pickled is None and info.qualname.endswith("Local") and info.message == "z"

    class NoTraceback(Exception):
        @property
        def __notes__(self):
            raise KeyboardInterrupt("notes")
    info = m.ExceptionInfo.of(NoTraceback("y"))
    assert "NoTraceback" in info.traceback and info.message == "y"


# ---------------------------------------------------------------- item 3: rebuilding it here fails


@pytest.mark.parametrize("kind,cls", [("forgiving", ForgivingError), ("tuple-notes", TupleNotesError),
                                      ("unpickle-exit", None)])
@pytest.mark.parametrize("mode", WORKER_MODES)
def test_an_exception_that_cannot_be_rebuilt_here_never_ends_the_epoch(mode, kind, cls):
    """An exception whose rebuild in the training process fails (add_note refused: a forgiving
    __getattr__ or a tuple __notes__; unpickling raises SystemExit) is still batch 1's error.
    Before, the epoch ended with "could not take a worker's result" (threads: the worker thread
    ended), or the batch was lost and the next next() waited for `timeout`."""
    loader = loader_for(RaisingDataset(at=2, exc_kind=kind, n=8, parent=os.getpid()), mode)
    error = assert_batch_1_failed(outcomes(loader))
    text = exception_text(error)
    assert "batch 1" in text and "Raised in worker 1" in text, text
    if cls is not None:   # it could not take the note naming worker and batch: a WorkerError about it
        assert isinstance(error, mxload.WorkerError) and error.batch_index == 1, text
        assert type(error.__cause__) is cls and cls.__name__ in str(error), text
    else:
        assert "ExitsWhenUnpickledIn" in text, text


class RefusesCause(Exception):
    """Setting any attribute (its __cause__ too) raises a BaseException."""

    def __setattr__(self, name, value):
        raise GeneratorExit(name)


def _interrupted():
    raise KeyboardInterrupt("unpickling")


def _refusing():
    return BaseException.__new__(RefusesCause)


class _Reducing:
    """Pickles as a call of `make` (what unpickling it runs)."""

    def __init__(self, make):
        self.make = make

    def __reduce__(self):
        return self.make, ()


@pytest.mark.parametrize("hostile", ["forgiving", "tuple-notes", "unpickle-base", "setattr-base"])
def test_rebuilding_a_workers_exception_never_raises(hostile):
    """rebuild_exception runs in the receive path: whatever the exception does there, it
    returns a WorkerError naming the worker, its pid and the batch (the exception as its cause
    where it got that far)."""
    made = {"forgiving": lambda: m.ExceptionInfo.of(ForgivingError("f")),
            "tuple-notes": lambda: m.ExceptionInfo.of(TupleNotesError("t")),
            "unpickle-base": lambda: m.ExceptionInfo("tests", "Gone", "g", "tb",
                                                     pickle.dumps(_Reducing(_interrupted))),
            "setattr-base": lambda: m.ExceptionInfo("tests", "RefusesCause", "r", "tb",
                                                    pickle.dumps(_Reducing(_refusing)))}
    try:
        error = rebuild_exception(made[hostile](), 3, 4242, 9)
    except BaseException as e:   # noqa: BLE001 - a KeyboardInterrupt must fail this test, not end the run
        pytest.fail(f"rebuild_exception raised {type(e).__name__}: {e}")
    assert isinstance(error, mxload.WorkerError) and error.batch_index == 9 and error.worker_id == 3
    assert "worker 3 (pid 4242)" in str(error) and "batch 9" in str(error), str(error)
    if hostile == "unpickle-base":
        assert "unpickling it here raised KeyboardInterrupt: unpickling" in str(error), str(error)
    else:
        assert "it refused the note or the cause" in str(error) and error.__cause__ is not None, str(error)


def test_a_start_failure_whose_exception_cannot_be_unpickled_here_is_still_reported():
    """The same for a worker that could not start: its error names the cause in words."""
    from mxload._runtime.engine_errors import start_failure
    info = m.ExceptionInfo("tests", "Gone", "no module named x", "tb", pickle.dumps(_Reducing(_interrupted)))
    try:
        error = start_failure(m.InitFailed(info, "unpickling the dataset"), 2, 77)
    except BaseException as e:   # noqa: BLE001
        pytest.fail(f"start_failure raised {type(e).__name__}: {e}")
    assert isinstance(error, mxload.WorkerError) and "worker 2 (pid 77) could not start" in str(error)
    assert "no module named x" in str(error) and error.__cause__ is None


# ---------------------------------------------------------------- item 6: SystemExit & co


@pytest.fixture
def own_sigint_handler():
    """The program has a SIGINT handler of its own (that does not raise): a KeyboardInterrupt is
    then never a Ctrl-C, whatever the mode."""
    previous = signal.signal(signal.SIGINT, lambda signum, frame: None)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture
def default_sigint_handler():
    """Python's own SIGINT handler, even where the suite runs with SIGINT ignored (background
    jobs, some CI runners: .ci/run's last fast-tier run)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("kind,name", [("exit", "SystemExit"), ("interrupt", "KeyboardInterrupt"),
                                       ("generator-exit", "GeneratorExit")])
@pytest.mark.parametrize("mode", list(MODES))
def test_a_base_exception_out_of_the_dataset_is_that_batchs_worker_error_in_every_mode(
        mode, kind, name, own_sigint_handler):
    """sys.exit(), KeyboardInterrupt or GeneratorExit raised by the dataset: a WorkerError naming
    it and batch 1 (the original as its cause), the batch used up, the epoch going on.  Before,
    with 0 workers it reached the loop as itself and the next call loaded the batch again (for
    ever, for a loop that catches it); a worker thread ended, and the epoch with it."""
    error = assert_batch_1_failed(outcomes(loader_for(RaisingDataset(at=2, exc_kind=kind, n=8), mode)))
    assert isinstance(error, mxload.WorkerError), exception_text(error)
    assert error.batch_index == 1 and name in str(error) and "batch 1" in str(error), str(error)
    assert type(error.__cause__).__name__ == name, exception_text(error)
    if mode in WORKER_MODES:
        assert "Raised in worker 1" in str(error), str(error)


@pytest.mark.parametrize("mode", list(MODES))
def test_a_keyboard_interrupt_is_a_ctrl_c_only_where_one_can_land(mode, default_sigint_handler):
    """With Python's default SIGINT handler, a KeyboardInterrupt out of the dataset in the
    training process cannot be told from a Ctrl-C: it reaches the loop as itself and the next
    call loads the batch again (the Ctrl-C guarantee).  In a worker it is never a Ctrl-C
    (workers ignore SIGINT; handlers run in the main thread only): the batch's WorkerError."""
    it = iter(loader_for(RaisingDataset(at=2, exc_kind="interrupt", n=8), mode))
    got: list = []
    for _ in range(4):
        try:
            got.append(next(it).ravel().tolist())
        except BaseException as e:   # noqa: BLE001
            got.append(e)
    it.close()
    assert got[0] == [0, 1], got
    if mode in WORKER_MODES:
        assert isinstance(got[1], mxload.WorkerError) and got[2:] == [[4, 5], [6, 7]], got
    else:
        assert all(type(e) is KeyboardInterrupt for e in got[1:]), got


# ---------------------------------------------------------------- issue 39: a multi-argument exception


@pytest.mark.parametrize("mode", list(MODES))
def test_a_multi_argument_exception_arrives_as_itself_with_its_attributes_in_every_mode(mode):
    """CorruptSample(path, code), whose args are its message alone: its own type and attributes
    with workers as without (rebuilt without calling __init__).  Before, a WorkerError with
    workers."""
    error = assert_batch_1_failed(outcomes(loader_for(RaisingDataset(at=2, exc_kind="corrupt", n=8), mode)))
    assert type(error) is CorruptSample, exception_text(error)
    assert (error.path, error.code, str(error)) == ("/data/2.jpg", 7, "/data/2.jpg: 7")
    if mode in WORKER_MODES:
        assert isinstance(error.__cause__, WorkerTraceback)
        assert any("worker 1" in n and "batch 1" in n for n in error.__notes__), error.__notes__
