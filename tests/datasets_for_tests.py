"""Module-level (picklable) datasets shared by the loader and fault tests."""
from __future__ import annotations

import faulthandler
import gc
import os
import signal
import sys
import threading
import time

import numpy as np

import mxload


class TupleDataset(mxload.Dataset):
    """(image-like array, label, float) samples."""

    def __init__(self, n: int = 53):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return np.full((4, 3), i, np.float32), i, float(i) / 2


class DictDataset(mxload.Dataset):
    """Dict samples with a ragged field (needs Pad) and a string."""

    def __init__(self, n: int = 41):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return {"seq": np.arange(i % 7 + 1, dtype=np.int64) + i, "label": np.int32(i), "name": f"s{i}"}


class ShardedStream(mxload.IterableDataset):
    """0..n-1, split between workers by get_worker_info()."""

    def __init__(self, n: int = 45):
        self.n = n

    def __iter__(self):
        info = mxload.get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(start, self.n, step):
            yield np.array([i, i * i], np.int64), i


class WorkerInfoDataset(mxload.Dataset):
    """Reports which worker produced each sample and a draw from numpy's global RNG."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int):
        info = mxload.get_worker_info()
        wid = -1 if info is None else info.id
        return np.array([i, wid, os.getpid()], np.int64), np.random.randint(0, 2 ** 31)


class HoldingDescriptors(mxload.Dataset):
    """Holds `n` descriptors (multiprocessing Connections of context `ctx`), which a spawn or
    forkserver worker receives with the dataset; each sample says how many of them are open
    in the worker."""

    def __init__(self, ctx, n: int):
        self.conns: list = []
        while len(self.conns) < n:
            r, w = ctx.Pipe(duplex=False)
            self.conns.append(r)
            if len(self.conns) < n:
                self.conns.append(w)
            else:
                w.close()

    def close(self) -> None:
        for c in self.conns:
            c.close()

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int):
        usable = 0
        for c in self.conns:
            try:
                os.fstat(c.fileno())
                usable += 1
            except OSError:
                pass
        return np.int64(usable)


class SharedCounting(mxload.Dataset):
    """Counts its loads in multiprocessing objects of context `ctx` (a Value, an Array by
    worker, a Lock, an Event) and sends each index it loads down a Pipe, as torch programs do:
    shared only by inheritance (the Pipe's ends and the Value's memory are descriptors)."""

    def __init__(self, ctx, n: int, workers: int):
        self.n = n
        self.lock = ctx.Lock()
        self.loads = ctx.Value("i", 0, lock=False)
        self.by_worker = ctx.Array("i", workers, lock=False)
        self.loaded = ctx.Event()
        self.indices, self.sent = ctx.Pipe(duplex=False)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        info = mxload.get_worker_info()
        with self.lock:
            self.loads.value += 1
            self.by_worker[info.id if info is not None else 0] += 1
            self.sent.send(i)
        self.loaded.set()
        return np.int64(i)


def epoch_batches(base: int, n: int) -> list[list[int]]:
    """`n` batches of 2 consecutive sample indices from `base` on."""
    return [[base + 2 * b, base + 2 * b + 1] for b in range(n)]


class EpochBatches:
    """A batch sampler that tells its epochs apart: `first` batches (epoch_batches) in epoch 0,
    `then` in every later one (default `first`); epoch e's samples from `spacing` * e on, or
    from `spacing` * (e % `cycle`) where a small dataset serves many epochs."""

    def __init__(self, first: int, then: int | None = None, spacing: int = 100, cycle: int | None = None):
        self.first, self.then = first, first if then is None else then
        self.spacing, self.cycle, self.drawn = spacing, cycle, 0

    def __len__(self) -> int:
        return self.first if self.drawn == 0 else self.then

    def __iter__(self):
        n, e = len(self), self.drawn
        self.drawn += 1
        return iter(epoch_batches(self.spacing * (e % self.cycle if self.cycle else e), n))


class SlowDataset(mxload.Dataset):
    """Sleeps in __getitem__ (for shutdown-while-busy tests); with `only`, for those samples only."""

    def __init__(self, delay: float, n: int = 64, announce: bool = False, only: frozenset[int] | None = None):
        self.delay = delay
        self.n = n
        self.announce = announce
        self.only = only

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if self.announce:
            os.write(1, f"busy {os.getpid()}\n".encode())   # one write: lines of workers never interleave
        if self.only is None or i in self.only:
            time.sleep(self.delay)
        return np.array([i])


class StuckDataset(mxload.Dataset):
    """Every sample after the first batch hangs for 1000 s, ignoring SIGTERM."""

    def __init__(self, n: int = 64, ignore_sigterm: bool = True):
        self.n = n
        self.ignore_sigterm = ignore_sigterm

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if i >= 2:
            if self.ignore_sigterm:
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
            time.sleep(1000)
        return np.array([i])


class GilHoldingDataset(mxload.Dataset):
    """__getitem__ holds the GIL without a break for as long as it likes
    (catastrophic regex backtracking: _sre never releases it), as a C
    extension busy in a long call does."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int):
        import re
        os.write(1, b"holding\n")   # one write: the lines of two workers never interleave
        re.match(r"(a+)+$", "a" * 40 + "b")   # 2**40 steps: never ends in a test's time
        return np.array([i])


