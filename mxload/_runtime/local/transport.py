"""The process transport: worker processes on this machine, one socket per worker for tasks
and results (wire.py), batches in pooled shared-memory slabs (slabs.py), the receive
path and the watcher thread (receiver.py), lives managed by the launcher (launcher.py)."""
from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

import numpy as np

from ..._core import (
    ClaimMismatch,
    ConsumerWait,
    RawBatch,
    RawClaim,
    ReorderBuffer,
    TaskHold,
    defer_sigint,
    send_tasks,
)
from ...errors import SHARED_MEMORY_ADVICE, LoaderTimeoutError, SharedMemoryError
from .. import messages as m
from ..os_signals import process_state
from ..transport import Transport, TransportSetup, WorkerLoss
from . import launcher, wire
from .launcher import (
    UNGUARDED_MAIN_HINT,
    Closing,
    Launcher,
    Process,
    ProcessHandle,
    describe_exit,
    outside_main_guard,
)
from .pairing import Pairing
from .receiver import Fetcher, adopt_raw, claim_mismatch_error, retire_everywhere
from .slabs import COPY_KEPT_FROM, SlabPool

# Slab descriptors the main process keeps for recycling (beyond this, kept
# batches cost a mapping each, never a descriptor; see SlabPool).
MAX_POOLED_SLABS = 64
# Free slabs kept between epochs beyond the window's: those the loop holds (the batch in hand, one
# on its way to an accelerator) and one being recycled.  The rest, freed after a loop kept many
# batches a while, are retired as an epoch begins once no batch needed them since the last one
# began (FreeSlabs.trim), in this process and in the workers.
SPARE_SLABS = 4

__all__ = ["MAX_POOLED_SLABS", "ProcessTransport", "SPARE_SLABS"]


