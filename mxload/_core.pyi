"""Type stubs for mxload._core, the compiled (Cython) core built from csrc/.

Keep in step with csrc/_core.pyx and the .pxi files it includes:
interrupt.pxi (defer_sigint, sigint_safe_finalizer), reorder.pxi
(ReorderBuffer, BufferClosedError, RawBatch), collate.pxi (kernels,
SampleTree and TreeTable, field_views, layout planner, ALIGNMENT,
monotonic_ns), slab.pxi (Slab, BatchOwner),
receive.pxi (FrameReceiver, build_views, the frame constants), task.pxi
(send_task, send_tasks) and handoff.pxi (ViewTemplate, claim_batch)."""
from collections import deque
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from types import TracebackType
from typing import Any, Literal, Protocol, Self, TypedDict, TypeVar, final, overload

import numpy as np
from numpy.typing import ArrayLike, DTypeLike, NDArray

# ---------------------------------------------------------------- _core.pyx

class _BuildInfo(TypedDict):
    compile_flags: str
    numpy_build_version: str
    numpy_c_api: bool
    wait_clock: str

BUILD_INFO: _BuildInfo

# ---------------------------------------------------------------- reorder.pxi

class BufferClosedError(RuntimeError):
    """Raised by ReorderBuffer operations after close()."""

class EpochOverError(RuntimeError):
    """Raised by a wait given the buffer's `epochs` count once that epoch is over."""