class DyingDataset(mxload.Dataset):
    """The worker that loads sample `at` dies the way `how` says."""

    def __init__(self, at: int = 10, how: str = "exit", n: int = 40, only_once_file: str = ""):
        self.at = at
        self.how = how
        self.n = n
        self.only_once_file = only_once_file

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if i == self.at:
            if self.only_once_file:
                try:
                    fd = os.open(self.only_once_file, os.O_CREAT | os.O_EXCL)
                    os.close(fd)
                except FileExistsError:
                    return np.array([i])
            # The crash is the test: pytest's faulthandler (inherited through fork)
            # would print a "Fatal Python error" traceback into a passing run.
            faulthandler.disable()
            if self.how == "exit":
                os._exit(3)
            elif self.how == "segv":
                os.kill(os.getpid(), signal.SIGSEGV)
            elif self.how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif self.how == "bus":
                os.kill(os.getpid(), signal.SIGBUS)
            time.sleep(5)
        return np.array([i])


class MultiArgError(Exception):
    def __init__(self, code: int, detail: str):
        super().__init__(code, detail)
        self.code = code
        self.detail = detail


class CustomBaseException(BaseException):
    pass


class UnpicklableError(Exception):
    """Holds a lock, so it does not pickle; its class still builds from a message."""

    def __init__(self, message: str):
        super().__init__(message)
        self.lock = threading.Lock()


class CorruptSample(Exception):
    """A multi-argument exception as users write them (issue 39): its args are the message
    alone, so unpickling calls CorruptSample(message), which fails."""

    def __init__(self, path: str, code: int):
        super().__init__(f"{path}: {code}")
        self.path = path
        self.code = code


class UnprintableError(Exception):
    """str() raises (and so does repr(), which some messages fall back to)."""

    def __str__(self) -> str:
        raise ValueError("this error cannot be printed")

    def __repr__(self) -> str:
        raise ValueError("nor represented")


class PicklingInterruptedError(Exception):
    """Pickling it raises a BaseException that is no Exception."""

    def __reduce__(self):
        raise KeyboardInterrupt("pickling was refused")


class ForgivingError(Exception):
    """Answers every missing attribute, as proxy and mock errors do: its `__notes__` is no list."""

    def __getattr__(self, name: str):
        return f"<{name}>"


class TupleNotesError(Exception):
    """Its notes are a tuple, not the list add_note() needs."""

    def __init__(self, message: str):
        super().__init__(message)
        self.__notes__ = ("a note kept in a tuple",)


class ExitsWhenUnpickledIn(Exception):
    """Unpickling it in process `parent` (the training process) raises SystemExit; elsewhere
    (the worker's own round trip) it unpickles."""

    def __init__(self, parent: int, message: str):
        super().__init__(parent, message)
        self.parent = parent

    def __reduce__(self):
        return _exit_if_unpickled_in, (self.parent, self.args[1])


def _exit_if_unpickled_in(parent: int, message: str) -> ExitsWhenUnpickledIn:
    if os.getpid() == parent:
        raise SystemExit(f"unpickling refused in process {parent}")
    return ExitsWhenUnpickledIn(parent, message)


