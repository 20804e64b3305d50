"""The messages between the main process, the worker zygote and the workers, as types
(how they are framed on a local worker's socket: local/wire.py; how a batch lies in a slab:
``mxload/_collate/layout.py``), and what a worker is started with (WorkerConfig).

    main -> worker      Task (carrying the task's slab descriptor the first time a
                        worker is given that slab), Stop
    worker -> main      Batch (filled into the task's slab), BatchRef (the same, for
                        a layout named by an earlier Batch), NewSlab (a new slab,
                        carrying its descriptor), Failed, Exhausted, InitFailed
    main -> zygote      StartWorker (carrying the worker's socket end); its stop
                        request is the main process's end of the socket closing
    zygote -> main      Started (carrying a pidfd of the worker), StartFailed, Exited
    main -> spawn worker Handover (once, before its first Task)

Never framed: thread workers use the same types in memory (``Loaded`` is their batch), and
Ray actors return RemoteBatch and ActorReady through Ray's object store.  Timings are on
the system-wide monotonic clock (``time.monotonic_ns``).
"""
from __future__ import annotations

import pickle
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from .._collate.layout import Layout
from .._collate.plan import collates_itself
from .._torch_compat import datapipe_shards, is_datapipe
from .source import SampleSource

if TYPE_CHECKING:
    from .._options import LoaderOptions

__all__ = [
    "ExceptionInfo", "Timings",
    "Task", "Stop", "Batch", "BatchRef", "NewSlab", "Loaded", "Failed", "Exhausted", "InitFailed",
    "StartWorker", "Started", "StartFailed", "Exited", "Handover", "RemoteBatch", "ActorReady",
    "Message", "WorkerResult", "WorkerConfig", "Payload", "ProtocolError",
]


class ProtocolError(Exception):
    """A frame that is not a message of this protocol (another program, or
    another mxload version, writes to the channel)."""


# (dataset, batchify_fn, worker_init_fn): the user's objects every worker gets.
Payload = tuple[Any, Callable[..., Any], Callable[[int], None] | None]


@dataclass
class WorkerConfig:
    """Everything a worker needs besides its channel (picklable for spawn)."""
    worker_id: int
    num_workers: int
    seed: int
    epoch: int
    payload: Payload | bytes     # or its pickle (spawn, forkserver: pickled once for all workers)
    iterable: bool
    batch_size: int              # samples per batch of a stream
    drop_last: bool
    # Forked by the zygote: its only thread forked us, so the kernel's parent
    # death signal is sound (armed there).  Otherwise (spawn, forkserver) the parent is the
    # main process or the fork server, and a watchdog thread notices the main
    # process's end of our socket closing instead.
    zygote_child: bool
    # batch_size=None: each task is one sampler key for dataset[key] (_keys.encode_key).
    keyed: bool = False
    # How this worker seeds its global RNGs (_options.SEEDINGS); "torch": from base_seed, the
    # base seed of the iteration that started this engine's workers.
    seeding: str = "per_worker"
    base_seed: int = 0
    # With a pickled payload, the descriptors its multiprocessing objects need (local/inherit.py):
    # a list in the worker; in a forkserver worker's arguments, a ForChild.
    payload_fds: Any = ()
    # A torch DataPipe: (world size, rank) of the training process, which the worker shards it by
    # (as torch's DataLoader does); None for any other dataset.
    datapipe_shards: tuple[int, int] | None = None

    @classmethod
    def first(cls, options: LoaderOptions, epoch: int) -> WorkerConfig:
        """Worker 0's, for a loader's engine starting at `epoch` (a transport makes the others')."""
        return cls(0, options.workers.num_workers, options.seeds.seed, epoch,
                   (options.dataset, options.batching.batchify_fn, options.workers.worker_init_fn),
                   options.derived.iterable, options.derived.fetch_batch_size, options.batching.drop_last,
                   zygote_child=False, keyed=not options.derived.auto_batching, seeding=options.seeds.seeding,
                   base_seed=options.seeds.base_seed,
                   datapipe_shards=datapipe_shards() if is_datapipe(options.dataset) else None)

    def source(self, dataset: Any, batchify_fn: Callable[..., Any]) -> SampleSource:
        return SampleSource(dataset, self.iterable, self.batch_size, self.drop_last, self.seed, self.keyed,
                            self.seeding, gather_tensors=collates_itself(batchify_fn))


