"""The worker loop (processes and threads), worker info, seeding, signals and
the parent watchdog.

Protocol (one duplex AF_UNIX stream socket per worker process, see _engine).
Every message is one frame: a header (payload length, descriptor count), the
pickled payload, and the frame's descriptors (SCM_RIGHTS) attached to the same
sendmsg, so a message and its descriptor arrive together or not at all; a
frame cut short (the sender died mid-send) reads as the end of the channel.
  main -> worker  (epoch, batch_idx, indices, slab_id, slab_size, fd_follows, drop_ids, profiling)
                  or None to stop.  When fd_follows, the frame carries the slab's descriptor.
  worker -> main  ("ok", epoch, idx, slab_id, nbytes, layout, timings)
                  ("new_slab", epoch, idx, size, nbytes, layout, timings), carrying the new slab's descriptor
                  timings: None, or when profiling (start ns, fetch ns, collate ns,
                  sent ns, field stats, field ns) on the system-wide monotonic clock
                  ("error", epoch, idx, exception_info)
                  ("exhausted", epoch, idx)            IterableDataset shard is done
"""
from __future__ import annotations

import array
import collections
import dataclasses
import os
import pickle
import random
import select
import signal
import socket
import struct
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _rng
from . import batchify as _batchify
from ._slabs import create_shared_fd, fd_limit_error, map_slab, slab_size_for
from ._torch_compat import enter_worker

__all__ = ["WorkerInfo", "get_worker_info"]

# Frame header: payload bytes, number of descriptors carried (at most _MAX_FDS).
_FRAME = struct.Struct("<IB")
_MAX_FDS = 1


@dataclass(frozen=True)
class WorkerInfo:
    """What :func:`get_worker_info` returns inside a worker.

    Args:
        id (int): this worker's id, 0 .. num_workers - 1.
        num_workers (int): how many workers the loader has.
        seed (int): this worker's seed for this epoch (from the loader's seed,
            the epoch and the id; ``random`` and numpy's global RNG are
            already seeded with it).
        dataset: this worker's copy of the dataset.

    Example:
        >>> import mxload
        >>> info = mxload.WorkerInfo(id=0, num_workers=2, seed=7, dataset=None)
        >>> info.id, info.num_workers
        (0, 2)
    """
    id: int
    num_workers: int
    seed: int
    dataset: Any


_process_info: WorkerInfo | None = None
_thread_info = threading.local()


def get_worker_info() -> WorkerInfo | None:
    """Inside a worker: its id, the number of workers, its seed and its copy of
    the dataset (use them to shard an IterableDataset).  None elsewhere.

    Returns:
        WorkerInfo | None: the calling worker's info (process or thread
        worker); ``None`` in the main process and with ``num_workers=0``.

    Example:
        >>> import mxload
        >>> mxload.get_worker_info() is None   # the main process
        True
        >>> class WhoLoads(mxload.Dataset):
        ...     def __len__(self):
        ...         return 4
        ...     def __getitem__(self, i):
        ...         return mxload.get_worker_info().id
        >>> sorted(int(w) for b in mxload.DataLoader(WhoLoads(), batch_size=2, num_workers=2) for w in b)
        [0, 0, 1, 1]
    """
    info = getattr(_thread_info, "info", None)
    return info if info is not None else _process_info


def worker_seed(seed: int, epoch: int, worker_id: int) -> int:
    """A 63-bit seed for one worker in one epoch: distinct per worker and per
    epoch, reproducible from the loader's seed."""
    state = np.random.SeedSequence([seed, epoch, worker_id]).generate_state(1, np.uint64)
    return int(state[0]) % (2 ** 63)


def _seed_global_rngs(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2 ** 32))


def in_worker_process() -> bool:
    """True inside a mxload worker process (which must not start workers itself)."""
    return _process_info is not None


def _seed_worker(config: WorkerConfig, epoch: int) -> None:
    """Seed this worker process's global RNGs for `epoch` (and say so in its WorkerInfo)."""
    global _process_info
    seed = worker_seed(config.seed, epoch, config.worker_id)
    _seed_global_rngs(seed)
    if _process_info is not None:
        _process_info = dataclasses.replace(_process_info, seed=seed)
        enter_worker(config.worker_id, config.num_workers, seed, _process_info.dataset, process=True)


