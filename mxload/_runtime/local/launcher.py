"""Worker processes' lives: the start method, starting and restarting them, and ending them
within the shutdown's deadline (the sequence itself: NOTE [ Numbered shutdown ], ../shutdown.py;
the processes: NOTE [ Zygote process tree ], zygote.py).

Ctrl-C: starting runs with SIGINT deferred (zygote.sigint_deferred), so no
worker is left half made; the engine runs the whole shutdown with SIGINT
deferred (_core.defer_sigint), so none is left half ended (NOTE [ Deferred signals ]).
"""
from __future__ import annotations

import ast
import dataclasses
import errno
import functools
import itertools
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import time
import weakref
from collections.abc import Collection, Iterator
from multiprocessing import connection as mp_connection
from multiprocessing import forkserver
from typing import Any, Generic, Protocol, TypeVar

from ..._core import WorkerChannel
from ...errors import UnpicklablePayloadError, WorkerError
from ..messages import Payload, WorkerConfig
from ..shutdown import SHUTDOWN_DEADLINE_S, SHUTDOWN_GRACE_S, SHUTDOWN_TERMINATE_S
from ..worker import in_worker_process
from . import fds as _fds
from . import wire
from .inherit import ForChild, pickle_payload
from .process_worker import worker_process_main
from .slabs import fd_limit_error
from .zygote import ForkServerWorker, SpawnedWorker, Zygote, ZygoteWorker, ensure_fork_server, sigint_deferred

__all__ = ["Closing", "Launcher", "ProcessHandle", "WeakRegistry", "choose_start_method", "describe_exit"]

T = TypeVar("T")


def choose_start_method(requested: str | None) -> str:
    """The start method asked for; else, as torch's DataLoader with
    multiprocessing_context=None, the one the program set with
    ``multiprocessing.set_start_method(...)`` (read without fixing it);
    else fork on Linux (mxload's zygote), the platform's default elsewhere."""
    if requested is not None:
        return requested
    chosen = mp.get_start_method(allow_none=True)
    if chosen is not None:
        return chosen
    return "fork" if sys.platform.startswith("linux") else mp.get_start_method()


# Descriptors multiprocessing's fork server client holds at once to start a
# process (its socket, two pipes, the sentinel kept), with room to spare.
_FORKSERVER_START_FDS = 8


# What multiprocessing's fork server client (ForkServer.connect_to_new_process) sends in its one
# message beside the descriptors a Process's arguments hold: a status pipe's and a data pipe's
# child ends, the fork server's alive descriptor and the resource tracker's (CPython 3.8-3.13;
# tests/test_loader.py measures it).  The arguments of a worker's Process hold its socket.
FORK_SERVER_OWN_FDS = 4
WORKER_SOCKET_FDS = 1


def max_payload_fds(start_method: str) -> int:
    """The most descriptors of the payload's multiprocessing objects (inherit.py) a worker
    started with `start_method` can receive.  spawn: one Handover message of ours carries just
    them.  forkserver: one message of the fork server client carries them with its own and the
    worker's socket, within a message's limit and the client's own check (fewer than
    MAXFDS_TO_SEND in all, else ValueError "too many fds").  Past the message's limit sendmsg
    fails with EINVAL after the fork server accepted the request, which ends the fork server
    (shared by every forkserver Process of this process): so this is checked before."""
    if start_method != "forkserver":
        return wire.MAX_FDS_PER_MESSAGE
    whole_message = min(wire.MAX_FDS_PER_MESSAGE, forkserver.MAXFDS_TO_SEND - 1)
    return whole_message - FORK_SERVER_OWN_FDS - WORKER_SOCKET_FDS


def _check_fd_room(needed: int, doing: str) -> None:
    """Refuse to go on with fewer than `needed` free descriptors.  For calls
    into code that does not clean up after EMFILE: CPython's fork server
    client leaks a pipe (both ends) when its second pipe does not fit, and
    the fork server prints a traceback."""
    try:
        import resource
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        n_open = len(os.listdir("/proc/self/fd"))
    except (ImportError, OSError, ValueError):  # pragma: no cover - no /proc
        return
    if soft != resource.RLIM_INFINITY and n_open + needed > soft:
        raise fd_limit_error(doing, WorkerError)


def describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"killed by {name}"
    return f"exit code {exitcode}"


# /proc/PID/stat states worth naming when a worker does not answer.
class Closing(Exception):
    """A worker start was refused or undone: the engine is shutting down."""


