"""Receiving the results of process workers: each batch arrives as a frame
naming its slab and layout; the slabs the workers made are adopted, each
batch becomes numpy views of its slab, and a worker's death is noticed at
once (its sentinel, its socket's end).

Two threads share the compiled receive path (``_core.FrameReceiver``):

* the consumer, in ``FrameReceiver.next_result`` (the transport's
  ``receive``): when the batch it needs is not in the ReorderBuffer yet, it
  reads the workers' sockets itself, with the GIL released.  A BatchRef
  goes from the socket into the buffer as a C struct, and the consumer
  makes it a batch (``claim_batch``, the transport's ``claim_raw``).  No
  other thread wakes for a batch.
* the watcher thread (``mxload-fetcher``), asleep on the workers'
  sentinels: when one ends it takes what that worker sent and reports the
  loss, so a restart begins while the consumer is still busy training.

Every other frame (pickled: errors, new slabs, new layouts) is handled in
Python by whichever of the two found it, under the engine lock, in the
order its worker sent it."""
from __future__ import annotations

import errno
import os
import pickle
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ... import _core
from ..._collate.layout import compile_template, views_from_layout
from ..._core import (
    ClaimMismatch,
    FrameReceiver,
    RawBatch,
    ReorderBuffer,
    Slab,
    claim_batch,
    defer_sigint,
)
from ...errors import SharedMemoryError, WorkerError
from .. import messages as m
from .. import os_threads
from ..os_signals import block_sigint_in_this_thread
from ..shutdown import SHUTDOWN_DEADLINE_S
from ..transport import Delivery, ResultSink
from . import fds as _fds
from . import wire
from .launcher import ProcessHandle
from .slabs import SlabPool, fd_limit_error

__all__ = ["Fetcher", "adopt_raw", "claim_mismatch_error", "retire_everywhere", "take_result"]


def _out_of_fds(error: OSError, doing: str) -> BaseException:
    """`error` as the error for running out of descriptors, if it is that."""
    if error.errno in (errno.EMFILE, errno.ENFILE):
        return fd_limit_error(doing, WorkerError)
    return error


def adopt_raw(raw: RawBatch, handles: list[ProcessHandle], pool: SlabPool) -> Any:
    """The batch the receive path stored for the worker in slot `raw.slot`,
    as views of its slab from the cached layout (compiled: claim_batch);
    None if its task is no longer that worker's handle's (engine lock held)."""
    batch = claim_batch(raw, handles, pool.release, pool.lender)
    if type(batch) is ClaimMismatch:
        raise claim_mismatch_error(raw, batch, handles)
    return batch


def claim_mismatch_error(raw: RawBatch, mismatch: ClaimMismatch, handles: list[ProcessHandle]) -> Exception:
    """What claim_batch's ClaimMismatch for `raw` says: a worker's batch contradicting its task."""
    handle = handles[raw.slot]
    return wire.ProtocolError(
        f"worker {handle.worker_id} (pid {handle.pid}) sent batch {raw.idx} in slab {raw.slab_id} with "
        f"layout {raw.layout_id}; its task had slab {mismatch.task_slab_id} and it named layouts "
        f"{sorted(handle.layouts)}")


def take_result(msg: m.Message, fds: list[int], handle: ProcessHandle, handles: Sequence[ProcessHandle],
                pool: SlabPool) -> Delivery:
    """A worker's message as the engine takes it: a batch becomes views of
    its slab (a new slab is adopted; the one it replaces, too small, is
    retired everywhere).  Takes the descriptor it uses out of `fds`."""
    if isinstance(msg, m.InitFailed):
        return msg
    if isinstance(msg, m.BatchRef):   # one the receive path could not store (stale, say)
        if msg.layout_id not in handle.layouts:
            raise wire.ProtocolError(
                f"a worker sent a BatchRef to layout {msg.layout_id}, which it never named")
        msg = m.Batch(msg.epoch, msg.batch_index, msg.slab_id, msg.nbytes,
                      handle.layouts[msg.layout_id][0], None)
    elif isinstance(msg, m.Batch) and msg.layout_id >= 0:
        handle.layouts[msg.layout_id] = (msg.layout, compile_template(msg.layout))
    if not isinstance(msg, (m.Batch, m.NewSlab, m.Failed, m.Exhausted)):
        raise wire.ProtocolError(f"a worker sent {type(msg).__name__}, not a result")
    assigned = handle.slabs.pop((msg.epoch, msg.batch_index), None)
    if isinstance(msg, m.NewSlab):
        assert fds, "recv checks that a frame carries the descriptors it announces"
        slab = pool.adopt(fds.pop(), msg.size)
        if assigned is not None:
            retire_everywhere(assigned, pool, handles)   # too small for this batch
        assigned = slab
    if not isinstance(msg, (m.Batch, m.NewSlab)):
        if assigned is not None:
            pool.release(assigned)
        return msg
    batch = _views(msg, assigned, pool)
    return m.Loaded(msg.epoch, msg.batch_index, batch, msg.timings)