class RaisingDataset(mxload.Dataset):
    """Raises `exc_kind` at sample `at`; `parent`: the training process's pid (for
    "unpickle-exit")."""

    def __init__(self, at: int = 5, exc_kind: str = "value", n: int = 20, parent: int = 0):
        self.at = at
        self.exc_kind = exc_kind
        self.n = n
        self.parent = parent

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if i == self.at:
            if self.exc_kind == "stop":
                raise StopIteration(f"sample {i}")
            if self.exc_kind == "generator-exit":
                raise GeneratorExit(f"sample {i}")
            if self.exc_kind == "corrupt":
                raise CorruptSample(f"/data/{i}.jpg", 7)
            if self.exc_kind == "unprintable":
                raise UnprintableError(f"sample {i}")
            if self.exc_kind == "pickle-interrupt":
                raise PicklingInterruptedError(f"sample {i}")
            if self.exc_kind == "forgiving":
                raise ForgivingError(f"sample {i}")
            if self.exc_kind == "tuple-notes":
                raise TupleNotesError(f"sample {i}")
            if self.exc_kind == "unpickle-exit":
                raise ExitsWhenUnpickledIn(self.parent, f"sample {i}")
            if self.exc_kind == "value":
                raise ValueError(f"bad sample {i}")
            if self.exc_kind == "key":
                raise KeyError(f"missing {i}")
            if self.exc_kind == "exit":
                sys.exit(3)
            if self.exc_kind == "interrupt":
                raise KeyboardInterrupt(f"sample {i}")
            if self.exc_kind == "base":
                raise CustomBaseException(f"sample {i}")
            if self.exc_kind == "unpicklable":
                raise UnpicklableError(f"sample {i} held a lock")
            raise MultiArgError(42, f"sample {i} exploded")
        return np.array([i])


def record_worker_id(worker_id: int) -> None:
    """worker_init_fn used by the tests: leaves a trace in the environment."""
    os.environ["MXLOAD_TEST_WORKER_ID"] = str(worker_id)


def failing_init(worker_id: int) -> None:
    raise RuntimeError(f"init failed in worker {worker_id}")


class TaggedArray(np.ndarray):
    """An ndarray subclass carrying an attribute (as units/metadata libraries do)."""

    def __array_finalize__(self, obj):
        self.tag = getattr(obj, "tag", None)

    def __reduce__(self):
        base = super().__reduce__()
        return base[0], base[1], (base[2], self.tag)

    def __setstate__(self, state):
        super().__setstate__(state[0])
        self.tag = state[1]


def unusual_arrays_batchify(samples):
    """A batchify_fn returning arrays that a plain shared-memory view cannot
    represent: a masked array, a record array, an ndarray subclass with an
    attribute, an object array, a dtype with metadata."""
    values = np.array([s[1] for s in samples], np.int64)
    tagged = values.view(TaggedArray)
    tagged.tag = "units=m"
    return {
        "masked": np.ma.masked_array(values, mask=values % 2 == 0),
        "record": np.rec.fromarrays([values, values * 0.5], names="i,x"),
        "tagged": tagged,
        "objects": np.array([{"i": int(v)} for v in values], dtype=object),
        "meta": np.array(values, dtype=np.dtype(np.int64, metadata={"unit": "m"})),
        "plain": values * 2,
        "structured": np.array([(v, v * 0.5) for v in values], dtype=[("i", np.int64), ("x", np.float64)]),
    }


class PayloadDataset(mxload.Dataset):
    """Sample i is np.array([i]); carries `payload` (e.g. a large array that
    makes handing the dataset to a spawned worker slow)."""

    def __init__(self, payload, n: int = 8):
        self.payload = payload
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return np.array([i])


def exiting_init(worker_id: int) -> None:
    import sys
    sys.exit(0)


class RebuiltOnlyInWorkers:
    """Pickles fine in a worker; unpickling it in process `parent` fails."""

    def __init__(self, parent: int):
        self.parent = parent

    def __reduce__(self):
        return _rebuild_only_in_workers, (self.parent,)


def _rebuild_only_in_workers(parent: int):
    if os.getpid() == parent:
        raise ValueError("this object cannot be rebuilt in the main process")
    return RebuiltOnlyInWorkers(parent)


def batchify_with_object_for(parent: int, samples):
    """A batchify_fn whose batches carry a RebuiltOnlyInWorkers (bind parent with functools.partial)."""
    return {"x": np.stack([s[0] for s in samples]), "obj": RebuiltOnlyInWorkers(parent)}


