"""The fetcher thread of a process transport: receives the workers'
results, adopts the slabs they made, turns each batch into numpy views of
its slab, and notices a worker's death at once (its sentinel)."""
from __future__ import annotations

import os
import pickle
import select
import selectors
import threading
import time
from collections.abc import Callable, Sequence

from .._collate.layout import views_from_layout
from .._core import BatchOwner, Slab
from ..errors import SharedMemoryError, WorkerError
from . import fds as _fds
from . import messages as m
from .lifecycle import SHUTDOWN_DEADLINE_S, ProcessHandle
from .procs import block_sigint_in_this_thread
from .slabs import SlabPool
from .transport import Delivery, ResultSink

__all__ = ["Fetcher", "take_result"]


def take_result(msg: m.Message, fds: list[int], handle: ProcessHandle, handles: Sequence[ProcessHandle],
                pool: SlabPool) -> Delivery:
    """A worker's message as the engine takes it: a batch becomes views of
    its slab (a new slab is adopted; the one it replaces, too small, is
    retired everywhere).  Takes the descriptor it uses out of `fds`."""
    if isinstance(msg, m.InitFailed):
        return msg
    if not isinstance(msg, (m.Batch, m.NewSlab, m.Failed, m.Exhausted)):
        raise m.ProtocolError(f"a worker sent {type(msg).__name__}, not a result")
    assigned = handle.slabs.pop((msg.epoch, msg.batch_index), None)
    if isinstance(msg, m.NewSlab):
        assert fds, "recv checks that a frame carries the descriptors it announces"
        slab = pool.adopt(fds.pop(), msg.size)
        if assigned is not None:
            # Too small for this batch: retire it everywhere.
            pool.retire(assigned)
            for h in handles:
                if assigned.slab_id in h.known_slabs:
                    h.known_slabs.discard(assigned.slab_id)
                    h.pending_drops.append(assigned.slab_id)
        assigned = slab
    if not isinstance(msg, (m.Batch, m.NewSlab)):
        if assigned is not None:
            pool.release(assigned)
        return msg
    batch = _views(msg, assigned, pool)
    return m.Loaded(msg.epoch, msg.batch_index, batch, msg.timings)


def _views(msg: m.Batch | m.NewSlab, slab: Slab | None, pool: SlabPool) -> object:
    if msg.nbytes == 0 or slab is None:
        if slab is not None:
            pool.release(slab)
        return views_from_layout(msg.layout, b"")
    # The slab returns to the pool when the batch's last view dies (or when
    # the engine drops the batch of an abandoned epoch at once).
    return views_from_layout(msg.layout, BatchOwner(slab, 0, msg.nbytes, pool.release))


