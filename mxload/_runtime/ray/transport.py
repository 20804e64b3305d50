"""Ray actors as a loader's workers (backend="ray"): the Transport for them.

Tasks are actor calls (``LoaderActor.load``, actor.py), one ObjectRef
each; an actor runs its calls in order, one at a time.  Every ref's
completion (``ObjectRef.future()``, whose callback runs in Ray's own thread
and only queues it) wakes this transport's fetcher thread, which turns the
result into a Delivery: a RemoteBatch becomes numpy views of the object
store's copy of its buffer (no copy on the trainer's node), and the ref is
dropped at once, so the object store frees the batch when the consumer drops
its arrays.  No polling: a result is handed on as soon as Ray has it.

Losing an actor (its process or its node died): its refs fail one by one.
The first failure marks the actor lost (no more tasks go to it); its loss is
reported to the engine once every one of its refs has resolved, or after
LOSS_DRAIN_S, whichever comes first.  Results that arrived meanwhile are
delivered; what the engine then sends again to a replacement is exactly the
tasks without a result, and a late result of a reported actor is dropped,
so every batch is delivered exactly once.

Shutdown (shutdown.shutdown_sequence): the fetcher stops, every actor this
transport ever made is killed (``ray.kill``, its pending calls fail), then
probed until Ray reports it dead (bounded by the shutdown deadline), and
every ref is dropped.  An atexit hook, registered after Ray's own, kills the
actors before ``ray.shutdown`` runs at interpreter exit.
"""
from __future__ import annotations

import atexit
import dataclasses
import queue
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import numpy as np

from ..._collate.layout import views_from_layout
from ...errors import WorkerError
from .. import messages as m
from .. import os_threads
from ..os_signals import block_sigint_in_this_thread, process_state
from ..transport import Transport, TransportSetup, WorkerLoss
from .actor import LoaderActor
from .errors import creation_error, first_line, plain

if TYPE_CHECKING:
    from ...backends import RayBackend

__all__ = ["RayTransport", "connect"]

# After an actor's first failed call, how long its other calls may take to
# resolve (they fail as fast as Ray learns of the death) before its loss is
# reported anyway; their late results are then dropped.
LOSS_DRAIN_S = 0.5
# The fetcher wakes this often without a result, to report a drained loss.
_FETCH_POLL_S = 0.05

_RAY_MISSING = ("backend='ray' needs Ray in this environment: pip install 'mxload[ray]' "
                "(or pip install ray)")


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise ImportError(_RAY_MISSING) from e
    return ray


def connect(backend: RayBackend) -> Any:
    """The ray module, connected: the current connection, else ``ray.init``
    (the backend's address, or a new local instance without its dashboard)."""
    ray = _import_ray()
    if not ray.is_initialized():
        import os
        if backend.address is None and not os.environ.get("RAY_ADDRESS"):
            ray.init(include_dashboard=False)
        else:
            ray.init(address=backend.address)
    return ray


class _Writable:
    """Lends numpy a writable view of the object store's read-only copy of a
    batch buffer: nobody else reads that copy (its ref is dropped when it
    arrives), and local workers' batches are writable too."""
    __slots__ = ("__array_interface__", "base")

    def __init__(self, buffer: np.ndarray):
        self.base = buffer   # keeps the object store's copy mapped while views exist
        self.__array_interface__ = {"data": (buffer.ctypes.data, False), "shape": buffer.shape,
                                    "typestr": "|u1", "version": 3}


def _outcome(future: Future[Any]) -> tuple[Any, BaseException | None]:
    """A resolved call's value, or its error, without raising the error:
    raised and caught here, its traceback would hold the fetcher's frames
    in a reference cycle (the error is a local of the frame it names), and
    with them the transport and any completion a frame held, an ObjectRef
    among them, until a garbage collection (CI once found a reference still
    held after a node's death)."""
    error = future.exception(timeout=0)
    return (None, error) if error is not None else (future.result(timeout=0), None)


def _writable(buffer: np.ndarray) -> np.ndarray:
    return buffer if buffer.flags.writeable else np.asarray(_Writable(buffer))


