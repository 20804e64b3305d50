"""The seam between the engine and its workers: how tasks reach workers and
results come back.

The engine (engine.py) decides which batch goes to which worker, keeps the
prefetch window, the reorder buffer and the failure record; a Transport
moves tasks and results and owns the workers' lives.  Three implement it:
``local.transport.ProcessTransport`` (local processes: sockets, shared-memory slabs,
a receive path the consumer runs itself), ``threads.ThreadTransport`` (worker
threads in this process) and ``ray.transport.RayTransport`` (Ray actors, local
or on other nodes).
"""
from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from .._core import RawBatch, ReorderBuffer
from ..errors import WorkerError
from . import messages as m

if TYPE_CHECKING:
    from .messages import WorkerConfig

__all__ = ["Capabilities", "ClaimsRaw", "Delivery", "PutsTasks", "ReceivesItself", "ResultSink", "Transport",
           "TransportSetup", "WorkerLoss"]

# What a transport hands the engine for one task: the batch (as the consumer
# will see it), the batch's failure, the end of a stream, or a failed worker_init_fn.
Delivery = m.Loaded | m.Failed | m.Exhausted | m.InitFailed


@dataclass(frozen=True)
class WorkerLoss:
    """A worker that ended without being asked to."""
    worker_id: int
    pid: int | None
    exitcode: int | None
    how: str                                   # "killed by SIGKILL", "exit code 1"...
    hint: str = ""                             # appended to `how` (e.g. why SIGBUS)
    error_type: type[WorkerError] = WorkerError
    # Set when no worker can replace it: the error's text, given the batches it held.
    final: Callable[[list[int]], str] | None = None


class ResultSink(Protocol):
    """The engine, as a transport sees it.  Every call may come from any
    thread (a fetcher thread, a worker thread)."""

    def deliver(self, worker_id: int, result: Delivery) -> None:
        """One task's result, in the order the worker produced them."""

    def worker_lost(self, loss: WorkerLoss) -> None:
        """A worker ended unasked (called once per worker); the engine
        restarts it (Transport.restart) or fails the epoch."""

    def fail(self, error: BaseException) -> None:
        """Something the transport could not attribute to one task ended the epoch."""

    def held(self, worker_id: int) -> list[int]:
        """The batches of the current epoch given to `worker_id` and not answered, oldest first."""


@dataclass(frozen=True)
class TransportSetup:
    """What the engine gives a backend to make its transport (``Backend.make_transport``):
    everything a transport may need, so that a new one is its own module and its backend
    class, and the engine names none of them."""
    sink: ResultSink
    lock: threading.RLock          # the engine's (see Transport's contract)
    config: WorkerConfig           # worker 0's, for the engine's first epoch
    buffer: ReorderBuffer          # a transport whose consumer receives itself fills it
    dataset_type: str              # for error messages
    prefetch: int                  # tasks in flight in all
    timeout: float | None          # the loader's: no batch within it is an error