def retire_everywhere(slab: Slab, pool: SlabPool, handles: Sequence[ProcessHandle]) -> None:
    """Retire `slab` from the pool, and have every worker that mapped it
    unmap it (the drops its next task carries): its memory then goes."""
    pool.retire(slab)
    for h in handles:
        if slab.slab_id in h.known_slabs:
            h.known_slabs.discard(slab.slab_id)
            h.pending_drops.append(slab.slab_id)


def _views(msg: m.Batch | m.NewSlab, slab: Slab | None, pool: SlabPool) -> object:
    if msg.nbytes == 0 or slab is None:
        if slab is not None:
            pool.release(slab)
        return views_from_layout(msg.layout, bytearray())   # writable, as a slab's views are
    # The slab returns to the pool when the batch's last view dies (or when
    # the engine drops the batch of an abandoned epoch at once), or at once
    # where the loop keeps many batches and this one is copied out.
    return views_from_layout(msg.layout, pool.lender.owner(slab, msg.nbytes))


class Fetcher:
    """The receive path of one process transport: results into the engine
    (through `sink`, under `lock`), taken by the consumer in next_result();
    a watcher thread for deaths, which can be paused (another engine forks
    its zygote) and stopped."""

    def __init__(self, sink: ResultSink, lock: threading.RLock, pool: SlabPool, buffer: ReorderBuffer,
                 slots: int, handles: Callable[[], list[ProcessHandle]],
                 on_death: Callable[[ProcessHandle], None]):
        self._sink = sink
        self._lock = lock
        self._pool = pool
        self._buffer = buffer
        self._handles = handles
        self._on_death = on_death
        self._thread: threading.Thread | None = None
        self._thread_lock = threading.Lock()   # swapping the thread (pause/resume)
        self._stop = False
        self._pause = False
        try:
            self._wake_r, self._wake_w = os.pipe()
        except OSError as e:
            raise _out_of_fds(e, "making the fetcher's wake-up pipe") from e
        _fds.own(self._wake_r)
        _fds.own(self._wake_w)
        try:
            self.receiver = FrameReceiver(slots, self._wake_r, buffer, wire.MAGIC, wire.VERSION,
                                          wire.BATCH_REF_TAG)
        except OSError as e:
            for fd in (self._wake_r, self._wake_w):
                _fds.close_fd(fd)
            raise _out_of_fds(e, "making the training loop's wake-up (eventfd)") from e
        # Worker id -> the handle attached to the receiver.  Kept across
        # threads (a pause ends one, a resume starts another): attaching again
        # would drop what the receiver holds of a channel (frames after one
        # it handed up, or half received).  Changed under the engine lock.
        self._attached: dict[int, ProcessHandle] = {}
        # Threads inside _worker_gone (the consumer too): stop() waits for them.
        self._gone_busy: set[int] = set()
        self._gone_idle = threading.Condition(lock)

    def start(self) -> None:
        with self._thread_lock:
            if self._stop:
                return
            self._pause = False
            thread = threading.Thread(target=self._loop, name="mxload-fetcher", daemon=True)
            os_threads.start(thread)
            self._thread = thread

    @property
    def running(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive()

    def pause(self) -> bool:
        """Stop the watcher thread for a moment; False if it is not running or did not stop in time."""
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
        """Take no result from now on; stop the watcher thread and join it
        (until `deadline`): its poll() is woken through the self-pipe."""
        with self._thread_lock:
            self._stop = True
            thread = self._thread
        self._wake()
        if thread is not None and thread.ident is not None and thread is not threading.current_thread():
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        me = threading.get_ident()
        with self._gone_idle:   # a consumer handling a death: let it finish before processes are ended
            self._gone_idle.wait_for(lambda: not (self._gone_busy - {me}),
                                     timeout=max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        """Detach every channel (closing descriptors the receiver holds for
        frames never taken, such as a NewSlab's arriving during shutdown) and
        release the wake-ups.  Called before the sockets are closed: a
        consumer still in next_result() (close() from another thread) then
        reads none of them."""
        with self._lock:
            self.receiver.close()
            self._attached.clear()
        for fd in (self._wake_r, self._wake_w):
            _fds.close_fd(fd)
        self._wake_r = self._wake_w = -1

    def _wake(self) -> None:
        if self._wake_w >= 0:
            try:
                os.write(self._wake_w, b"x")
            except OSError:
                pass

    # ------------------------------------------------------------------ the consumer's events

    @defer_sigint   # NOTE [ Deferred signals ]
    def handle_for_consumer(self, event: int, slot: int, tag: int) -> None:
        """_handle, in the consumer.  Whole, signals deferred: a signal
        handler's exception (a program's SIGALRM, Ctrl-C) is raised once the
        frame is handled, never taken for the frame's own error."""
        try:
            self._handle(event, slot, tag)
        except Exception as e:   # as the watcher: the epoch fails with a clear error, never hangs
            self._sink.fail(WorkerError(
                f"mxload could not take a worker's result: {type(e).__name__}: {e}"))

    # ------------------------------------------------------------------ the watcher

    def _loop(self) -> None:
        """Notice dead workers at once (their sentinels become ready), even
        while the consumer is away training."""
        block_sigint_in_this_thread()
        receiver = self.receiver
        try:
            while not (self._stop or self._pause):
                self.sync()
                event, slot, tag = receiver.watch(1.0)
                if self._stop or self._pause:
                    return
                if event == _core.EV_WAKE:
                    try:
                        os.read(self._wake_r, 64)   # a pause request's wake-up
                    except OSError:
                        pass
                elif event == _core.EV_ENDED:
                    self._handle(event, slot, tag)
        except BaseException as e:  # never die silently: the consumer must not hang
            if not self._stop:
                self._sink.fail(WorkerError(f"mxload fetcher thread failed: {type(e).__name__}: {e}"))
        finally:
            receiver.end_gil_span()

    # ------------------------------------------------------------------ either thread

    def _handle(self, event: int, slot: int, tag: int) -> None:
        """What the receiver handed up about the worker in `slot` (tagged `tag`)."""
        handle = self._attached.get(slot)
        if handle is None or handle.tag != tag:
            return   # detached (and perhaps replaced) meanwhile: handled by the other thread
        if self._stop:
            self._discard(handle, slot)
            return
        if event == _core.EV_FRAME:
            if self._receive(handle, slot):
                return
        elif event == _core.EV_FD_LIMIT:   # out of descriptors here, in the main process
            self._sink.fail(fd_limit_error("receiving a shared-memory slab's descriptor"))
            return
        # EV_CLOSED, EV_ENDED or a broken frame: the worker is gone.
        self._worker_gone(handle, slot)

    def _discard(self, handle: ProcessHandle, slot: int) -> None:
        """After stop(): no result is taken; the worker's channel is let go."""
        with self._lock:
            if self._attached.get(slot) is handle:
                self.receiver.detach(slot)
                del self._attached[slot]

    def sync(self) -> None:
        """Watch exactly the live workers (a restart replaces a handle).  A
        dead worker's descriptors are closed by the time we get here, and a
        replacement may have reused their numbers: so a slot is detached
        before its new handle is attached."""
        with self._lock:
            if self._stop:
                return
            wanted = {h.worker_id: h for h in self._handles() if h.alive and h.sock is not None}
            for wid, handle in list(self._attached.items()):
                if wanted.get(wid) is not handle:
                    self.receiver.detach(wid)
                    del self._attached[wid]
            for wid, h in wanted.items():
                if wid not in self._attached:
                    assert h.sock is not None
                    self.receiver.attach(wid, h.sock.fileno(), h.process.sentinel, h.tag)
                    self._attached[wid] = h

    def _worker_gone(self, handle: ProcessHandle, slot: int) -> None:
        """`handle`'s worker ended (or broke its channel): what it sent is
        delivered, in order, before its loss is reported (its unanswered
        tasks are then dispatched again).  Once per worker, by whichever
        thread sees it first."""
        with self._lock:
            if self._attached.get(slot) is not handle or not handle.alive:
                return
            while self.receiver.drain(slot, handle.tag):   # a frame for Python is first
                if not self._receive(handle, slot):
                    break
            self._settle(handle)
            self.receiver.detach(slot)
            del self._attached[slot]
            handle.alive = False   # sync() never attaches it again
            if self._stop:
                return   # shutting down: the shutdown reaps it
            self._gone_busy.add(threading.get_ident())
        try:
            self._on_death(handle)
            self.sync()   # its replacement
        finally:
            with self._gone_idle:
                self._gone_busy.discard(threading.get_ident())
                self._gone_idle.notify_all()

    def _settle(self, handle: ProcessHandle) -> None:
        """A dead worker's batches the receiver stored are delivered, as if
        received one by one (engine lock held)."""
        for _, raw in sorted(self._buffer.take_raw(handle.tag).items()):
            try:
                batch = adopt_raw(raw, self._handles(), self._pool)
            except wire.ProtocolError as e:
                self._sink.fail(self._main_side_error(handle, None, "taking its result", e))
                return
            if batch is not None:
                self._sink.deliver(handle.worker_id, m.Loaded(raw.epoch, raw.idx, batch, None))

    @defer_sigint
    def _receive(self, handle: ProcessHandle, slot: int) -> bool:
        """Take and handle the frame the receiver holds first for `handle`'s
        worker (taken and handled under the engine lock, so that the two
        threads keep a worker's frames in order); False if it is broken (the
        worker is treated as dead).  Whole, Ctrl-C deferred: a descriptor
        the frame carries is either adopted or closed, never dropped half way."""
        with self._lock:
            if self._attached.get(slot) is not handle:
                return True    # its end was handled meanwhile: the slot may hold its replacement
            try:
                header, data, fds = self.receiver.take_frame(slot)
            except LookupError:
                return True    # the other thread took it
            except EOFError:
                return False
            try:
                try:
                    msg = wire.decode(header, data, len(fds))
                except (EOFError, pickle.UnpicklingError):
                    return False
                except wire.ProtocolError as e:   # garbage on its channel: nothing it sends can be trusted
                    self._sink.fail(self._main_side_error(handle, None, "reading its message", e))
                    return False
                except Exception as e:   # a whole frame whose objects cannot be rebuilt here
                    self._sink.fail(self._main_side_error(handle, None, "unpickling its result", e))
                    return True
                try:
                    result = take_result(msg, fds, handle, self._handles(), self._pool)
                except Exception as e:   # mapping its slab, building its views: the batch's error
                    self._sink.fail(self._main_side_error(handle, msg, "taking its result", e))
                else:
                    self._sink.deliver(handle.worker_id, result)
            finally:
                self._close(fds)   # any the message did not take
        return True

    @staticmethod
    def _close(fds: list[int]) -> None:
        for fd in fds:
            os.close(fd)

    def _main_side_error(self, handle: ProcessHandle, msg: m.Message | None, doing: str,
                         error: Exception) -> WorkerError:
        """Without the message (it did not unpickle), the batch is the worker's
        oldest outstanding one: a worker answers its tasks in order."""
        idx: int | None = getattr(msg, "batch_index", None)
        if idx is None:
            with self._lock:
                held = self._sink.held(handle.worker_id)
            idx = held[0] if held else None
        return main_side_error(handle, idx, doing, error)


def main_side_error(handle: ProcessHandle, idx: int | None, doing: str, error: Exception) -> WorkerError:
    """An error naming the batch (`idx`) whose result failed in the main
    process while `doing`; the error's own type where it is a SharedMemoryError."""
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