class Process(Protocol):
    """What the launcher needs of a worker process (zygote.ForkServerWorker,
    zygote.SpawnedWorker, zygote.ZygoteWorker)."""

    @property
    def sentinel(self) -> int: ...

    @property
    def pid(self) -> int | None: ...

    @property
    def exitcode(self) -> int | None: ...
    def join(self, timeout: float | None = None) -> None: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...

    def close(self) -> None:
        """Release this process's descriptors for the worker: once it has ended, or once it was
        sent SIGKILL (the shutdown's deadline came before its end was known; its parent, this
        process, the zygote or the fork server, reaps it)."""


_tags: Iterator[int] = itertools.count(1)


class ProcessHandle(WorkerChannel):
    """The main process's view of one worker process: its task channel (WorkerChannel,
    whose typed fields the compiled send and hand-off read: socket, tag, known_slabs,
    pending_drops, the slab of each task, the layouts its worker named) and its process.

    Tasks of an abandoned epoch stay in `slabs` until their result arrives: the worker may
    still be writing into their slab, so it must not be handed out again.  A restart makes a
    new handle, with a new tag, so a stored batch always finds the handle whose worker sent it.
    """

    def __init__(self, worker_id: int, process: Process, pid: int | None, sock: socket.socket | None):
        self.worker_id = worker_id
        self.process = process
        self.pid = pid                 # kept: the process object is closed once it is reaped
        self.sock = sock               # the task socket (wire.py)
        self.tag = next(_tags)
        self.alive = True
        # A task's frame was cut short (a send given up): nothing more may be sent.
        self.send_cut = False
        # Tasks held back to go with the next in one message (ProcessTransport.dispatch):
        # (epoch, batch index, indices, profiling) each.
        self.held: list[tuple[int, int, Any, bool]] = []

    def close_channel(self) -> None:
        _fds.close_socket(self.sock)
        self.sock = None

    def __repr__(self) -> str:
        return f"ProcessHandle(worker {self.worker_id}, pid {self.pid}, tag {self.tag})"


class Pausable(Protocol):
    def pause(self) -> bool: ...
    def resume(self) -> None: ...


class WeakRegistry(Generic[T]):
    """The objects added to it that are still alive.  Weak references
    without a callback, not a WeakSet: a WeakSet's callback runs Python code
    where the object dies (often inside a garbage collection), and a Ctrl-C
    landing there is swallowed ("Exception ignored in: ... WeakSet ...
    _remove").  Dead references go as objects are added; each step is one C
    call, so threads adding at once lose none."""

    def __init__(self) -> None:
        self._refs: set[weakref.ref[T]] = set()

    def add(self, obj: T) -> None:
        for ref in [ref for ref in list(self._refs) if ref() is None]:
            self._refs.discard(ref)
        self._refs.add(weakref.ref(obj))

    def alive(self) -> list[T]:
        return [obj for obj in (ref() for ref in list(self._refs)) if obj is not None]


# Every process transport of this process: forking a zygote pauses the
# others' fetcher threads, so that mxload never forks while a thread of its own runs.
_running: WeakRegistry[Pausable] = WeakRegistry()
_fork_lock = threading.Lock()


def register_pausable(transport: Pausable) -> None:
    """`transport` runs a thread that must pause while another engine forks its zygote."""
    _running.add(transport)


def _forget_inherited_workers() -> None:
    """In a forked child: the launchers' worker processes are the parent's.
    Take them out of multiprocessing's children, whose exit handler would
    otherwise terminate them when this child exits."""
    children = getattr(mp.process, "_children", None)
    if children is None:
        return
    for launcher in _launchers.alive():
        for proc in list(launcher.processes):
            children.discard(proc)


_launchers: WeakRegistry[Launcher] = WeakRegistry()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_inherited_workers)


UNGUARDED_MAIN_HINT = (
    "A spawn or forkserver worker runs the main script's top-level code again as it starts: this "
    "script starts its loader outside `if __name__ == \"__main__\":`, so each worker tried to start "
    "workers of its own and multiprocessing stopped it (its stderr shows \"An attempt has been made to "
    "start a new process before the current process has finished its bootstrapping phase\"). Start "
    "loaders under that guard, or use multiprocessing_context=\"fork\"")