class Transport(ABC):
    """How tasks reach workers and results come back.

    Contract:
      * The engine passes its lock (an RLock) at construction; it holds it
        when it calls ``dispatch``/``restart``, and the transport holds it
        while it calls the sink (so a result and a dispatch never interleave).
      * ``start`` makes every worker exist, or raises having ended what it
        started.  Workers run worker_init_fn and then wait for tasks.
      * ``dispatch`` never blocks for long; a task for a dead worker is
        dropped silently (its loss is reported through ``worker_lost``).
      * Every task gets exactly one result through ``sink.deliver`` unless
        its worker is lost first; results of an abandoned epoch are still
        delivered (the engine drops them), so the transport can recycle
        what they hold.
      * Shutdown is the numbered sequence of shutdown.shutdown_sequence,
        each phase bounded by the deadline it is given: ``stop_receiving``,
        ``refuse_starts``, ``ask_to_stop``, ``end_workers``, ``release``.
        None of them raises.
    """

    #: Results cross a process boundary (the profiler says so).
    transported: bool = True
    #: Set (without the engine lock) when the epoch being served is closed:
    #: a send still waiting on a worker gives up.  begin_epoch clears it.
    epoch_closed: bool = False
    #: A send was given up half way: a worker's stream is cut, so this
    #: transport serves no further epoch (the engine is not reused).
    stream_cut: bool = False
    # Optional capabilities (PutsTasks, ReceivesItself, ClaimsRaw, below) are not slots here: a
    # transport that has one has its attributes, and the engine checks once which it has.

    def __init__(self, setup: TransportSetup):
        self.sink = setup.sink
        self.lock = setup.lock

    def counters(self) -> list[dict[str, int]]:
        """The counters this transport's components own (``loader.stats`` merges them with
        the engine's); each dict stays readable after the transport ends."""
        return []

    @abstractmethod
    def start(self) -> None:
        """Start every worker."""

    @abstractmethod
    def dispatch(self, worker_id: int, epoch: int, batch_index: int, indices: np.ndarray | None,
                 profiling: bool) -> None:
        """Send `worker_id` the task of loading batch `batch_index` of
        `epoch` (`indices`; None: a stream's next batch), timed for the
        profiler if `profiling` (engine lock held)."""

    def reusable(self) -> bool:
        """Whether these workers can serve another epoch (no stream cut)."""
        return not self.stream_cut

    def send_queued(self, worker_id: int) -> None:
        """Send what put_task took for `worker_id`, unless held for the next
        task (engine lock held).  Retry-safe: cut short by an exception, a
        second call sends what is left, never a task twice."""
        return None

    def set_window(self, window: int, workers: int) -> None:
        """num_workers="auto" moved to `window` tasks in flight over `workers`
        workers taking tasks (engine lock held): a transport that holds tasks
        back to share a message decides anew.  By default none is held."""
        return None

    def flush(self) -> None:
        """Send every task dispatch() held back to go with a later one in
        one message (engine lock held).  By default none is held."""
        return None

    def drop_held(self) -> list[tuple[int, tuple[int, int]]]:
        """Forget the tasks held back, unsent (the epoch they belong to is
        over); returns (worker id, (epoch, batch index)) of each."""
        return []

    def queued(self, worker_id: int) -> list[tuple[int, int]]:
        """(epoch, batch index) of the tasks dispatch() holds back for worker
        `worker_id`, not sent to it yet (engine lock held).  By default none."""
        return []

    def tidy_between_epochs(self) -> None:
        """A new epoch begins, none of its tasks sent yet (engine lock held):
        give back what the epochs before needed and the next will not.  By
        default there is nothing to give back."""
        return None

    @abstractmethod
    def restart(self, worker_id: int, epoch: int) -> bool:
        """Replace a lost worker, started exactly as the original was (seeded
        for `epoch`); its unanswered tasks will get no result (the engine
        sends them again).  False if shutdown began meanwhile; raises if it
        cannot start one (engine lock held)."""

    def next_result(self, buffer: ReorderBuffer, idx: int, any_index: bool, timeout: float | None,
                    filling: bool = False, epochs: int = -1) -> Any:
        """The consumer's wait: `buffer`'s item for batch `idx` (any_index:
        (index, item) of the smallest index there); `filling`: the epoch's
        first window is not taken yet, so a wait says nothing of whether the
        workers keep ahead of the loop.  By default another
        thread delivers the results, and the consumer waits in the buffer; a
        transport whose consumer receives them itself overrides this.  `epochs`:
        the buffer's count of epochs when this one began; the wait ends with
        EpochOverError once another begins (-1: never)."""
        return buffer.pop_next(timeout, epochs) if any_index else buffer.get(idx, timeout, epochs)

    def claim(self, raw: RawBatch) -> Any:
        """The batch a receive path stored raw in the ReorderBuffer (engine
        lock held), taking what its task held; None if that task is gone
        (its worker was replaced and the task will be answered again)."""
        return None

    @property
    def restartable(self) -> bool:
        """Whether a lost worker can be replaced at all."""
        return True

    @abstractmethod
    def pid(self, worker_id: int) -> int | None:
        """The worker's process id (None for a thread)."""

    def process(self, worker_id: int) -> Any:
        """The worker's local process object (pid, is_alive(), join(), exitcode: the subset of
        multiprocessing.Process the engine uses), None where it is no local process."""
        return None

    @property
    def receiving(self) -> bool:
        """Whether results can still arrive (a receiving thread runs)."""
        return True

    def describe(self, worker_id: int) -> str:
        """'alive', or why a live worker cannot be making progress (timeout messages)."""
        return "alive"

    # ---------------------------------------------------------------- shutdown phases
    # (NOTE [ Numbered shutdown ], shutdown.py: the order and the one deadline)

    @abstractmethod
    def stop_receiving(self, deadline: float) -> None:
        """No result is delivered from now on (stop and join any receiving thread)."""

    @abstractmethod
    def refuse_starts(self, deadline: float) -> None:
        """No worker starts from now on; wait (until `deadline`) for a start under way."""

    @abstractmethod
    def ask_to_stop(self) -> None:
        """Ask every worker to stop, without blocking."""

    @abstractmethod
    def end_workers(self, start: float, deadline: float) -> None:
        """Wait for the workers to end; force them (SIGTERM, SIGKILL) as the
        grace periods from `start` pass; never past `deadline`."""

    @abstractmethod
    def release(self) -> None:
        """Close channels and free what the transport holds (slabs outlive
        it while the consumer keeps batches viewing them)."""