class AugmentedDataset(mxload.Dataset):
    """Random augmentation from sample_rng() and from the worker's global RNG,
    with the worker's get_worker_info() (the Ray backend must match local
    workers bit for bit)."""

    def __init__(self, n: int = 37):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        info = mxload.get_worker_info()
        who = np.array([-1, -1, -1] if info is None else [info.id, info.num_workers, info.seed], np.int64)
        return {"x": mxload.sample_rng().random(3).astype(np.float32) + i,
                "global": np.random.randint(0, 2 ** 31), "worker": who, "label": i}


class StartedProbe(mxload.Dataset):
    """Leaves a file `<dir>/<i>` when it starts loading sample i (counts how far a
    loader loads ahead of its consumer, wherever its workers run)."""

    def __init__(self, directory: str, n: int = 64):
        self.directory = directory
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        open(os.path.join(self.directory, str(i)), "w").close()
        return np.array([i])


class PagesDataset(mxload.Dataset):
    """256 KiB samples filled with their index (batches large enough for Ray's object store)."""

    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int):
        return np.full((256, 1024), i, np.uint8)


class StopsInGetitems(mxload.Dataset):
    """__getitems__ raises StopIteration for the batch that holds sample `at`."""

    def __init__(self, at: int = 2, n: int = 8):
        self.at = at
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitems__(self, indices):
        if self.at in list(indices):
            raise StopIteration(f"sample {self.at}")
        return [np.array([i]) for i in indices]


def batchify_stopping_at(at: int, samples):
    """A batchify_fn (with functools.partial) that raises StopIteration for the batch holding
    sample `at`, and stacks the others."""
    if any(int(np.asarray(s).ravel()[0]) == at for s in samples):
        raise StopIteration(f"sample {at}")
    return np.stack([np.asarray(s) for s in samples])


class CountingStream(mxload.IterableDataset):
    """Yields 0 .. n-1 from an iterator object of its own, whose __next__ raises StopIteration
    at the end (the stream's normal end)."""

    def __init__(self, n: int = 8):
        self.n = n

    def __iter__(self):
        return _Counter(self.n)


class _Counter:
    def __init__(self, n: int):
        self.i, self.n = 0, n

    def __iter__(self):
        return self

    def __next__(self):
        if self.i >= self.n:
            raise StopIteration
        self.i += 1
        return np.array([self.i - 1])


def unprintable_init(worker_id: int) -> None:
    raise UnprintableError(f"init of worker {worker_id}")


_GC_PROBE_ARMED = False


def _probe_sample(kind: str, i: int):
    if kind == "tuple":
        return np.full((4, 3), i, np.float32), i, float(i) / 2
    if kind == "dict":
        return {"x": np.arange(3.0) + i, "nested": (np.zeros(2, np.int64), [i, 1.5]), "name": f"s{i}"}
    if kind == "ragged":
        return {"seq": np.arange(i % 5 + 1, dtype=np.int64), "label": i}
    if kind == "tensor":
        import torch
        return torch.full((3, 4), float(i)), i
    if kind == "tensor-dict":
        import torch
        return {"x": torch.full((5,), float(i)), "y": torch.tensor(i), "name": f"s{i}"}
    raise ValueError(f"unknown sample kind {kind!r}")


class GcProbe(mxload.Dataset):
    """Samples of `kind`, each with the field `unreachable`: 0, except in the last sample,
    where it is how many objects the cyclic collector found unreachable in the process that
    fetched it since that process fetched its first sample (the collector is off meanwhile).
    A loader whose per-batch work makes no reference cycle frees every batch's samples, plan
    and buffer when the batch goes, and the count is 0."""

    def __init__(self, kind: str, n: int = 96):
        self.kind, self.n = kind, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        global _GC_PROBE_ARMED
        if not _GC_PROBE_ARMED:
            _GC_PROBE_ARMED = True
            gc.collect()
            gc.disable()
        unreachable = 0
        if i == self.n - 1:
            unreachable = gc.collect()
            gc.enable()
            _GC_PROBE_ARMED = False
        sample = _probe_sample(self.kind, i)
        if isinstance(sample, dict):
            return {**sample, "unreachable": unreachable}
        return (*sample, unreachable)