def pack_exception(exc: BaseException) -> tuple[Any, ...]:
    """(module, qualname, message, formatted traceback, pickled exception or None)."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    blob: bytes | None
    try:
        blob = pickle.dumps(exc)
        pickle.loads(blob)  # some exceptions pickle but cannot be rebuilt
    except Exception:
        blob = None
    return (type(exc).__module__, type(exc).__qualname__, str(exc), tb, blob)


def fetch_samples(dataset: Any, indices: np.ndarray, seed: int = 0, epoch: int = 0) -> Any:
    """The samples of one batch: one ``__getitems__`` call where the dataset
    offers it (torch 2.x protocol), else one ``__getitem__`` per index.
    Each call runs inside its sample_rng() context (seed, epoch, index)."""
    getitems = getattr(dataset, "__getitems__", None)
    try:
        if getitems is not None:
            _rng.set_sample(seed, epoch, None)
            return getitems(indices)
        samples = []
        for i in indices.tolist():
            _rng.set_sample(seed, epoch, i)
            samples.append(dataset[i])
        return samples
    finally:
        _rng.clear_sample()


class _Stream:
    """Batches drawn from an IterableDataset (this worker's shard)."""

    def __init__(self, dataset: Any, batch_size: int, drop_last: bool):
        self._it = iter(dataset)
        self._batch_size = batch_size
        self._drop_last = drop_last
        self.exhausted = False

    def next_samples(self) -> list[Any] | None:
        if self.exhausted:
            return None
        samples = []
        for sample in self._it:
            samples.append(sample)
            if len(samples) == self._batch_size:
                return samples
        self.exhausted = True
        if not samples or (self._drop_last and len(samples) < self._batch_size):
            return None
        return samples


class _SampleSource:
    """Where a worker's batches come from: indices into a map-style dataset,
    or, for an IterableDataset, this worker's stream (restarted each epoch)."""

    def __init__(self, dataset: Any, iterable: bool, batch_size: int, drop_last: bool, seed: int):
        self._dataset = dataset
        self._iterable = iterable
        self._batch_size = batch_size
        self._drop_last = drop_last
        self._seed = seed
        self._stream: _Stream | None = None
        self._stream_epoch: int | None = None

    def samples(self, epoch: int, indices: Any) -> Any:
        """The samples of one batch, or None when this worker's stream is done."""
        if not self._iterable:
            return fetch_samples(self._dataset, indices, self._seed, epoch)
        if self._stream is None or self._stream_epoch != epoch:
            self._stream = _Stream(self._dataset, self._batch_size, self._drop_last)
            self._stream_epoch = epoch
        return self._stream.next_samples()

    def close(self) -> None:
        """Drop the stream's iterator (an abandoned epoch releases it now)."""
        self._stream = None


@dataclass
class WorkerConfig:
    """Everything a worker needs besides its socket (picklable for spawn)."""
    worker_id: int
    num_workers: int
    seed: int
    epoch: int
    payload: Any          # (dataset, batchify_fn, worker_init_fn) or its pickle
    iterable: bool
    batch_size: int
    drop_last: bool
    # Forked by the zygote: its only thread forked us, so the kernel's parent
    # death signal is sound.  Otherwise (spawn, forkserver) the parent is the
    # main process or the fork server, and a watchdog thread notices the main
    # process's end of our socket closing instead.
    zygote_child: bool


def worker_process_main(config: WorkerConfig, sock: socket.socket) -> None:
    """Entry point of a worker process."""
    # Ctrl-C goes to the whole process group; the main process owns it and
    # ends us through the shutdown path, so ignore it (no worker tracebacks).
    # It arrives blocked (the starting thread blocked it): a Ctrl-C pending
    # since then is discarded here, never delivered.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    if not config.zygote_child:   # a zygote child was armed by the zygote (_procs.die_with_parent)
        _watch_main_process(sock)
    global _process_info
    payload = config.payload
    if isinstance(payload, bytes):
        payload = pickle.loads(payload)
    dataset, batchify_fn, worker_init_fn = payload
    _process_info = WorkerInfo(config.worker_id, config.num_workers, 0, dataset)
    _seed_worker(config, config.epoch)
    try:
        if worker_init_fn is not None:
            try:
                worker_init_fn(config.worker_id)
            except (Exception, SystemExit) as e:   # sys.exit() there is a failure to report, too
                send_frame(sock, ("error", config.epoch, -1, pack_exception(e)))
                return
        _serve(config, sock, dataset, batchify_fn)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the main process went away: nothing left to serve


def _watch_main_process(sock: socket.socket) -> None:
    """Die at once when the main process does, busy or not: only the main
    process holds the other end of `sock`, so its death (or its closing the
    socket at shutdown) hangs the socket up."""
    def watch() -> None:
        poller = select.poll()
        poller.register(sock.fileno(), 0)   # POLLHUP is always reported; no data is consumed
        while True:
            for _, event in poller.poll():
                if event & (select.POLLHUP | select.POLLERR | select.POLLNVAL):
                    os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="mxload-parent-watchdog", daemon=True).start()