def main_call_site() -> tuple[str, int] | None:
    """(file, line) of the main script's top-level code on the calling thread's stack (where
    it started a loader), or None (no such frame, or no script file: -c, interactive)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals is getattr(main, "__dict__", None):
            return (path, frame.f_lineno) if isinstance(path, str) and path.endswith(".py") else None
        frame = frame.f_back   # type: ignore[assignment]
    return None


def outside_main_guard(site: tuple[str, int]) -> bool:
    """Whether line `site[1]` of the script lies outside every `if __name__ == "__main__":`
    block (False where the file cannot be read or parsed)."""
    path, line = site
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_main_test(node.test) \
                and node.lineno <= line <= (node.end_lineno or node.lineno):
            return False
    return True


def _is_main_test(test: ast.expr) -> bool:
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    return any(isinstance(x, ast.Name) and x.id == "__name__" for x in sides) and \
        any(isinstance(x, ast.Constant) and x.value == "__main__" for x in sides)


def _zygote_worker_entry(template: WorkerConfig, worker_id: int, epoch: int, sock: socket.socket) -> None:
    worker_process_main(dataclasses.replace(template, worker_id=worker_id, epoch=epoch), sock)


class Launcher:
    """Starts one engine's worker processes (and, for fork, the zygote that
    forks them), replacements too, and ends them."""

    def __init__(self, config: WorkerConfig, start_method: str | None, dataset_type: str, owner: Pausable):
        self.start_method = choose_start_method(start_method)
        self._template = config           # payload unpickled; worker_id and epoch set per start
        self._dataset_type = dataset_type
        self._owner = owner
        self._zygote: Zygote | None = None
        # Where the main script's top-level code started these workers (spawn, forkserver).
        self.main_site: tuple[str, int] | None = None
        self._spawn_payload: bytes | None = None
        self._payload_fds: list[int] = []   # what the payload's multiprocessing objects need (inherit.py)
        # Every worker process started and not yet closed, registered under
        # _start_lock the moment it exists; once closing is set, no start
        # begins and one that was under way ends its process itself.
        self.processes: list[Process] = []
        self._start_lock = threading.Lock()
        self.closing = False
        _launchers.add(self)

    @property
    def zygote_pid(self) -> int | None:
        return self._zygote.pid if self._zygote is not None else None

    def zygote_death(self) -> str | None:
        """How the zygote ended, None while it serves (or without one)."""
        return self._zygote.death() if self._zygote is not None else None

    def _pickled_payload(self) -> bytes:
        try:
            data, self._payload_fds = pickle_payload(self._template.payload)
        except Exception as e:
            raise UnpicklablePayloadError(
                f"the dataset ({self._dataset_type}), batchify_fn or worker_init_fn cannot be pickled "
                f"for {self.start_method!r} workers: {e}. Make them picklable (module-level "
                f"functions and classes) or use start_method='fork'") from e
        most = max_payload_fds(self.start_method)
        if len(self._payload_fds) > most:
            raise TypeError(
                f"the dataset ({self._dataset_type}), batchify_fn or worker_init_fn hold multiprocessing "
                f"objects with {len(self._payload_fds)} descriptors (shared memory of Values and Arrays, "
                f"pipes, sockets): a {self.start_method!r} worker can receive at most "
                f"{most}. Share fewer, or use start_method='fork'")
        return data

    def start_all(self, num_workers: int, epoch: int) -> list[ProcessHandle]:
        """The first workers (and, for fork, the zygote that forks them)."""
        if in_worker_process():
            raise RuntimeError(
                "cannot start worker processes inside a mxload worker process; inside a dataset "
                "use num_workers=0 or thread_pool=True")
        if self.start_method != "fork":
            self._spawn_payload = self._pickled_payload()
            self.main_site = main_call_site()
        handles: list[ProcessHandle] = []
        with sigint_deferred():
            try:
                if self.start_method == "fork":
                    template = dataclasses.replace(self._template, epoch=epoch, zygote_child=True)
                    with _fork_lock:
                        paused = [t for t in _running.alive() if t is not self._owner and t.pause()]
                        try:
                            self._zygote = Zygote(functools.partial(_zygote_worker_entry, template))
                        finally:
                            for t in paused:
                                t.resume()
                for wid in range(num_workers):
                    handles.append(self.start(wid, epoch, hand_over=False))
                for h in handles:
                    if isinstance(h.process, SpawnedWorker) and h.sock is not None:
                        h.process.hand_over(h.sock)   # all their interpreters start meanwhile
            except BaseException as e:
                # A start that fails part-way (the descriptor table full):
                # the workers started so far are in self.processes, which
                # the shutdown ends; their sockets are known only here.
                for h in handles:
                    h.close_channel()
                if isinstance(e, OSError) and e.errno in (errno.EMFILE, errno.ENFILE):
                    raise fd_limit_error(f"starting worker {len(handles)} of {num_workers} "
                                         f"({self.start_method})", WorkerError) from e
                raise
        return handles

    def start(self, wid: int, epoch: int, hand_over: bool = True) -> ProcessHandle:
        """Start worker `wid` (at start-up, or replacing a dead one from the
        fetcher thread); raises Closing once shutdown has begun.  A spawn
        worker gets its dataset now, or (hand_over=False) from the caller."""
        parent_end, child_end = socket.socketpair()
        _fds.own(parent_end)
        try:
            with sigint_deferred(), self._start_lock:
                if self.closing:
                    raise Closing()
                proc = self._start_process(wid, epoch, parent_end, child_end, hand_over)
                if self.closing:
                    # Shutdown began while this one started and did not wait
                    # for it: it is not in the list shutdown ends, so end it here.
                    now = time.monotonic()
                    self.end_processes([proc], now, now + SHUTDOWN_DEADLINE_S)
                    raise Closing()
                self.processes.append(proc)
        except BaseException:
            _fds.close_socket(parent_end)
            raise
        finally:
            child_end.close()
        return ProcessHandle(wid, proc, proc.pid, parent_end)

    def _start_process(self, wid: int, epoch: int, parent_end: socket.socket, child_end: socket.socket,
                       hand_over: bool) -> Process:
        if self._zygote is not None:
            worker: ZygoteWorker = self._zygote.start(wid, epoch, child_end)
            return worker
        payload: Payload | bytes = self._spawn_payload or self._pickled_payload()
        config = dataclasses.replace(self._template, worker_id=wid, epoch=epoch, payload=payload,
                                     zygote_child=False)
        if self.start_method == "spawn":
            spawned = SpawnedWorker(config, child_end, self._payload_fds)
            if hand_over:
                spawned.hand_over(parent_end)
            return spawned
        if self._payload_fds:
            config = dataclasses.replace(config, payload_fds=ForChild(self._payload_fds))
        ensure_fork_server()
        _check_fd_room(_FORKSERVER_START_FDS, f"starting worker {wid} through the fork server")
        proc = ForkServerWorker(target=worker_process_main, args=(config, child_end),
                                name=f"mxload-worker-{wid}", daemon=True)
        proc.start()
        return proc

    def forget(self, proc: Process) -> None:
        """A reaped worker: release its sentinel now (restarts may be many)."""
        with self._start_lock:
            if proc in self.processes:
                self.processes.remove(proc)
                proc.close()

    def refuse_starts(self, deadline: float) -> list[Process]:
        """No start begins from now on; wait for one under way.  Returns the processes to end."""
        self.closing = True
        locked = self._start_lock.acquire(timeout=max(0.0, deadline - time.monotonic()))
        procs = list(self.processes)
        if locked:
            self._start_lock.release()
        return procs

    def end_all(self, procs: list[Process], start: float, deadline: float,
                between_tasks: Collection[Process] = ()) -> None:
        """End and reap `procs`, then the zygote with whatever is left of its children."""
        self.end_processes(procs, start, deadline, between_tasks)   # closes them all, reaped or not
        if self._zygote is not None:
            self._zygote.close(deadline)   # what it did not report, its end ended too

    def end_processes(self, procs: list[Process], start: float, deadline: float,
                      between_tasks: Collection[Process] = ()) -> None:
        """Grace, then SIGTERM, then SIGKILL, all within one deadline; reap all.

        A worker of `between_tasks` (nothing sent to it is unanswered: an epoch that ended)
        exits as soon as it reads the stop message, with exit code 0, as torch's workers do
        once an epoch ends; but a loaded machine may not run it within the grace, which is for
        a worker still inside a batch nobody wants.  So it is not sent SIGTERM: it has until
        the terminate period, then SIGKILL as the others, within the same deadline."""
        _wait_exit(procs, start + SHUTDOWN_GRACE_S)
        alive = [p for p in procs if p.exitcode is None]
        idle = {id(p) for p in between_tasks}
        for p in alive:
            if id(p) in idle:
                continue
            try:
                p.terminate()
            except (OSError, ValueError):
                pass
        _wait_exit(alive, min(deadline, start + SHUTDOWN_TERMINATE_S))
        for p in alive:
            if p.exitcode is None:
                try:
                    p.kill()
                except (OSError, ValueError):
                    pass
        _wait_exit(alive, deadline)
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))  # reap: no zombies
            # Reaped; or sent SIGKILL and its end not known by the deadline (its parent not run
            # meanwhile, on a loaded machine: the fork server, the zygote): its descriptors go
            # now all the same, and its parent reaps it.
            p.close()


def _wait_exit(procs: list[Process], until: float) -> None:
    pending = [p for p in procs if p.exitcode is None]
    while pending:
        remaining = until - time.monotonic()
        if remaining <= 0:
            return
        ended = set(mp_connection.wait([p.sentinel for p in pending], timeout=remaining))
        for p in pending:
            if p.sentinel in ended:
                p.join(timeout=max(0.0, until - time.monotonic()))   # its exit status follows
        pending = [p for p in pending if p.exitcode is None]