class ExceptionInfo(NamedTuple):
    """An exception raised in a worker, as the main process rebuilds it (remote_errors.py)."""
    module: str
    qualname: str
    message: str
    traceback: str
    pickled: bytes | None      # the exception itself, when it pickles and unpickles

    @classmethod
    def of(cls, exc: BaseException) -> ExceptionInfo:
        """Never raises, whatever `exc` does (a worker must report every batch's error: one
        that escaped here ended the worker, and every replacement the same way): a str() that
        raises, a traceback that cannot be formatted, a pickling that raises a BaseException
        each have a fallback that still names the exception's type."""
        kind = type(exc)
        module, qualname = _type_names(kind)
        message = safe_text(exc)
        return cls(module, qualname, message, _traceback_text(exc, qualname, message), _pickled(exc))


def safe_text(exc: BaseException) -> str:
    """str(exc), or where that raises, what it is and what its str() raised."""
    try:
        return str(exc)
    except BaseException as e:   # noqa: BLE001 - a user's __str__ may raise anything
        failure = _type_names(type(e))[1]
    try:
        shown = repr(exc)
    except BaseException:   # noqa: BLE001
        shown = "its repr() raised too"
    return f"<{_type_names(type(exc))[1]} whose str() raised {failure}: {shown}>"


def _type_names(kind: type) -> tuple[str, str]:
    try:
        return str(kind.__module__), str(kind.__qualname__)
    except BaseException:   # noqa: BLE001 - a metaclass may make these anything
        return "?", getattr(kind, "__name__", "?")


def _traceback_text(exc: BaseException, qualname: str, message: str) -> str:
    try:
        return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    except BaseException as e:   # noqa: BLE001 - its notes or cause may be as broken as its str()
        failure = _type_names(type(e))[1]
    try:
        frames = "".join(traceback.format_tb(exc.__traceback__))
    except BaseException:   # noqa: BLE001
        frames = ""
    return (f"Traceback (most recent call last):\n{frames}{qualname}: {message}\n"
            f"(its notes and chained exceptions could not be formatted: {failure})\n")


def _pickled(exc: BaseException) -> bytes | None:
    """`exc` pickled, where it unpickles again: as itself, else as its class, args and
    attributes, rebuilt without calling its __init__ (an exception whose __init__ takes
    other arguments than its args, ``CorruptSample(path, code)`` with one message as args,
    pickles but cannot be unpickled); None where neither round trip works."""
    for candidate in (exc, _WithoutInit(exc)):
        try:
            blob = pickle.dumps(candidate)
            pickle.loads(blob)
            return blob
        except BaseException:   # noqa: BLE001 - a __reduce__ may raise anything, SystemExit included
            continue
    return None


class _WithoutInit:
    """Pickles an exception as its class, args and attributes (see _pickled)."""

    def __init__(self, exc: BaseException):
        self._exc = exc

    def __reduce__(self) -> tuple[Any, ...]:
        exc = self._exc
        return _rebuilt_without_init, (type(exc), exc.args, dict(vars(exc)))


def _rebuilt_without_init(kind: type[BaseException], args: tuple[Any, ...],
                          state: dict[str, Any]) -> BaseException:
    error = kind.__new__(kind, *args)
    error.args = args
    error.__dict__.update(state)
    return error


class Timings(NamedTuple):
    """Where one batch's time went in its worker (only when profiling)."""
    start_ns: int
    fetch_ns: int
    collate_ns: int
    sent_ns: int
    field_stats: list[Any]     # (path, kernel, nbytes, shape, dtype) per field
    field_ns: list[Any]