class ProcessTransport(Transport):

    def __init__(self, setup: TransportSetup, start_method: str | None):
        super().__init__(setup)
        self._buffer = setup.buffer
        # Tasks that go to one worker in one message (pairing.py): a task waits (held on its
        # handle) for the next ones of its worker while the consumer is served from the buffer,
        # and goes at once when it would wait (next_result), when the epoch has no more tasks,
        # or after a restart.
        self.counts = {"tasks_sent": 0, "task_messages": 0, "pairing_stops": 0}
        self._handles: list[ProcessHandle] = []    # by worker id (restarts replace one in place)
        self._holding: set[int] = set()            # ids of the workers with tasks held
        # put_task, compiled; its per_message is how many tasks go in one message now.
        self.put_task: TaskHold = TaskHold(self._handles, self._holding)
        self.pairing = Pairing()
        self._timeout = setup.timeout               # the loader's: also bounds a task's send
        self._stopping = False                      # the shutdown began: a send waiting on a worker gives up
        self._config = setup.config
        self.launcher = Launcher(setup.config, start_method, setup.dataset_type, owner=self)
        self.pool = SlabPool(MAX_POOLED_SLABS)
        self.set_window(setup.prefetch, setup.config.num_workers)
        # The engine's compiled claim: the views of a raw batch's slab.
        self.claim_raw = RawClaim(self._handles, self.pool.release, self.pool.lender)
        self._fetcher: Fetcher | None = None
        self._ending: list[Process] | None = None   # what refuse_starts left to end

    @property
    def start_method(self) -> str:
        """How the workers, and their replacements, are started."""
        return self.launcher.start_method

    @property
    def zygote_pid(self) -> int | None:
        """The pid of the process that forks the workers (start method fork)."""
        return self.launcher.zygote_pid

    def set_window(self, window: int, workers: int) -> None:
        """`window` tasks in flight over `workers` workers taking tasks: how tasks pair from now
        on (pairing.py)."""
        # Batches in the reorder buffer are lent too: the loop keeps batches beyond the window's.
        self.pool.lender.copy_from_lent = COPY_KEPT_FROM + window
        self._window = window
        self.put_task.per_message = self.pairing.set_window(window, workers, self.counts["tasks_sent"])
        if self._holding:
            # (num_workers="auto") a retired worker gets no next task, nor one
            # that no longer pairs: what is held goes now.
            self.flush()

    def start(self) -> None:
        self._handles[:] = self.launcher.start_all(self._config.num_workers, self._config.epoch)
        self._fetcher = Fetcher(self.sink, self.lock, self.pool, self._buffer, self._config.num_workers,
                                lambda: self._handles, self._on_death)
        self._fetcher.sync()
        # The consumer's whole wait, compiled (ReceivesItself: from the start on; the engine's
        # window calls a ConsumerWait in C).
        self.receive: Callable[..., Any] = ConsumerWait(self._fetcher.receiver, self._holding,
                                                        self._flush_before_wait,
                                                        self._fetcher.handle_for_consumer)
        launcher.register_pausable(self)
        self._fetcher.start()

    def counters(self) -> list[dict[str, int]]:
        return [self.pool.counts, self.counts]

    def pause(self) -> bool:
        """Stop the fetcher thread for a moment (another engine forks its zygote)."""
        return self._fetcher.pause() if self._fetcher is not None else False

    def resume(self) -> None:
        if self._fetcher is not None:
            self._fetcher.start()

    def next_result(self, buffer: ReorderBuffer, idx: int, any_index: bool, timeout: float | None,
                    filling: bool = False, epochs: int = -1) -> Any:
        return self.receive(idx, any_index, timeout, filling, epochs=epochs)   # (started)

    @defer_sigint   # NOTE [ Deferred signals ]
    def _flush_before_wait(self, filling: bool = False) -> None:
        """The consumer is about to sleep: what it waits for may be held.
        Whole, signals deferred: a send cut short by a signal handler's
        exception would lose tasks (the consumer is about to sleep anyway).
        Adaptive pairing stops a while: the held task may be what it waits
        for (unless `filling`: the epoch's first window, the workers starting)."""
        with self.lock:
            per_message = self.pairing.stop(self.put_task.per_message, self.counts["tasks_sent"], filling)
            if per_message is not None:
                self.put_task.per_message = per_message
                self.counts["pairing_stops"] += 1
            self.flush()

    def claim(self, raw: RawBatch) -> Any:
        return adopt_raw(raw, self._handles, self.pool)

    def claim_mismatch(self, raw: RawBatch, mismatch: ClaimMismatch) -> Exception:
        return claim_mismatch_error(raw, mismatch, self._handles)

    @property
    def receive_stats(self) -> dict[str, int] | None:
        """The fetcher's receive counters (GIL-held ns, batches stored, frames handed up)."""
        if self._fetcher is None:
            return None
        stats = self._fetcher.receiver.stats()
        return {"gil_ns": stats["gil_ns"], "stored": stats["stored"], "passed_up": stats["passed_up"]}

    def pid(self, worker_id: int) -> int | None:
        return self._handles[worker_id].pid if worker_id < len(self._handles) else None

    def process(self, worker_id: int) -> Any:
        return self._handles[worker_id].process if worker_id < len(self._handles) else None

    @property
    def receiving(self) -> bool:
        return self._fetcher is not None and self._fetcher.running

    def describe(self, worker_id: int) -> str:
        return process_state(self.pid(worker_id))

    def dispatch(self, worker_id: int, epoch: int, batch_index: int, indices: np.ndarray | None,
                 profiling: bool) -> None:
        self.put_task(worker_id, (epoch, batch_index, indices, profiling))
        self.send_queued(worker_id)

    def send_queued(self, worker_id: int) -> None:
        handle = self._handles[worker_id]
        if len(handle.held) >= self.put_task.per_message:
            self._send_held(handle)

    def flush(self) -> None:
        while self._holding:
            wid = next(iter(self._holding))
            if wid < len(self._handles):
                self._send_held(self._handles[wid])
            self._holding.discard(wid)

    def tidy_between_epochs(self) -> None:
        for slab in self.pool.trim(self._window + SPARE_SLABS):
            retire_everywhere(slab, self.pool, self._handles)

    def queued(self, worker_id: int) -> list[tuple[int, int]]:
        if worker_id >= len(self._handles):
            return []
        return [(epoch, idx) for epoch, idx, _, _ in self._handles[worker_id].held]

    def drop_held(self) -> list[tuple[int, tuple[int, int]]]:
        dropped = [(h.worker_id, (epoch, idx)) for h in self._handles for epoch, idx, _, _ in h.held]
        for h in self._handles:
            h.held = []
        self._holding.clear()
        return dropped

    def _send_held(self, handle: ProcessHandle) -> None:
        """Send `handle`'s held tasks, in as few messages as the core can.

        Retry-safe (this runs in the training loop's thread, where a signal
        handler may raise between any two bytecodes): `handle.held` always
        says what is left to send, the core removing each message's tasks
        as it goes and the rest of a message cut short by a full socket
        being finished whole (_finish_message)."""
        tasks = handle.held
        while tasks:
            if handle.send_cut or handle.sock is None:
                del tasks[:]   # a task's frame was cut short (below), or shut down: the epoch is over
                break
            left = len(tasks)
            try:
                # Packed and sent by the core, which records each task's slab on the handle as it goes.
                done, messages, unsent = send_tasks(handle, self.pool, wire.TASK_PREFIX, tasks, True)
            except OSError:
                del tasks[:]
                break  # the worker is dead; the fetcher reports it
            self.counts["tasks_sent"] += done
            self.counts["task_messages"] += messages
            hold, pairing = self.put_task, self.pairing
            if hold.per_message < pairing.ahead:   # after a stop only: a paired send makes no call
                hold.per_message = pairing.after_send(hold.per_message, self.counts["tasks_sent"])
            if unsent is not None:
                started = done - (left - len(tasks))   # the message's tasks, still first in `tasks`
                self._finish_message(handle, tasks, started, unsent)
        self._holding.discard(handle.worker_id)

    @defer_sigint
    def _finish_message(self, handle: ProcessHandle, tasks: list[tuple[int, int, Any, bool]], started: int,
                        unsent: tuple[bytes, int]) -> None:
        """The rest of a message the socket had no room for, sent as the
        worker reads it; then its `started` tasks leave `tasks`.  Whole,
        signals deferred: half a frame would cut the worker's stream."""
        rest, slab_fd = unsent
        try:
            assert handle.sock is not None
            if wire.finish_send(handle.sock, memoryview(rest), slab_fd, self._timeout, self._is_stopping):
                del tasks[:started]
                return
            # Closed while the worker was not reading: half a frame is in its socket.
            handle.send_cut = self.stream_cut = True
        except TimeoutError:
            # Not read for the loader's whole timeout (a stopped or stuck
            # worker): the epoch fails as a batch's wait for it would.
            handle.send_cut = True
            pid = handle.pid
            batches = [idx for _, idx, _, _ in tasks[:started]]
            self.sink.fail(LoaderTimeoutError(
                f"could not hand the task of batch{'es' if len(batches) > 1 else ''} "
                f"{', '.join(map(str, batches))} to worker {handle.worker_id} (pid {pid}, "
                f"{process_state(pid)}): it read none of it within timeout={self._timeout} s. A stopped "
                f"worker runs again after SIGCONT (kill -CONT {pid}); a worker may be stuck in "
                f"__getitem__. Raise `timeout` if batches are legitimately slow"))
        except OSError:
            pass   # the worker is dead; the fetcher reports it
        del tasks[:]

    def _is_stopping(self) -> bool:
        return self._stopping or self.epoch_closed

    def _on_death(self, handle: ProcessHandle) -> None:
        """The fetcher saw `handle`'s worker end (fetcher thread)."""
        proc = handle.process
        proc.join(timeout=0.5)
        exitcode = proc.exitcode
        how = describe_exit(exitcode)
        if (self.start_method == "spawn" and exitcode == 0
                and signal.getsignal(signal.SIGCHLD) == signal.SIG_IGN):
            # The kernel discarded its status (subprocess then says 0):
            # only a zygote or the fork server, which reset it, can tell.
            how = ("exit status unknown: this process ignores SIGCHLD (signal.SIG_IGN), so the kernel "
                   "discards its children's exit status; restore signal.SIG_DFL, or use start_method 'fork' "
                   "or 'forkserver', to learn how workers end")
        with self.lock:
            handle.alive = False
            if exitcode is not None:
                self.launcher.forget(proc)
            loss = _worker_loss(handle, exitcode, how, self.launcher, self.start_method)
            self.sink.worker_lost(loss)

    def restart(self, worker_id: int, epoch: int) -> bool:
        dead = self._handles[worker_id]
        try:
            new = self.launcher.start(worker_id, epoch)
        except Closing:
            return False
        dead.close_channel()
        self._handles[worker_id] = new
        for slab in dead.slabs.values():
            if slab is not None:
                self.pool.release(slab)   # its writer is dead
        dead.slabs.clear()
        return True

    # ---------------------------------------------------------------- shutdown phases
    # (NOTE [ Numbered shutdown ], shutdown.py: the order and the one deadline)

    def stop_receiving(self, deadline: float) -> None:
        # First, without the engine lock: a consumer holding it while its
        # send waits on a worker that is not reading lets it go at once.
        self._stopping = True
        if self._fetcher is not None:
            self._fetcher.stop(deadline)

    def refuse_starts(self, deadline: float) -> None:
        self._ending = self.launcher.refuse_starts(deadline)

    def ask_to_stop(self) -> None:
        for h in self._handles:
            try:
                if h.sock is not None:
                    h.sock.setblocking(False)
                    wire.send(h.sock, m.Stop())
            except (OSError, ValueError):
                pass

    def end_workers(self, start: float, deadline: float) -> None:
        procs = self._ending if self._ending is not None else list(self.launcher.processes)
        # A worker with no task sent and unanswered (its slab entries go as its answers
        # arrive) and none held is between tasks: launcher.end_processes waits for it longer.
        between_tasks = [h.process for h in self._handles if not h.slabs and not h.held]
        self.launcher.end_all(procs, start, deadline, between_tasks)

    def release(self) -> None:
        if self._fetcher is not None:
            self._fetcher.close()   # first: no thread reads a socket once it is closed
        for h in self._handles:
            h.close_channel()
            h.slabs.clear()
            h.alive = False
        self.pool.close()