# A call that resolved: (actor, its ObjectRef, its task or None for ready(), the future).
_Completion = tuple["_Actor", Any, "m.Task | None", "Future[Any]"]


class _Gate:
    """A lock with a flag: whether completions may still be queued."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.open = True

    def __enter__(self) -> None:
        self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


@dataclasses.dataclass(eq=False)
class _Actor:
    """The trainer's view of one actor: one incarnation of worker `worker_id`."""
    worker_id: int
    handle: Any
    ready: bool = False
    pid: int | None = None
    node_id: str | None = None
    node_ip: str | None = None
    local: bool = False          # on the trainer's node: same pid namespace and clock
    # Another node's monotonic clock minus ours lies within [low, high]: every
    # batch narrows it (it started after we sent the task, and was sent
    # before we received it); the middle is the estimate (as NTP's).
    offset_low: int | None = None
    offset_high: int | None = None
    # ObjectRef -> (task, when it was sent, ns)
    pending: dict[Any, tuple[m.Task, int]] = dataclasses.field(default_factory=dict)
    lost: str | None = None      # why, once a call failed
    lost_at: float = 0.0
    unstartable: bool = False
    created_failed: bool = False  # its creation task raised (errors.creation_error says what)
    reported: bool = False

    def name(self) -> str:
        actor_id = self.handle._actor_id.hex()[:12] if self.handle is not None else "?"
        where = f"node {self.node_ip} ({self.node_id[:12]})" if self.node_id else "no node yet"
        return f"Ray actor {actor_id} on {where}"

    def started(self, ready: m.ActorReady, our_node_id: str | None) -> None:
        """Its ready() answered: where it runs."""
        self.ready = True
        self.pid, self.node_id, self.node_ip = ready.pid, ready.node_id, ready.node_ip
        self.local = ready.node_id == our_node_id

    def describe(self, requirements: Callable[[], str]) -> str:
        """Its state for the timeout error."""
        if not self.ready:
            return (f"{self.name()}: not started yet (Ray has not placed it: the cluster may lack "
                    f"{requirements()} for it)")
        if self.local and self.pid is not None:
            # On this node: its process says whether it can be making
            # progress ("stopped": the timeout error adds the SIGCONT hint).
            state = process_state(self.pid)
            if state != "alive":
                return f"{state} ({self.name()}, pid {self.pid})"
        return f"alive ({self.name()}, pid {self.pid})"

    def on_our_clock(self, timings: m.Timings, dispatched: int, received: int) -> m.Timings:
        """A batch's worker times moved onto this process's clock (the profiler's stages need them)."""
        low, high = timings.sent_ns - received, timings.start_ns - dispatched
        self.offset_low = low if self.offset_low is None else max(self.offset_low, low)
        self.offset_high = high if self.offset_high is None else min(self.offset_high, high)
        offset = (self.offset_low + self.offset_high) // 2 \
            if self.offset_high >= self.offset_low else self.offset_low
        return timings._replace(start_ns=timings.start_ns - offset, sent_ns=timings.sent_ns - offset)

    def locate(self) -> None:
        """Where Ray had placed it, when it was lost before it answered
        ready(), for the error message (Ray's actor table; best effort)."""
        try:
            from ray._private.state import state
            record = state.actor_table(self.handle._actor_id.hex())
            address = record.get("Address") or {}
            self.node_id = address.get("NodeID") or None
            self.node_ip = address.get("IPAddress") or None
            self.pid = record.get("Pid") or None
        except Exception:
            pass

    def loss(self) -> WorkerLoss:
        """Its loss, as the engine is told of it."""
        how = f"{self.name()}, pid {self.pid}: {self.lost}"
        final = None
        if self.unstartable:
            # A creation error says itself what to do; Ray's own refusals (a runtime_env
            # that did not set up, resources no node has) are the backend's settings.
            advice = "" if self.created_failed else "; check RayBackend's resources and runtime_env"

            def final(held: list[int]) -> str:
                return (f"mxload worker {self.worker_id} could not start ({how}) while holding batches "
                        f"{held}{advice}")
        return WorkerLoss(self.worker_id, self.pid, None, how, final=final)