class Task(NamedTuple):
    """Load batch `batch_index` of `epoch`.  `indices`: raw little-endian int64
    bytes across a socket, the index array itself in memory, None for a
    stream.  `slab_id`/`slab_size`: the pooled slab to fill (None/0: make a
    new one); the frame carries its descriptor the first time this worker
    sees it.  `drop_slabs`: slabs the worker should forget (retired)."""
    epoch: int
    batch_index: int
    indices: bytes | np.ndarray | None
    slab_id: int | None = None
    slab_size: int = 0
    drop_slabs: tuple[int, ...] = ()
    profiling: bool = False

    def index_array(self) -> np.ndarray | None:
        if isinstance(self.indices, bytes):
            return np.frombuffer(self.indices, np.int64)
        return self.indices


class Stop(NamedTuple):
    """End: a worker skips its queued tasks and exits; the zygote kills its workers and exits."""


class Batch(NamedTuple):
    """Batch `batch_index` is in the task's slab (`nbytes` of it; 0: no slab
    needed).  `layout_id` >= 0: the worker's later batches with this layout
    come as BatchRef naming it."""
    epoch: int
    batch_index: int
    slab_id: int | None
    nbytes: int
    layout: Layout
    timings: Timings | None
    layout_id: int = -1


class BatchRef(NamedTuple):
    """A Batch whose layout is the one this worker named `layout_id` (never
    profiled): a fixed-size frame, stored without the GIL by the receiver."""
    epoch: int
    batch_index: int
    slab_id: int
    nbytes: int
    layout_id: int


class NewSlab(NamedTuple):
    """Batch `batch_index` is in a new slab of `size` bytes (the task's was missing
    or too small), whose descriptor the frame carries."""
    epoch: int
    batch_index: int
    size: int
    nbytes: int
    layout: Layout
    timings: Timings | None


class Loaded(NamedTuple):
    """A batch ready for the consumer (a thread worker's, in private memory,
    or a received one as views of its slab).  Never sent."""
    epoch: int
    batch_index: int
    batch: Any                 # the user's structure of arrays
    timings: Timings | None


class Failed(NamedTuple):
    """The dataset or the collation raised for batch `batch_index`."""
    epoch: int
    batch_index: int
    error: ExceptionInfo


class Exhausted(NamedTuple):
    """This worker's share of an IterableDataset ended before batch `batch_index`."""
    epoch: int
    batch_index: int


class InitFailed(NamedTuple):
    """worker_init_fn raised, or (`starting` set: what it was doing) the
    worker could not start at all: the worker is unusable."""
    error: ExceptionInfo
    starting: str = ""


class StartWorker(NamedTuple):
    """Zygote: fork worker `worker_id` for `epoch`, serving the socket the frame carries."""
    worker_id: int
    epoch: int


class Started(NamedTuple):
    """Zygote: worker `worker_id` runs as `pid`; the frame carries its pidfd."""
    worker_id: int
    pid: int


class StartFailed(NamedTuple):
    """Zygote: fork() failed for worker `worker_id`."""
    worker_id: int
    reason: str


class Exited(NamedTuple):
    """Zygote: it reaped worker `pid`, which ended with `exit_code` (negative: signal)."""
    pid: int
    exit_code: int


class Handover(NamedTuple):
    """A spawn worker's start: multiprocessing's preparation data (sys.path,
    the main module) and its WorkerConfig."""
    preparation: dict[str, Any]
    config: WorkerConfig


class RemoteBatch(NamedTuple):
    """A Ray actor's batch, returned through Ray's object store (not a
    frame): collated into `buffer`, a uint8 array that the object store
    carries and the consumer views without a copy (None: no buffer needed)."""
    epoch: int
    batch_index: int
    layout: tuple[Any, ...]
    buffer: np.ndarray | None
    timings: Timings | None


class ActorReady(NamedTuple):
    """A Ray actor's answer once it holds the dataset: where it runs (error
    messages; the profiler reads a worker's CPU time only on its own node),
    and whether receiving the dataset or worker_init_fn failed."""
    pid: int
    node_id: str
    node_ip: str
    init_failed: InitFailed | None


Message = (Task | Stop | Batch | NewSlab | Loaded | Failed | Exhausted | InitFailed | StartWorker
           | Started | StartFailed | Exited | Handover | RemoteBatch | ActorReady | BatchRef)
WorkerResult = Batch | NewSlab | Loaded | Failed | Exhausted | InitFailed