def _worker_loss(handle: ProcessHandle, exitcode: int | None, how: str, launcher: Launcher,
                 start_method: str) -> WorkerLoss:
    """How worker `handle`'s death (`how`) is reported: as any worker's, or, where nothing can
    replace it (its zygote died) or it died unstarted (an unguarded main module), with the
    words that say why; SIGBUS as shared memory that ran out."""
    zygote_death = launcher.zygote_death()
    if zygote_death is not None:
        zygote = launcher.zygote_pid

        def final(held: list[int]) -> str:
            # Nothing can fork a replacement, nor any other worker: say why.
            return (f"mxload worker {handle.worker_id} (pid {handle.pid}) died ({how}) while holding "
                    f"batches {held}: the worker zygote (pid {zygote}), which forks this loader's "
                    f"workers, died ({zygote_death}), and its workers die with it. No worker can be "
                    f"restarted; iterate the loader again to start new workers")
        loss = WorkerLoss(handle.worker_id, handle.pid, exitcode, how, final=final)
    elif (exitcode == 1 and start_method == "forkserver" and launcher.main_site is not None
          and outside_main_guard(launcher.main_site)):
        # The worker's bootstrap (multiprocessing's, before any of mxload's code) failed.
        def unguarded(held: list[int]) -> str:
            return (f"DataLoader worker (pid(s) {handle.pid}) exited unexpectedly: mxload worker "
                    f"{handle.worker_id} (pid {handle.pid}) died ({how}) as it started, holding "
                    f"batches {held}. {UNGUARDED_MAIN_HINT}")
        loss = WorkerLoss(handle.worker_id, handle.pid, exitcode, how, final=unguarded)
    elif exitcode == -signal.SIGBUS:
        hint = f" (SIGBUS: shared memory ran out; {SHARED_MEMORY_ADVICE})"
        loss = WorkerLoss(handle.worker_id, handle.pid, exitcode, how, hint, SharedMemoryError)
    else:
        loss = WorkerLoss(handle.worker_id, handle.pid, exitcode, how)
    return loss