class RayTransport(Transport):
    """Workers are Ray actors; results come back through Ray's object store."""

    transported = True

    def __init__(self, setup: TransportSetup, backend: RayBackend):
        super().__init__(setup)
        config = self._config = setup.config
        self._backend = backend
        self._dataset_type = setup.dataset_type
        self._ray: Any = None
        self._actor_class: Any = None
        self._payload: list[Any] = []          # [ObjectRef] of the user's objects, put once
        self._actors: list[_Actor | None] = [None] * config.num_workers
        self._all: list[_Actor] = []            # every incarnation, until shutdown ends them
        self._done: queue.SimpleQueue[_Completion | None] = queue.SimpleQueue()
        # Closed at release: a call resolving later (a killed actor's) then
        # leaves nothing queued, so no reference outlives the shutdown.
        self._gate = _Gate()
        self._fetcher: threading.Thread | None = None
        self._stopping = False
        self._closing = False
        self._ray_gone = False   # Ray was shut down under this loader (reported once)
        self._node_id: str | None = None
        self._job: str | None = None
        self._exit_hook: Any = None

    # ---------------------------------------------------------------- start

    def start(self) -> None:
        ray = self._ray = connect(self._backend)
        self._node_id = ray.get_runtime_context().get_node_id()
        self._job = ray.get_runtime_context().get_job_id()
        try:
            self._payload = [ray.put(self._config.payload)]
        except Exception as e:
            raise TypeError(f"the dataset ({self._dataset_type}), batchify_fn or worker_init_fn cannot be "
                            f"serialized for Ray workers: {type(e).__name__}: {e}") from e
        self._actor_class = ray.remote(LoaderActor).options(**self._backend.actor_options())
        # The config travels without the payload: each actor fetches that one object itself.
        self._config = dataclasses.replace(self._config, payload=b"")
        with self.lock:
            for wid in range(len(self._actors)):
                self._start_actor(wid, self._config.epoch)
        self._fetcher = threading.Thread(target=self._fetch_loop, name="mxload-ray-fetcher", daemon=True)
        os_threads.start(self._fetcher)
        # Registered after Ray's own atexit hook (ray.init ran above), so it runs first.
        ref = weakref.ref(self)

        def at_exit() -> None:
            transport = ref()
            if transport is not None:
                transport.ask_to_stop()
        self._exit_hook = at_exit
        atexit.register(at_exit)

    def _start_actor(self, wid: int, epoch: int) -> _Actor:
        config = dataclasses.replace(self._config, worker_id=wid, epoch=epoch)
        actor = _Actor(wid, self._actor_class.remote(config, self._payload))
        self._actors[wid] = actor
        self._all.append(actor)
        self._watch(actor, actor.handle.ready.remote(), None)
        return actor

    def _watch(self, actor: _Actor, ref: Any, task: m.Task | None) -> None:
        """Queue `ref`'s completion for the fetcher (task None: the actor's ready call)."""
        if task is not None:
            actor.pending[ref] = (task, time.monotonic_ns())
        done, gate = self._done, self._gate

        def completed(future: Future[Any]) -> None:   # Ray's thread: queue it, unless released
            with gate:
                if gate.open:
                    done.put((actor, ref, task, future))
        ref.future().add_done_callback(completed)

    # ---------------------------------------------------------------- tasks

    def dispatch(self, worker_id: int, epoch: int, batch_index: int, indices: np.ndarray | None,
                 profiling: bool) -> None:
        actor = self._actors[worker_id]
        if actor is None or actor.lost is not None or self._closing:
            return   # its loss is (being) reported; the engine sends the task again or fails
        task = m.Task(epoch, batch_index, indices, profiling=profiling)
        try:
            ref = actor.handle.load.remote(task)
        except Exception as e:   # Ray's bare "Failed to submit task to actor": never out of next()
            if not self._ray_running():
                return
            self._lose(actor, e)
            return
        self._watch(actor, ref, task)

    def reusable(self) -> bool:
        """Not once Ray was shut down, or shut down and started again (its
        job changed): these actors and the dataset's object are gone, and a
        new engine starts new ones in the Ray that runs now."""
        try:
            ray = self._ray
            return bool(ray.is_initialized()) and ray.get_runtime_context().get_job_id() == self._job
        except Exception:
            return False

    def _ray_running(self) -> bool:
        """False (and the epoch failed, once, saying so) if Ray was shut down
        under this loader: its actors and their results are gone, and no
        result will ever come (engine lock held, or the fetcher thread)."""
        try:
            running = bool(self._ray.is_initialized())
        except Exception:
            running = False
        if not running and not self._ray_gone:
            self._ray_gone = True
            actors = "; ".join(f"worker {a.worker_id}: {a.name()}" for a in self._actors if a is not None)
            self.sink.fail(WorkerError(
                f"Ray was shut down (ray.shutdown(), or its cluster went away) while this loader's actors "
                f"were serving an epoch: they are gone ({actors}). Iterate the loader again once Ray is "
                f"running (ray.init()) to start new actors; shut Ray down only after the loader is done"))
        return running

    def restart(self, worker_id: int, epoch: int) -> bool:
        if self._closing:
            return False
        self._start_actor(worker_id, epoch)
        return True

    def pid(self, worker_id: int) -> int | None:
        """The actor's pid when it runs on this node (None elsewhere: it means
        nothing here; error messages name its node and pid)."""
        actor = self._actors[worker_id]
        return actor.pid if actor is not None and actor.local else None

    def describe(self, worker_id: int) -> str:
        actor = self._actors[worker_id]
        return "not started" if actor is None else actor.describe(self._requirements)

    def _requirements(self) -> str:
        needs = {"CPU": self._backend.num_cpus_per_worker, **dict(self._backend.resources or {})}
        try:
            free = {k: v for k, v in self._ray.available_resources().items() if k in needs}
        except Exception:
            free = {}
        return f"the resources each worker asks for, {needs} (free now: {free})"

    # ---------------------------------------------------------------- results (fetcher thread)

    def _fetch_loop(self) -> None:
        block_sigint_in_this_thread()
        try:
            while not self._stopping and self._handle_next():
                self._report_drained_losses()
        except BaseException as e:   # never die silently: the consumer must not hang
            if not self._stopping:
                self.sink.fail(WorkerError(f"mxload Ray fetcher thread failed: {type(e).__name__}: "
                                           f"{plain(str(e))}"))

    def _handle_next(self) -> bool:
        """Handle the next completion, if one comes within _FETCH_POLL_S;
        False once the fetcher is to end.  The completion lives in this
        frame only, never in the loop's (see _outcome)."""
        try:
            item = self._done.get(timeout=_FETCH_POLL_S)
        except queue.Empty:
            return self._ray_running()
        if item is None or self._stopping:
            return False
        self._completed(*item)
        return True

    def _completed(self, actor: _Actor, ref: Any, task: m.Task | None, future: Future[Any]) -> None:
        ray = self._ray
        value, error = _outcome(future)
        del future
        received = time.monotonic_ns()
        with self.lock:
            dispatched = actor.pending.pop(ref, (None, 0))[1]
            del ref
            if self._stopping or actor.reported:
                return   # the engine already sent this actor's tasks elsewhere
            if task is None:   # the actor's ready() call
                if error is not None:
                    self._lose(actor, error)
                else:
                    actor.started(value, self._node_id)
                    if value.init_failed is not None:
                        self.sink.deliver(actor.worker_id, value.init_failed)
                return
            if error is None:
                self.sink.deliver(actor.worker_id, _delivery(actor, value, dispatched, received))
            elif isinstance(error, ray.exceptions.RayTaskError):
                # Ray could not return the result (e.g. it did not serialize): that batch's error.
                cause = error.cause if isinstance(error.cause, BaseException) else error
                self.sink.deliver(actor.worker_id, m.Failed(task.epoch, task.batch_index,
                                                            m.ExceptionInfo.of(cause)))
            else:
                self._lose(actor, error)

    def _lose(self, actor: _Actor, error: BaseException) -> None:
        """A call failed because the actor (or its node) is gone (engine lock held)."""
        if not self._ray_running():
            return   # Ray itself was shut down: the epoch failed saying so, not as this actor's death
        if actor.lost is None:
            created = creation_error(error)
            actor.created_failed = created is not None
            actor.lost = (f"its creation failed: {created}" if created is not None
                          else f"{type(error).__name__}: {first_line(error)}")
            actor.lost_at = time.monotonic()
            # Ray could not make it at all (its runtime_env, an unschedulable request):
            # a replacement would fail alike.
            actor.unstartable = (getattr(error, "actor_init_failed", False)
                                 or isinstance(error, (self._ray.exceptions.RuntimeEnvSetupError,
                                                       self._ray.exceptions.ActorUnschedulableError)))
            if actor.node_id is None:
                actor.locate()
            try:
                self._ray.kill(actor.handle, no_restart=True)   # "unavailable" may mean alive but cut off
            except Exception:
                pass
        self._report_if_drained(actor, time.monotonic())

    def _report_drained_losses(self) -> None:
        now = time.monotonic()
        with self.lock:
            for actor in self._actors:
                if actor is not None and actor.lost is not None and not actor.reported:
                    self._report_if_drained(actor, now)

    def _report_if_drained(self, actor: _Actor, now: float) -> None:
        if actor.reported or (actor.pending and now - actor.lost_at < LOSS_DRAIN_S):
            return
        actor.reported = True
        actor.pending.clear()   # whatever resolves late is dropped: the engine sends it again
        self.sink.worker_lost(actor.loss())

    # ---------------------------------------------------------------- shutdown phases
    # (NOTE [ Numbered shutdown ], shutdown.py: the order and the one deadline)

    def stop_receiving(self, deadline: float) -> None:
        self._stopping = True
        self._done.put(None)
        fetcher = self._fetcher
        if fetcher is not None and fetcher.ident is not None and fetcher is not threading.current_thread():
            fetcher.join(timeout=max(0.0, deadline - time.monotonic()))

    def refuse_starts(self, deadline: float) -> None:
        self._closing = True

    def ask_to_stop(self) -> None:
        """Kill every actor (Ray fails their pending calls); queued work is never done.
        Not once Ray was shut down (or replaced): the actors went with it, and
        ray.kill() would start a new local Ray (Ray's auto-init), seconds long
        and a Ray the user had just shut down running again."""
        if not self.reusable():
            return
        for actor in list(self._all):
            try:
                self._ray.kill(actor.handle, no_restart=True)
            except Exception:
                pass   # already dead, or Ray is shut down (interpreter exit)

    def end_workers(self, start: float, deadline: float) -> None:
        """Wait until Ray knows every actor is dead: a call made after
        ray.kill fails only then (not once Ray is gone: see ask_to_stop)."""
        if not self.reusable():
            return
        probes = []
        for actor in self._all:
            try:
                probes.append(actor.handle.ready.remote())
            except Exception:
                pass
        if probes:
            try:
                self._ray.wait(probes, num_returns=len(probes), timeout=max(0.0, deadline - time.monotonic()),
                               fetch_local=False)
            except Exception:
                pass

    def release(self) -> None:
        if self._exit_hook is not None:
            atexit.unregister(self._exit_hook)
            self._exit_hook = None
        with self._gate:
            self._gate.open = False
            while True:   # completions queued by Ray's callbacks hold refs and results
                try:
                    self._done.get_nowait()
                except queue.Empty:
                    break
        for actor in self._all:
            actor.pending.clear()
            actor.handle = None
        self._all.clear()
        self._actors = [None] * len(self._actors)
        self._payload = []
        self._actor_class = None


def _delivery(actor: _Actor, result: m.RemoteBatch | m.Failed | m.Exhausted, dispatched: int,
              received: int) -> Any:
    """What the engine gets for an actor's result: a batch as views of its buffer (its timings on
    this process's clock where the actor runs on another node), or the result itself."""
    if not isinstance(result, m.RemoteBatch):
        return result
    buffer = _writable(result.buffer) if result.buffer is not None else bytearray()
    timings = result.timings
    if timings is not None and not actor.local:
        timings = actor.on_our_clock(timings, dispatched, received)
    return m.Loaded(result.epoch, result.batch_index, views_from_layout(result.layout, buffer), timings)