class Fetcher:
    """One thread moving results into the engine (through `sink`, under
    `lock`); it can be paused (another engine forks its zygote) and stopped."""

    def __init__(self, sink: ResultSink, lock: threading.RLock, pool: SlabPool,
                 handles: Callable[[], list[ProcessHandle]], on_death: Callable[[ProcessHandle], None]):
        self._sink = sink
        self._lock = lock
        self._pool = pool
        self._handles = handles
        self._on_death = on_death
        self._thread: threading.Thread | None = None
        self._thread_lock = threading.Lock()   # swapping the thread (pause/resume)
        self._stop = False
        self._pause = False
        self._wake_r, self._wake_w = os.pipe()
        _fds.own(self._wake_r)
        _fds.own(self._wake_w)

    def start(self) -> None:
        with self._thread_lock:
            if self._stop:
                return
            self._pause = False
            thread = threading.Thread(target=self._loop, name="mxload-fetcher", daemon=True)
            thread.start()
            self._thread = thread

    @property
    def running(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive()

    def pause(self) -> bool:
        """Stop the thread for a moment; False if it is not running or did not stop in time."""
        with self._thread_lock:
            thread = self._thread
            if thread is None or not thread.is_alive() or self._stop:
                return False
            self._pause = True
            self._wake()
            thread.join(timeout=SHUTDOWN_DEADLINE_S)
            if thread.is_alive():
                self._pause = False   # busy (e.g. starting a worker): let it be
                return False
            return True

    def stop(self, deadline: float) -> None:
        """Stop the thread and join it (until `deadline`): its select() is
        woken through the self-pipe, never left blocked on a worker socket."""
        with self._thread_lock:
            self._stop = True
            thread = self._thread
        self._wake()
        if thread is not None and thread.ident is not None and thread is not threading.current_thread():
            thread.join(timeout=max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        for fd in (self._wake_r, self._wake_w):
            _fds.close_fd(fd)
        self._wake_r = self._wake_w = -1

    def _wake(self) -> None:
        if self._wake_w >= 0:
            try:
                os.write(self._wake_w, b"x")
            except OSError:
                pass

    def _loop(self) -> None:
        """Move worker results into the engine and notice dead workers at
        once (their sentinels become ready)."""
        block_sigint_in_this_thread()
        selector = selectors.DefaultSelector()
        registered: dict[int, tuple[ProcessHandle, int, int]] = {}
        try:
            selector.register(self._wake_r, selectors.EVENT_READ, None)
            while not (self._stop or self._pause):
                self._sync(selector, registered)
                events = selector.select(timeout=1.0)
                if self._stop or self._pause:
                    return
                dead: list[ProcessHandle] = []
                for key, _ in events:
                    if key.data is None:
                        try:
                            os.read(self._wake_r, 64)   # a pause request's wake-up
                        except OSError:
                            pass
                        continue
                    what, handle = key.data
                    if handle in dead:
                        continue
                    if what == "sock":
                        # One message per readiness event: the selector is
                        # level-triggered, so more data wakes us again.
                        if not self._receive(handle):
                            dead.append(handle)
                    else:  # sentinel: the process ended; take what it sent first
                        while self._receive(handle, only_if_ready=True):
                            pass
                        dead.append(handle)
                for handle in dead:
                    if handle.alive:
                        self._on_death(handle)
        except BaseException as e:  # never die silently: the consumer must not hang
            if not self._stop:
                self._sink.fail(WorkerError(f"mxload fetcher thread failed: {type(e).__name__}: {e}"))
        finally:
            selector.close()

    def _sync(self, selector: selectors.BaseSelector,
              registered: dict[int, tuple[ProcessHandle, int, int]]) -> None:
        """Watch exactly the live workers (a restart replaces a handle).
        `registered` maps worker id -> (handle, socket fd, sentinel fd).  A
        dead worker's descriptors are closed by the time we get here, and a
        replacement may have reused their numbers (several workers can die
        in one round): so first unregister every stale entry, by number,
        then register the new ones."""
        with self._lock:
            handles = self._handles()
        wanted = {h.worker_id: h for h in handles if h.alive and h.sock is not None}
        for wid, (handle, *fds) in list(registered.items()):
            if wanted.get(wid) is not handle:
                for fd in fds:
                    try:
                        selector.unregister(fd)
                    except (KeyError, ValueError):
                        pass
                del registered[wid]
        for wid, h in wanted.items():
            if wid not in registered:
                assert h.sock is not None
                sock_fd, sentinel = h.sock.fileno(), h.process.sentinel
                selector.register(sock_fd, selectors.EVENT_READ, ("sock", h))
                selector.register(sentinel, selectors.EVENT_READ, ("sentinel", h))
                registered[wid] = (h, sock_fd, sentinel)

    def _receive(self, handle: ProcessHandle, only_if_ready: bool = False) -> bool:
        """Handle one message from `handle`'s worker; False if its channel is
        closed or broken, i.e. the worker died, even in the middle of a
        message (or, with only_if_ready, if nothing is waiting)."""
        sock = handle.sock
        if sock is None:
            return False
        try:
            if only_if_ready and not select.select([sock], [], [], 0)[0]:
                return False
            msg, fds = m.recv(sock)
        except (EOFError, OSError, pickle.UnpicklingError):
            return False
        except SharedMemoryError as e:   # out of descriptors here, in the main process
            self._sink.fail(e)
            return False
        except m.ProtocolError as e:   # garbage on its channel: nothing it sends can be trusted
            self._sink.fail(self._main_side_error(handle, None, "reading its message", e))
            return False
        except Exception as e:   # a whole frame whose objects cannot be rebuilt here
            self._sink.fail(self._main_side_error(handle, None, "unpickling its result", e))
            return True
        try:
            with self._lock:
                try:
                    result = take_result(msg, fds, handle, self._handles(), self._pool)
                except Exception as e:   # mapping its slab, building its views: the batch's error
                    self._sink.fail(self._main_side_error(handle, msg, "taking its result", e))
                else:
                    self._sink.deliver(handle.worker_id, result)
        finally:
            for fd in fds:   # any the message did not take
                os.close(fd)
        return True

    def _main_side_error(self, handle: ProcessHandle, msg: m.Message | None, doing: str,
                         error: Exception) -> WorkerError:
        """An error naming the batch whose result failed in the main process.
        Without the message (it did not unpickle) it is the worker's oldest
        outstanding batch: a worker answers its tasks in order."""
        idx: int | None = getattr(msg, "batch_index", None)
        if idx is None:
            with self._lock:
                held = self._sink.held(handle.worker_id)
            idx = held[0] if held else None
        error_type = SharedMemoryError if isinstance(error, SharedMemoryError) else WorkerError
        hint = (" (classes of objects a batch carries must be importable in the main process: "
                "define them in a module, not in a worker-only or __main__-only place)"
                if doing.startswith("unpickling") else "")
        err = error_type(f"mxload could not take batch {idx} from worker {handle.worker_id} "
                         f"(pid {handle.pid}) in the main process while {doing}: "
                         f"{type(error).__name__}: {error}{hint}",
                         handle.worker_id, handle.pid, None, idx)
        err.__cause__ = error
        return err