# ------------------------------------------------------------ optional capabilities


@runtime_checkable
class PutsTasks(Protocol):
    """A transport that takes a task in one compiled step.

    ``put_task(worker_id, (epoch, batch index, indices, profiling))`` takes a task for
    `worker_id`, to be sent by send_queued(worker_id) or flush(), whichever comes first (engine
    lock held); True when send_queued(worker_id) is due.  The engine's dispatch in the training
    loop's thread puts a task with it as its last step, so that a signal handler's exception
    (raised after any call made from Python) finds the task either put and in the engine's
    books, or neither.  Without it the engine uses dispatch(), and such an exception aborts the
    epoch."""
    put_task: Callable[[int, tuple[int, int, Any, bool]], bool]


@runtime_checkable
class ReceivesItself(Protocol):
    """A transport whose consumer receives the results itself.

    ``receive(batch index, any_index, timeout, filling, epochs=...)`` is next_result's wait
    without its Python frame (the engine's compiled consumer calls it once per batch; a
    _core.ConsumerWait it calls in C).  Without it the engine calls next_result."""
    receive: Callable[..., Any]


@runtime_checkable
class ClaimsRaw(Protocol):
    """A transport whose receive path stores batches raw in the ReorderBuffer, claimed compiled.

    ``claim_raw(raw)`` is claim's batch without its Python frame, or a ClaimMismatch, which
    ``claim_mismatch(raw, mismatch)`` turns into the error to raise (a _core.RawClaim: called
    in C).  Without it the engine calls claim."""
    claim_raw: Callable[[RawBatch], Any]

    def claim_mismatch(self, raw: RawBatch, mismatch: Any) -> Exception:
        """The error of a raw batch that contradicts its task."""


@dataclass(frozen=True)
class Capabilities:
    """The optional capabilities of one started transport, checked once (Engine binds them to
    its compiled window, which calls them without asking again); None: not this transport's."""
    put_task: Callable[[int, tuple[int, int, Any, bool]], bool] | None
    receive: Callable[..., Any] | None
    claim_raw: Callable[[RawBatch], Any] | None
    claim_mismatch: Callable[[RawBatch, Any], Exception] | None

    @classmethod
    def of(cls, transport: Transport) -> Capabilities:
        claims = transport if isinstance(transport, ClaimsRaw) else None
        return cls(put_task=transport.put_task if isinstance(transport, PutsTasks) else None,
                   receive=transport.receive if isinstance(transport, ReceivesItself) else None,
                   claim_raw=claims.claim_raw if claims is not None else None,
                   claim_mismatch=claims.claim_mismatch if claims is not None else None)