class RawBatch:
    """A batch the compiled receive path stored (worker slot, epoch, index, slab id, bytes, layout id)."""

    @property
    def slot(self) -> int: ...
    @property
    def tag(self) -> int: ...
    @property
    def epoch(self) -> int: ...
    @property
    def idx(self) -> int: ...
    @property
    def slab_id(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def layout_id(self) -> int: ...

class ReorderBuffer:
    """Thread-safe map from batch index to item with blocking, GIL-free waits."""

    def put(self, idx: int, item: object) -> None: ...
    def try_get(self, idx: int, default: Any = None) -> Any: ...
    def get(self, idx: int, timeout: float | None = None, epochs: int = -1) -> Any: ...
    def pop_next(self, timeout: float | None = None, epochs: int = -1) -> tuple[int, Any]: ...
    def close(self, reason: object = None) -> None: ...
    @property
    def closed(self) -> bool: ...
    @property
    def waiting(self) -> int: ...
    # Epoch changes so far (start_epoch, end_epoch): a wait given it ends with EpochOverError once it moves.
    @property
    def epochs(self) -> int: ...
    def clear(self) -> dict[int, Any]: ...
    def start_epoch(self, epoch: int) -> dict[int, Any]: ...
    def end_epoch(self) -> None: ...
    def take_raw(self, tag: int) -> dict[int, RawBatch]: ...
    # With keep_handover: the (idx, item) the consumer's wait took last, until the consumer clears it.
    handover: tuple[int, Any] | None
    keep_handover: bool
    def __len__(self) -> int: ...
    def __contains__(self, idx: int, /) -> bool: ...

# ---------------------------------------------------------------- collate.pxi

ALIGNMENT: int
MAX_DIMS: int

def stack_check(
    arrays: Iterable[ArrayLike],
) -> tuple[list[NDArray[Any]], tuple[int, ...], np.dtype[Any]]: ...
def stack_fill(arrays: list[NDArray[Any]], out: NDArray[Any]) -> int: ...
def stack(arrays: Iterable[ArrayLike], out: NDArray[Any] | None = None) -> NDArray[Any]: ...
def pad_check(
    arrays: Iterable[ArrayLike], axis: int = 0,
) -> tuple[list[NDArray[Any]], tuple[int, ...], np.dtype[Any], NDArray[np.int64]]: ...
def pad_fill(arrays: list[NDArray[Any]], out: NDArray[Any], axis: int, pattern: bytes) -> int: ...
def pad_value_bytes(val: object, dtype: DTypeLike) -> bytes: ...
@overload
def pad(
    arrays: Iterable[ArrayLike],
    axis: int = 0,
    val: object = 0,
    out: NDArray[Any] | None = None,
    ret_length: Literal[False] = False,
) -> NDArray[Any]: ...
@overload
def pad(
    arrays: Iterable[ArrayLike],
    axis: int = 0,
    val: object = 0,
    out: NDArray[Any] | None = None,
    *,
    ret_length: Literal[True],
) -> tuple[NDArray[Any], NDArray[np.int64]]: ...
@overload
def pad(
    arrays: Iterable[ArrayLike],
    axis: int,
    val: object,
    out: NDArray[Any] | None,
    ret_length: Literal[True],
) -> tuple[NDArray[Any], NDArray[np.int64]]: ...
@overload
def pad(
    arrays: Iterable[ArrayLike],
    axis: int = 0,
    val: object = 0,
    out: NDArray[Any] | None = None,
    ret_length: bool = False,
) -> NDArray[Any] | tuple[NDArray[Any], NDArray[np.int64]]: ...
def copy_into(src: NDArray[Any], out: NDArray[Any]) -> int: ...
def plan_layout(nbytes: Sequence[int], alignment: int = 64) -> tuple[NDArray[np.int64], int]: ...
def monotonic_ns() -> int: ...

TREE_MAX_DEPTH: int
TREE_DICT: int
TREE_TUPLE: int
TREE_LIST: int
TREE_ARRAY: int
TREE_OTHER: int

class SampleTree:
    @property
    def nodes(self) -> list[tuple[int, int, Any]]: ...
    @property
    def leaves(self) -> list[tuple[tuple[int, ...], np.dtype[Any]]]: ...
    @property
    def nleaves(self) -> int: ...
    @property
    def nother(self) -> int: ...
    def __new__(cls, first: object) -> Self: ...
    def gather(self, samples: list[Any]) -> TreeTable | int: ...

class TreeTable:
    @property
    def n(self) -> int: ...
    @property
    def columns(self) -> list[list[Any]]: ...
    def fill(self, buffer: Any, base_offset: int, offsets: list[int]) -> list[int]: ...
    def fill_leaf(self, j: int, out: NDArray[Any]) -> int: ...

def field_views(buffer: Any, base_offset: int, offsets: list[int],
                fields: list[Any]) -> list[NDArray[Any]]: ...

# ---------------------------------------------------------------- slab.pxi

class Slab:
    """A read-write MAP_SHARED mapping of `size` bytes of file descriptor `fd`
    (private: heap memory of this process instead)."""

    @property
    def size(self) -> int: ...
    @property
    def slab_id(self) -> Any: ...
    def __new__(cls, fd: int, size: int, slab_id: object = None, populate: bool = False,
                private: bool = False) -> Self: ...
    @property
    def shared(self) -> bool: ...
    @property
    def address(self) -> int: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...

@final
class FreeSlabs:
    """The free slabs of the main process's pool (SlabPool), compiled."""
    def __new__(cls, pooled: dict[int, Slab], counts: dict[str, int]) -> Self: ...
    def acquire(self, known: Collection[int] | None = None) -> Slab | None: ...
    def release(self, slab: Slab) -> None: ...
    def close(self) -> None: ...
    def trim(self, keep: int) -> list[Slab]: ...
    def __len__(self) -> int: ...

@final
class BatchLender:
    """The owner of each batch handed to the training loop: its slab's views, or a private copy's
    once the loop keeps `copy_from_lent` batches alive (batches of at most `copy_max_bytes`)."""
    @property
    def lent(self) -> int: ...
    copy_from_lent: int
    copy_max_bytes: int
    def __new__(cls, free: FreeSlabs, counts: dict[str, int], copy_from_lent: int,
                copy_max_bytes: int) -> Self: ...
    def owner(self, slab: Slab, nbytes: int) -> BatchOwner: ...
    def returned(self, slab: Slab) -> None: ...

class BatchOwner:
    """Owns one batch's bytes inside a slab; recycles the slab when freed."""

    @property
    def slab(self) -> Slab: ...
    @property
    def offset(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    def __new__(
        cls,
        slab: Slab,
        offset: int,
        nbytes: int,
        on_release: Callable[[Slab], object] | None = None,
    ) -> Self: ...
    def detach(self) -> None: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...

# ---------------------------------------------------------------- receive.pxi

EV_TIMEOUT: int
EV_WAKE: int
EV_FRAME: int
EV_CLOSED: int
EV_ENDED: int
EV_FD_LIMIT: int
EV_READY: int
EV_WOULD_WAIT: int
BATCH_FRAME_SIZE: int
FRAME_HEADER_SIZE: int
TASK_FRAME_FIXED_SIZE: int

class _ReceiveStats(TypedDict):
    gil_ns: int
    stored: int
    passed_up: int

def send_task(sock: int, prefix: bytes, epoch: int, batch_index: int,
              indices: bytes | NDArray[Any] | None, profiling: bool, slab_id: int, slab_size: int,
              drop_slabs: Sequence[int], slab_fd: int) -> tuple[bytes, int] | None: ...
class WorkerChannel:
    """One worker's task channel as the compiled code reads it (channel.pxi, mxload/_core.pxd)."""
    sock: Any
    tag: int
    known_slabs: set[int]
    pending_drops: list[int]
    slabs: dict[tuple[int, int], Slab | None]
    layouts: dict[int, tuple[Any, Any]]
    held: list[tuple[int, int, Any, bool]]
    def __new__(cls, *args: Any, **kwargs: Any) -> Self: ...

@final
class TaskHold:
    """The process transport's put_task: a task joins its worker's held tasks in one call."""
    per_message: int
    def __new__(cls, channels: list[Any], holding: set[int], per_message: int = 1) -> Self: ...
    def __call__(self, wid: int, task: tuple[int, int, Any, bool]) -> bool: ...

@final
class QueuePut:
    """A thread transport's put_task: a task goes into its worker's queue in one call."""
    def __new__(cls, queues: list[Any]) -> Self: ...
    def __call__(self, wid: int, task: tuple[int, int, Any, bool]) -> bool: ...

@final
class BatchSupply:
    """An epoch's batches of indices, drawn from the batch sampler as they are needed (supply.pxi)."""
    batches: Any
    skip: set[int] | None
    handed: int
    total: int | None
    expected: int | None
    what: str
    epoch: Any
    error: BaseException | None
    error_raised: bool
    def __new__(cls, batches: Any, start: int, skip: set[int] | None, total: int | None,
                expected: int | None, what: str, epoch: Any, aborted: type[BaseException],
                by_signal: Callable[[BaseException], bool] | None = None) -> Self: ...
    def peek(self) -> tuple[int, Any] | None: ...
    @property
    def at_end(self) -> bool: ...
    @property
    def length(self) -> int | None: ...
    @property
    def left(self) -> int | None: ...

class DrawnBatches:
    """A sampler's indices in batches of `size` int64 arrays, drawn as iterated (supply.pxi)."""
    rest: NDArray[np.int64] | None
    def __new__(cls, indices: Iterator[Any], size: int, carry: NDArray[np.int64], last: str) -> Self: ...
    def __iter__(self) -> Self: ...
    def __next__(self) -> NDArray[np.int64]: ...

class CheckedBatches:
    """Batches each made what the loader sends by `check(batch, position)`, the raw one held
    until checked (supply.pxi)."""
    retryable: bool
    def __new__(cls, raw: Iterator[Any], check: Callable[[Any, int], Any], position: int) -> Self: ...
    def __iter__(self) -> Self: ...
    def __next__(self) -> Any: ...

RUNNING: str
SHUTTING_DOWN: str
CLOSED: str

class _Lock(Protocol):
    def __enter__(self) -> object: ...
    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None, /) -> object: ...

class _WindowTransport(Protocol):
    """What the window calls of its transport (mxload._runtime.transport.Transport); its
    optional capabilities are bound to the window (put_task, receive, claim_raw, claim_mismatch)."""
    def next_result(self, buffer: ReorderBuffer, idx: int, any_index: bool, timeout: float | None,
                    filling: bool = False, epochs: int = -1) -> Any: ...
    def claim(self, raw: RawBatch) -> Any: ...
    def send_queued(self, worker_id: int) -> None: ...
    def flush(self) -> None: ...

class WorkerRecord:
    """The engine's view of one worker (books.pxi)."""
    alive: bool
    exhausted: bool
    outstanding: dict[tuple[int, int], NDArray[Any] | None]
    def __init__(self, alive: bool = True, exhausted: bool = False,
                 outstanding: dict[tuple[int, int], NDArray[Any] | None] | None = None) -> None: ...

class WorkerBooks:
    """The base of the engine's Roster, as the window reads it (books.pxi)."""
    workers: list[WorkerRecord]
    takers: list[int] | None
    def __new__(cls, *args: Any, **kwargs: Any) -> Self: ...
    def pick(self, idx: int, in_order: bool, stream: bool = False) -> int | None: ...
    def all_done(self) -> bool: ...

class EngineWindow:
    """One engine's prefetch window and hand-over (window.pxi): Engine owns one."""
    @property
    def lock(self) -> _Lock: ...
    @property
    def roster(self) -> WorkerBooks: ...
    @property
    def buffer(self) -> ReorderBuffer: ...
    @property
    def counts(self) -> dict[str, int]: ...
    transport: _WindowTransport
    put_task: Callable[[int, tuple[int, int, Any, bool]], bool] | None
    receive: Callable[..., Any] | None
    claim_raw: Callable[[RawBatch], Any] | None
    claim_mismatch: Callable[[RawBatch, Any], Exception] | None
    prefetch: int
    in_flight: int
    next_dispatch: int
    yielded: int
    discard: int
    state: str
    epoch: int
    supply: BatchSupply | None
    stream_indices: Any
    due: deque[int]
    in_order: bool
    profiling: bool
    timeout: float | None
    handover: Handover | None
    own_error: BaseException | None
    torn: str | None
    waited: int
    def __new__(cls, lock: _Lock, roster: WorkerBooks, buffer: ReorderBuffer, counts: dict[str, int],
                markers: tuple[object, object, object, type[object], type[Exception]], *,
                forked_error: Callable[[], BaseException], aborted_error: Callable[[], BaseException],
                timed_out: Callable[[int], BaseException],
                claim_failed: Callable[[int, Exception], BaseException],
                failure: Callable[[], BaseException | None],
                dispatch_unqueued: Callable[[int, int, NDArray[Any] | None], None]) -> Self: ...
    @property
    def forked(self) -> bool: ...
    def next_batch(self, generation: int = -1) -> Any: ...
    def claim(self, raw: RawBatch) -> Any: ...
    def dispatch_more(self) -> None: ...

def send_tasks(handle: WorkerChannel, pool: Any, prefix: bytes,
               tasks: list[tuple[int, int, bytes | NDArray[Any] | None, bool]],
               consume: bool = False) -> tuple[int, int, tuple[bytes, int] | None]: ...

class FrameReceiver:
    """Receives every worker's frames for one ReorderBuffer: the consumer in
    get(), the watcher thread in watch(), GIL released while they wait."""

    def __new__(cls, slots: int, wake_fd: int, buffer: ReorderBuffer, magic: bytes, version: int,
                batch_tag: int) -> Self: ...
    def attach(self, slot: int, sock: int, sentinel: int = -1, tag: int = 0) -> None: ...
    def detach(self, slot: int) -> None: ...
    def close(self) -> None: ...
    def get(self, idx: int, any_index: bool = False, timeout: float | None = None,
            report_wait: bool = False, epochs: int = -1) -> tuple[int, int, int, Any]: ...
    def next_result(self, idx: int, any_index: bool, timeout: float | None, filling: bool, holding: set[int],
                    before_wait: Callable[[bool], object],
                    on_event: Callable[[int, int, int], object], epochs: int = -1) -> Any: ...
    def watch(self, timeout: float) -> tuple[int, int, int]: ...
    def wait(self, timeout: float) -> tuple[int, int]: ...
    def end_gil_span(self) -> None: ...
    def drain(self, slot: int, tag: int) -> bool: ...
    def take_frame(self, slot: int) -> tuple[bytes, bytes, list[int]]: ...
    def stats(self) -> _ReceiveStats: ...

@final
class ConsumerWait:
    """A transport's receive, compiled: a FrameReceiver's next_result with holding, before_wait
    and on_event bound."""
    def __new__(cls, receiver: FrameReceiver, holding: set[int], before_wait: Callable[[bool], object],
                on_event: Callable[[int, int, int], object]) -> Self: ...
    def __call__(self, idx: int, any_index: bool, timeout: float | None, filling: bool,
                 epochs: int = -1) -> Any: ...

def build_views(
    owner: BatchOwner, specs: list[tuple[int, tuple[int, ...], np.dtype[Any]]],
) -> list[NDArray[Any]]: ...

# ---------------------------------------------------------------- handoff.pxi

VIEWS_ASSEMBLE: int
VIEWS_ONE_ARRAY: int
VIEWS_TUPLE: int

class ViewTemplate:
    """A batch layout made ready for every batch of that shape."""
    @property
    def root(self) -> Any: ...
    @property
    def specs(self) -> list[tuple[int, tuple[int, ...], np.dtype[Any]]]: ...
    @property
    def shortcut(self) -> int: ...
    def __new__(cls, root: Any, specs: list[tuple[int, tuple[int, ...], np.dtype[Any]]], shortcut: int,
                assemble: Callable[[Any, list[NDArray[Any]]], Any]) -> Self: ...
    def views(self, owner: BatchOwner) -> Any: ...

class ClaimMismatch:
    """claim_batch's answer for a frame that contradicts its task."""
    @property
    def task_slab_id(self) -> Any: ...
    def __new__(cls, task_slab_id: Any) -> Self: ...

def claim_batch(raw: RawBatch, handles: Sequence[WorkerChannel | None],
                release: Callable[[Slab], object], lender: BatchLender | None = None) -> Any: ...

@final
class RawClaim:
    """A transport's claim_raw, compiled: claim_batch with its handles, release and lender bound."""
    def __new__(cls, handles: list[Any], release: Callable[[Slab], object],
                lender: BatchLender | None = None) -> Self: ...
    def __call__(self, raw: RawBatch) -> Any: ...

@final
class Handover:
    """One epoch's hand-over of its batches to the loop (NOTE [ Signal-safe hand-over ])."""
    ready: tuple[int, Any] | None
    @property
    def pending(self) -> int: ...
    @property
    def lock(self) -> Any: ...
    def __new__(cls, taken: Callable[[int], object]) -> Self: ...
    def settle(self) -> int: ...
    def handing(self) -> int: ...

class HandingIterator:
    """The base of an iterator whose __next__ is handing_next(...)."""
    handover: Handover

_I = TypeVar("_I", bound=HandingIterator)
_R = TypeVar("_R")

def handing_next(fn: Callable[[_I], _R]) -> Callable[[_I], _R]:
    """A HandingIterator's __next__, compiled: `fn(it)` under its Handover's lock,
    between settle() and handing()."""

# ---------------------------------------------------------------- sample.pxi

class SampleContext:
    """The sample loading in this thread, for mxload.sample_rng()."""
    @property
    def seed(self) -> int: ...
    @property
    def epoch(self) -> int: ...
    @property
    def index(self) -> int | None: ...
    @property
    def load(self) -> int: ...
    def __new__(cls, seed: int, epoch: int, index: int | None = None) -> Self: ...
    def fetch_each(self, getitem: Callable[[int], _T], indices: list[int],
                   seed_each: Callable[[int], object] | None = None) -> list[_T]: ...

# ---------------------------------------------------------------- interrupt.pxi

_F = TypeVar("_F", bound=Callable[..., Any])
_T = TypeVar("_T")

def defer_sigint(fn: _F) -> _F:
    """Run fn with Ctrl-C held back (main thread), delivered once it returns."""

def sigint_safe_finalizer(fn: Callable[[_T], object]) -> Callable[[_T], None]:
    """A __del__ whose Ctrl-C is made pending again instead of ignored."""

# ---------------------------------------------------------------- watchdog.pxi

def watch_main_process(fd: int) -> None:
    """SIGKILL this process when fd's peer (held by the main process alone) hangs up."""