def send_frame(sock: socket.socket, message: Any, fds: Any = ()) -> None:
    """Send one message (plain pickle) with its descriptors, in one sendmsg."""
    send_pickled(sock, pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL), fds)


def send_pickled(sock: socket.socket, data: bytes, fds: Any = ()) -> None:
    """send_frame of a message already pickled."""
    frame = _FRAME.pack(len(data), len(fds)) + data
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sent = sock.sendmsg([frame], ancillary)
    if sent < len(frame):   # a signal interrupted a large send: the descriptors went with the first part
        sock.sendall(memoryview(frame)[sent:])


def recv_frame(sock: socket.socket) -> tuple[Any, list[int]]:
    """One message and the descriptors that came with it.  EOFError if the
    channel is closed or the frame is cut short; SharedMemoryError if this
    process had no room for the descriptors (RLIMIT_NOFILE)."""
    fds: list[int] = []
    try:
        header = _recv_exact(sock, _FRAME.size, fds, frame_started=False)
        length, nfds = _FRAME.unpack(header)
        data = _recv_exact(sock, length, fds, frame_started=True)
        if len(fds) != nfds:
            raise EOFError(f"a frame announced {nfds} descriptors and carried {len(fds)}")
        return pickle.loads(data), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _recv_exact(sock: socket.socket, n: int, fds: list[int], frame_started: bool) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        nbytes, ancillary, flags, _ = sock.recvmsg_into([view[got:]], socket.CMSG_SPACE(4 * _MAX_FDS),
                                                        socket.MSG_CMSG_CLOEXEC)
        for level, kind, cdata in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.extend(array.array("i", cdata[:len(cdata) - len(cdata) % 4]))
        if flags & socket.MSG_CTRUNC:
            raise fd_limit_error("receiving a shared-memory descriptor")
        if nbytes == 0:
            if got or frame_started:
                raise EOFError("the channel closed in the middle of a message")
            raise EOFError("the channel is closed")
        got += nbytes
    return bytes(buf)


class _Inbox:
    """The worker's side of its socket: reads ahead so a stop request queued
    behind already-dispatched tasks is seen before the next task starts
    (after `break`, queued work is skipped, not done), and maps the slab
    descriptors that come with their task messages."""

    def __init__(self, sock: socket.socket):
        self._sock = sock
        self._poller = select.poll()
        self._poller.register(sock.fileno(), select.POLLIN)
        self.pending: collections.deque[tuple[Any, ...]] = collections.deque()
        self.slabs: dict[Any, Any] = {}
        self.stopped = False

    def _read_one(self) -> None:
        task, fds = recv_frame(self._sock)
        if task is None:
            self.stopped = True
            return
        _, _, _, slab_id, slab_size, _, drop_ids, _ = task
        for dropped in drop_ids:
            self.slabs.pop(dropped, None)
        if fds:
            try:
                self.slabs[slab_id] = map_slab(fds[0], slab_size, slab_id)
            finally:
                os.close(fds[0])
        self.pending.append(task)

    def next_task(self) -> tuple[Any, ...] | None:
        """The next task, or None when asked to stop."""
        timeout_ms = 0 if self.pending else -1
        while not self.stopped:
            if self._poller.poll(timeout_ms):
                self._read_one()
                timeout_ms = 0          # drain whatever else is already here
                continue
            if self.pending:
                return self.pending.popleft()
            timeout_ms = -1
        return None


def _serve(config: WorkerConfig, sock: socket.socket, dataset: Any, batchify_fn: Any) -> None:
    inbox = _Inbox(sock)
    seeded_epoch = config.epoch
    source = _SampleSource(dataset, config.iterable, config.batch_size, config.drop_last, config.seed)
    while True:
        task = inbox.next_task()
        if task is None:
            return
        epoch, idx, indices, slab_id, _, _, _, profiling = task
        if epoch != seeded_epoch:   # persistent workers: reseed per epoch, as fresh ones are
            _seed_worker(config, epoch)
            seeded_epoch = epoch
        t0 = time.monotonic_ns()
        new_fd = -1
        try:
            samples = source.samples(epoch, None if indices is None else np.frombuffer(indices, np.int64))
            if samples is None:
                send_frame(sock, ("exhausted", epoch, idx))
                continue
            t1 = time.monotonic_ns()
            plan = _batchify.plan_batch(batchify_fn, samples, idx)
            slab = inbox.slabs.get(slab_id) if slab_id is not None else None
            fill_ns: list[Any] = []
            if plan.nbytes == 0:
                reply: tuple[Any, ...] = ("ok", epoch, idx, slab_id, 0, plan.layout())
            elif slab is not None and slab.size >= plan.nbytes:
                _, fill_ns = plan.fill(slab)
                reply = ("ok", epoch, idx, slab_id, plan.nbytes, plan.layout())
            else:
                size = slab_size_for(plan.nbytes, slab.size if slab is not None else 0)
                new_fd = create_shared_fd(size)
                new_slab = map_slab(new_fd, size, None, populate=True)
                _, fill_ns = plan.fill(new_slab)
                del new_slab
                reply = ("new_slab", epoch, idx, size, plan.nbytes, plan.layout())
            t2 = time.monotonic_ns()
            timings = None
            if profiling:
                stats, field_ns = plan.field_stats(fill_ns)
                timings = (t0, t1 - t0, t2 - t1, time.monotonic_ns(), stats, field_ns)
            # Pickle here, inside the try: an unpicklable object in the batch
            # is reported as this batch's error, not as a dead worker.
            data = pickle.dumps(reply + (timings,), protocol=pickle.HIGHEST_PROTOCOL)
        except BaseException as e:   # sys.exit(), KeyboardInterrupt... out of the
            # dataset are this batch's failure too (the main process reports them as WorkerError);
            # nothing else raises them here: SIGINT is ignored, a stop request is a message
            if new_fd >= 0:
                os.close(new_fd)
            send_frame(sock, ("error", epoch, idx, pack_exception(e)))
            continue
        try:
            send_pickled(sock, data, [new_fd] if new_fd >= 0 else [])
        finally:
            if new_fd >= 0:
                os.close(new_fd)


def thread_worker_main(engine: Any, worker_id: int, num_workers: int, seed: int, tasks: Any) -> None:
    """Entry point of a worker thread (thread_pool=True): same task protocol,
    batches collated into private memory and delivered to the engine.  A
    thread that ends other than by a stop request (SystemExit, any
    BaseException out of user code) tells the engine at once, as a process's
    sentinel would."""
    dataset, batchify_fn, worker_init_fn = engine.payload
    _thread_info.info = WorkerInfo(worker_id, num_workers, seed, dataset)
    doing = "running worker_init_fn"
    try:
        if worker_init_fn is not None:
            try:
                worker_init_fn(worker_id)
            except Exception as e:
                engine.deliver_thread_result(worker_id, ("error", engine.epoch, -1, pack_exception(e)))
                return
        source = _SampleSource(dataset, engine.iterable, engine.batch_size, engine.drop_last, engine.seed)
        while True:
            doing = "waiting for a task"
            task = tasks.get()
            if task is None:
                return
            epoch, idx, indices, profiling = task
            doing = f"loading batch {idx}"
            t0 = time.monotonic_ns()
            try:
                samples = source.samples(epoch, indices)
                if samples is None:
                    engine.deliver_thread_result(worker_id, ("exhausted", epoch, idx))
                    continue
                t1 = time.monotonic_ns()
                timings = None
                if profiling:
                    batch, stats, field_ns = _batchify.collate_profiled(batchify_fn, samples, idx)
                    timings = (t0, t1 - t0, time.monotonic_ns() - t1, time.monotonic_ns(), stats, field_ns)
                else:
                    batch = _batchify.collate(batchify_fn, samples, idx)
            except Exception as e:
                engine.deliver_thread_result(worker_id, ("error", epoch, idx, pack_exception(e)))
                continue
            engine.deliver_thread_result(worker_id, ("batch", epoch, idx, batch, timings))
    except BaseException as e:
        engine.thread_worker_ended(worker_id, e, doing)
    finally:
        _thread_info.info = None
