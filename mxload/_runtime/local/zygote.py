"""Worker processes: how they start, how they end, and who may hold what.

NOTE [ Zygote process tree ]

Process tree with start_method="fork" (the default on Linux)::

    main process
      │  Engine start: os.fork() once, before any thread of the engine runs
      └──> zygote: one thread, SIGINT ignored, only the control socket open
             ├──fork──> worker 0      (parent-death signal armed: its parent
             ├──fork──> worker 1       is the zygote's only thread)
             └──fork──> replacement of a dead worker, any time later

    control socket, main <-> zygote (messages.py, framed by wire.py):
      main -> zygote  StartWorker carrying the worker's socket end (hang-up: stop)
      zygote -> main  Started carrying a pidfd of the worker
                      StartFailed                      fork() itself failed
                      Exited                           after the zygote reaped it
    worker sockets, main <-> each worker: the task protocol (messages.py).

Why a zygote: every worker and every replacement is a fork of the same
single-threaded image, taken when the engine started.  Replacements behave
exactly like the originals (no re-run of an unguarded script body, nothing
pickled, no lock copied from a running thread), the effective start method
never changes, and the main process forks only once per engine.

Ending: main watches each worker through its pidfd (readable when it ends)
and signals it through that pidfd (immune to pid reuse); the zygote reaps.
However the main process dies, the control socket hangs up, and the zygote
SIGKILLs every worker, reaps them and exits.  If the zygote itself is killed,
the workers get the parent-death signal.  Only the main process holds its end
of the control socket: every forked child closes it (see _fds).

spawn: each worker (and replacement) is a fresh interpreter started with
subprocess in a process group of its own, so a terminal's Ctrl-C never
reaches it (not even while its interpreter starts, when it could not ignore
it yet) and the main process never has to ignore SIGINT while starting it.
Its first frame carries multiprocessing's preparation data (sys.path, the
main module, as multiprocessing's spawn does) and its WorkerConfig.
forkserver: workers are multiprocessing processes, replacements too, whose
parent is multiprocessing's fork server: it reaps them and reports their ends
through a status pipe each (ForkServerWorker).
spawn and forkserver workers watch their own socket, whose other end only
the main process holds, and SIGKILL themselves when it hangs up (process_worker.py).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from multiprocessing.context import ForkServerProcess
from typing import TYPE_CHECKING, Any, NoReturn

from ..._core import watch_main_process
from ...errors import WorkerError
from .. import messages as m
from .. import os_threads
from ..os_signals import CATCHABLE_SIGNALS, reset_inherited_signals
from . import fds as _fds
from . import wire
from .heap import freeze_inherited_objects

if TYPE_CHECKING:
    from ..messages import WorkerConfig

# How long the zygote may take to fork a worker and answer.
ZYGOTE_REPLY_S = 10.0


@contextlib.contextmanager
def sigint_deferred() -> Iterator[None]:
    """Start children inside this: a signal with a Python handler (Ctrl-C,
    a program's SIGTERM or SIGALRM handler) neither lands between a fork and
    its bookkeeping nor reaches a child before it resets its handlers
    (NOTE [ Deferred signals ]: the same promise, for a section that forks).

    Those signals are blocked in this thread, so forked children inherit
    them blocked (and unblock them once reset: reset_inherited_signals).  In
    the main thread, a recording handler notes each that arrives meanwhile
    (whichever thread the kernel hands it to), and its own handler runs
    once the section is over: exactly one exception, the handler's, after
    the children are accounted for.  (They are never ignored meanwhile: the
    kernel may hand a signal to any thread that does not block it, numpy's
    BLAS threads included, and an ignored one is dropped.)"""
    handled: set[int] = {signal.SIGINT}
    for valid in CATCHABLE_SIGNALS:
        if callable(signal.getsignal(valid)):
            handled.add(valid)
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, handled)
    deferred: list[int] = []
    originals: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for num in sorted(handled):
            current = signal.getsignal(num)
            if callable(current):   # not SIG_IGN/SIG_DFL, nor None (a handler set from C)
                originals[num] = current
                signal.signal(num, lambda signum, frame: deferred.append(signum))
    try:
        yield
    finally:
        # A signal pending on this thread arrives on unblocking, and reaches
        # the recording handler or, once it is back, the original.
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        for num, original in originals.items():
            signal.signal(num, original)
        raised: BaseException | None = None
        for num in dict.fromkeys(deferred):   # each once, in order
            try:
                originals[num](num, sys._getframe())
            except BaseException as e:
                if raised is None:
                    raised = e
        if raised is not None:
            try:
                raise raised
            finally:
                raised = None


def ensure_fork_server() -> None:
    """Start multiprocessing's fork server (and its resource tracker) if they
    are not running, with SIGINT blocked as sigint_deferred promises: the
    tracker's start unblocks SIGINT in the calling thread when it is done, so
    a fork server spawned right after would inherit it unblocked and die of a
    Ctrl-C with a traceback while its interpreter starts."""
    from multiprocessing import forkserver, resource_tracker
    resource_tracker.ensure_running()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    forkserver.ensure_running()


class SpawnedWorker:
    """A spawn worker: a fresh interpreter in its own process group (the
    subset of multiprocessing.Process the engine uses)."""

    def __init__(self, config: WorkerConfig, sock: socket.socket, payload_fds: list[int]):
        """Start it serving `sock` (the caller closes its copy); it waits for
        hand_over(), which passes it `payload_fds` (inherit.py) with its config."""
        from multiprocessing import spawn, util
        prep = spawn.get_preparation_data(f"mxload-worker-{config.worker_id}")
        prep["authkey"] = bytes(prep["authkey"])   # pickled outside a spawning context
        self._handover: m.Handover | None = m.Handover(prep, config)
        self._payload_fds = payload_fds
        flags: list[str] = util._args_from_interpreter_flags()  # type: ignore[attr-defined]  # as mp's spawn
        entry = "from mxload._runtime.local.zygote import spawned_worker_main; spawned_worker_main()"
        cmd = [spawn.get_executable(), *flags, "-c", entry, str(sock.fileno())]
        self._popen = subprocess.Popen(cmd, pass_fds=[sock.fileno()], stdin=subprocess.DEVNULL,
                                       process_group=0)
        self.pid = self._popen.pid
        try:
            self.sentinel = os.pidfd_open(self.pid)   # ours until we reap it: no pid reuse
            _fds.own(self.sentinel)
        except BaseException:
            self._popen.kill()
            self._popen.wait()
            raise

    def hand_over(self, parent_end: socket.socket) -> None:
        """Send it what it needs through the main process's end of its socket
        (start several first: their interpreters start meanwhile).  Blocks
        until it reads a large dataset; if it died, its death is reported as
        any worker's (EPIPE here, never a hang)."""
        handover, self._handover = self._handover, None
        if handover is None:
            return
        try:
            wire.send(parent_end, handover, self._payload_fds)
        except OSError:
            pass

    @property
    def exitcode(self) -> int | None:
        return self._popen.poll()

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def terminate(self) -> None:
        if self._popen.poll() is None:
            self._popen.terminate()

    def kill(self) -> None:
        if self._popen.poll() is None:
            self._popen.kill()

    def close(self) -> None:
        # Not reaped yet (SIGKILLed, its end not seen by the shutdown's deadline): subprocess
        # keeps a Popen dropped while its child runs, and reaps it at the next subprocess start.
        fd, self.sentinel = getattr(self, "sentinel", -1), -1
        _fds.close_fd(fd)


class ForkServerWorker(ForkServerProcess):
    """multiprocessing's forkserver Process, which can be closed before its end is reported.

    The fork server, not this process, is a forkserver worker's parent: it reaps the worker and
    writes its exit status to a status pipe, which multiprocessing's Popen reads to learn the
    end.  Until then the Popen keeps that pipe and the worker's parent-alive pipe open, and
    Process.close() refuses; a Process left unclosed stays in multiprocessing's children with
    both until the program's next Process.start() after the report.  A fork server not run for
    a second (a loaded machine) let a shutdown's deadline pass so, and the failed iter() left a
    pipe pair per worker."""

    def close(self) -> None:
        popen = self._popen   # type: ignore[attr-defined]  # multiprocessing's, not in typeshed
        if popen is not None and popen.poll() is None:
            # Sent SIGKILL (end_processes): it ends, and the fork server reaps it and finds the
            # status pipe closed (as for a client that exited: it reports to no one).
            popen.close()                         # multiprocessing's finalizer: both pipes
            popen.returncode = -signal.SIGKILL    # what it was sent: close() reads no closed pipe
        # A closed Process refuses every question: its exit code is kept for those who ask later
        # (the iterator's torch-style _workers).
        self.final_exitcode = popen.returncode if popen is not None else None
        super().close()


def spawned_worker_main() -> None:
    """Entry point of a spawn worker's interpreter (see SpawnedWorker)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from multiprocessing import process, spawn

    from .process_worker import report_start_failure, worker_process_main
    sock = socket.socket(fileno=int(sys.argv[1]))
    # Before the main module is imported (spawn.prepare), which can take
    # seconds (torch, models): a main process killed meanwhile takes us along.
    watch_main_process(sock.fileno())
    handover, payload_fds = wire.recv(sock, "the descriptors of the dataset's multiprocessing objects",
                                      WorkerError, wire.MAX_FDS_PER_MESSAGE)
    if not isinstance(handover, m.Handover):
        raise wire.ProtocolError(
            f"a spawn worker's first message is a Handover, not {type(handover).__name__}")
    prep, config = handover
    config = dataclasses.replace(config, payload_fds=payload_fds)
    # As multiprocessing's spawn: while the main module is imported, this
    # process is "bootstrapping", so a script without the
    # ``if __name__ == "__main__":`` guard that starts workers again there
    # gets multiprocessing's RuntimeError instead of an endless chain of workers.
    me: Any = process.current_process()
    me._inheriting = True
    try:
        spawn.prepare(prep)   # sys.path, cwd and the main module, as multiprocessing's spawn does
    except BaseException as e:
        report_start_failure(sock, e, "importing the main module (as multiprocessing's spawn does)")
        raise
    finally:
        me._inheriting = False
    worker_process_main(config, sock)


class ZygoteWorker:
    """The main process's handle of one worker forked by the zygote (the
    subset of multiprocessing.Process the engine uses)."""

    def __init__(self, zygote: Zygote, pid: int, pidfd: int):
        self._zygote = zygote
        self.pid = pid
        self.sentinel = pidfd   # readable once the worker has ended

    def _ended(self, timeout: float = 0.0) -> bool:
        if self.sentinel < 0:
            return True
        return bool(select.select([self.sentinel], [], [], max(0.0, timeout))[0])

    @property
    def exitcode(self) -> int | None:
        """None while it runs, and until the zygote has reported reaping it
        (moments after its end; join() waits for that); then its exit code
        (negative: signal).  Never blocks: shutdown loops over it within its
        deadline, however late the zygote answers.  If the zygote died first,
        the worker's status went to init with it: it ended by the
        parent-death signal, SIGKILL."""
        if not self._ended():
            return None
        code = self._zygote.exit_code(self.pid, wait_s=0.0)
        if code is None and self._zygote.death() is not None:
            return -signal.SIGKILL
        return code

    def is_alive(self) -> bool:
        return not self._ended()

    def join(self, timeout: float | None = None) -> None:
        """Wait for it to end and for its exit code, at most `timeout` s."""
        deadline = time.monotonic() + (timeout if timeout is not None else 1e9)
        if self._ended(deadline - time.monotonic()):
            self._zygote.exit_code(self.pid, wait_s=deadline - time.monotonic())

    def _signal(self, sig: int) -> None:
        if self.sentinel >= 0:
            try:
                signal.pidfd_send_signal(self.sentinel, sig)
            except OSError:
                pass   # already ended

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def close(self) -> None:
        fd, self.sentinel = self.sentinel, -1
        _fds.close_fd(fd)


class Zygote:
    """The main process's side of the zygote (see the module docstring)."""

    def __init__(self, entry: Callable[[int, int, socket.socket], None]):
        """Fork the zygote.  `entry(worker_id, epoch, sock)` runs in each
        worker it forks.  Call with SIGINT deferred (sigint_deferred)."""
        main_end, zygote_end = socket.socketpair()
        _fds.own(main_end)
        os_threads.before_fork()
        with warnings.catch_warnings(record=True) as caught:
            # Python 3.12+ warns when forking with threads alive (a user's
            # thread: an honest warning).  Record it and re-issue it once the
            # zygote is accounted for, so an error filter cannot leak it.
            warnings.simplefilter("always", DeprecationWarning)
            python_threads = threading.active_count()
            pid = os.fork()
        if pid == 0:
            _zygote_main(zygote_end, entry)
        zygote_end.close()
        self.pid = pid
        try:
            self._pidfd = os.pidfd_open(pid)
        except BaseException:
            _fds.close_socket(main_end)   # the zygote exits on the hang-up
            os.waitpid(pid, 0)
            raise
        _fds.own(self._pidfd)
        self._sock: socket.socket | None = main_end
        self._lock = threading.Lock()
        self._exits: dict[int, int] = {}
        # With the pidfd; or why it failed (the zygote's StartFailed, a pidfd that did not fit here).
        self._replies: dict[int, tuple[m.Started, int] | m.StartFailed | WorkerError] = {}
        self._broken: str | None = None
        self._status: int | None = None   # the zygote's own exit code, once reaped
        try:
            for w in caught:
                if os_threads.fork_warning_counted_ending_threads(w, python_threads):
                    continue
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
        except BaseException:   # an error filter: the zygote must not outlive this
            self.close(time.monotonic() + 1.0)
            raise

    def start(self, worker_id: int, epoch: int, sock: socket.socket) -> ZygoteWorker:
        """Fork a worker that serves `sock` (the caller closes its copy)."""
        with self._lock:
            if self._sock is None or self._broken is not None:
                raise WorkerError(f"the worker zygote (pid {self.pid}) is gone: {self._broken or 'closed'}")
            try:
                wire.send(self._sock, m.StartWorker(worker_id, epoch), [sock.fileno()])
            except OSError as e:
                self._broken = f"its control socket failed ({e})"
                raise WorkerError(f"the worker zygote (pid {self.pid}) is gone: {self._broken}") from e
            deadline = time.monotonic() + ZYGOTE_REPLY_S
            while worker_id not in self._replies:
                if not self._pump(deadline):
                    if self._broken is not None:
                        raise WorkerError(f"the worker zygote (pid {self.pid}) is gone: {self._broken}")
                    raise WorkerError(f"the worker zygote (pid {self.pid}) did not start worker "
                                      f"{worker_id} within {ZYGOTE_REPLY_S} s")
            reply = self._replies.pop(worker_id)
        if isinstance(reply, WorkerError):
            reply.worker_id = worker_id
            raise reply
        if isinstance(reply, m.StartFailed):
            raise WorkerError(f"the worker zygote could not fork worker {worker_id}: {reply.reason}",
                              worker_id)
        started, pidfd = reply
        return ZygoteWorker(self, started.pid, pidfd)

    def exit_code(self, pid: int, wait_s: float) -> int | None:
        """The reported exit code of `pid`, waiting at most wait_s for it."""
        deadline = time.monotonic() + max(0.0, wait_s)
        # A start() waiting for its reply holds the lock: wait no longer than asked.
        if not self._lock.acquire(timeout=max(0.0, wait_s)):
            return self._exits.get(pid)
        try:
            while pid not in self._exits:
                if not self._pump(deadline):
                    return None
            return self._exits[pid]
        finally:
            self._lock.release()

    def death(self, wait_s: float = 0.5) -> str | None:
        """How the zygote ended ("killed by SIGKILL"...), None while it
        serves.  Its workers die with it (parent-death signal) and no worker
        can be started any more.  Waits at most wait_s for its exit status."""
        if self._lock.acquire(timeout=wait_s):
            try:
                while self._broken is None and self._pump(time.monotonic()):
                    pass   # read what is there: its reports, then its hang-up
            finally:
                self._lock.release()
        if self._broken is None:
            return None
        if self._status is None and self._pidfd >= 0 and select.select([self._pidfd], [], [], wait_s)[0]:
            try:
                _, status = os.waitpid(self.pid, 0)
                self._status = os.waitstatus_to_exitcode(status)
            except ChildProcessError:
                pass   # close() reaped it meanwhile
        if self._status is None:
            return "it hung up its control socket"
        if self._status < 0:
            try:
                return f"killed by {signal.Signals(-self._status).name}"
            except ValueError:
                return f"killed by signal {-self._status}"
        return f"exit code {self._status}"

    def _pump(self, deadline: float) -> bool:
        """Read one report (lock held); False on timeout or a dead zygote."""
        sock = self._sock
        if sock is None or self._broken is not None:
            return False
        if not select.select([sock], [], [], max(0.0, deadline - time.monotonic()))[0]:
            return False
        try:
            msg, fds = wire.recv(sock, "the pidfd (process descriptor) of a worker the zygote started",
                                 WorkerError)
        except WorkerError as e:   # out of descriptors here: a Started reply's pidfd did not fit
            started = getattr(e, "frame_message", None)
            if not isinstance(started, m.Started):
                self._broken = f"its report could not be received ({e})"
                return False
            # That worker runs untracked: it ends on the hang-up of its
            # socket, which the failed start closes, and the zygote reaps it.
            self._replies[started.worker_id] = e
            return True
        except (EOFError, OSError, wire.ProtocolError) as e:
            self._broken = f"it died ({e})" if not isinstance(e, EOFError) else "it died"
            return False
        if isinstance(msg, m.Exited):
            self._exits[msg.pid] = msg.exit_code
        elif isinstance(msg, m.Started):
            _fds.own(fds[0])
            self._replies[msg.worker_id] = (msg, fds[0])
        elif isinstance(msg, m.StartFailed):
            self._replies[msg.worker_id] = msg
        else:
            for fd in fds:
                os.close(fd)
            self._broken = f"it sent {type(msg).__name__}, not a zygote report"
            return False
        return True

    def close(self, deadline: float) -> None:
        """End the zygote: it SIGKILLs and reaps every worker still there,
        then exits; SIGKILL it at the deadline.  Reaps it."""
        sock = self._sock
        if sock is not None:
            # Wakes a start() waiting (lock held) for a late reply at once:
            # it reads the end of the channel, instead of holding the lock,
            # and this shutdown, for ZYGOTE_REPLY_S.
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        with self._lock:
            sock, self._sock = self._sock, None
        _fds.close_socket(sock)   # the hang-up is the zygote's stop request
        if self._pidfd < 0:
            return
        if not select.select([self._pidfd], [], [], max(0.0, deadline - time.monotonic()))[0]:
            try:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            except OSError:
                pass
        try:
            os.waitpid(self.pid, 0)   # it has ended, or ends within moments of SIGKILL
        except ChildProcessError:
            pass   # death() reaped it
        _fds.close_fd(self._pidfd)
        self._pidfd = -1


# ---------------------------------------------------------------- inside the zygote


def _zygote_main(sock: socket.socket, entry: Callable[[int, int, socket.socket], None]) -> NoReturn:
    code = 0
    try:
        # Ctrl-C belongs to the main process; the mask came blocked from the
        # forking thread, so a pending one is discarded here.
        reset_inherited_signals()
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        freeze_inherited_objects()   # the main process's heap: its workers inherit the freeze
        _detach_stdin()
        _serve_zygote(sock, entry)
    except BaseException:
        code = 1
        with contextlib.suppress(BaseException):
            traceback.print_exc()
    finally:
        os._exit(code)


def _detach_stdin() -> None:
    """As multiprocessing does for its children: workers never read the terminal."""
    try:
        sys.stdin.close()
        sys.stdin = open(os.devnull)   # noqa: SIM115 - lives as long as the process
    except (OSError, ValueError, AttributeError):
        pass


def die_with_parent(parent_pid: int) -> None:
    """Make this process die when `parent_pid`, whose only thread forked it,
    dies (Linux: the kernel's parent-death signal).  The parent may have died
    before the signal was armed, leaving us an orphan nothing would ever
    end: then end now."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            PR_SET_PDEATHSIG = 1
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except Exception:
            pass   # the check below still catches a parent already gone
    if os.getppid() != parent_pid:
        os._exit(1)


def _serve_zygote(sock: socket.socket, entry: Callable[[int, int, socket.socket], None]) -> None:
    children: dict[int, int] = {}   # pidfd -> pid
    zygote_pid = os.getpid()
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    try:
        while True:
            for fd, _ in poller.poll():
                if fd != sock.fileno():
                    pid = children.pop(fd)
                    poller.unregister(fd)
                    os.close(fd)
                    _, status = os.waitpid(pid, 0)
                    wire.send(sock, m.Exited(pid, os.waitstatus_to_exitcode(status)))
                    continue
                try:
                    msg, fds = wire.recv(sock, "the socket of a worker to start", WorkerError)
                except WorkerError as e:   # out of descriptors in the zygote: say which start failed
                    request = getattr(e, "frame_message", None)
                    if not isinstance(request, m.StartWorker):
                        return
                    wire.send(sock, m.StartFailed(request.worker_id, str(e)))
                    continue
                except (EOFError, OSError):
                    return   # the main process closed or died
                if not isinstance(msg, m.StartWorker):
                    return   # not a request of this protocol: nothing to serve
                worker_id, epoch = msg
                worker_sock = socket.socket(fileno=fds[0])
                try:
                    pid = os.fork()
                except OSError as e:
                    worker_sock.close()
                    wire.send(sock, m.StartFailed(worker_id, str(e)))
                    continue
                if pid == 0:
                    _worker_child(entry, worker_id, epoch, worker_sock, sock, list(children), zygote_pid)
                worker_sock.close()
                try:
                    pidfd = os.pidfd_open(pid)
                except OSError as e:   # out of descriptors in the zygote: this worker cannot be watched
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
                        os.waitpid(pid, 0)
                    wire.send(sock, m.StartFailed(worker_id, f"its pidfd: {e}"))
                    continue
                children[pidfd] = pid
                poller.register(pidfd, select.POLLIN)
                wire.send(sock, m.Started(worker_id, pid), [pidfd])
    except (BrokenPipeError, ConnectionResetError):
        return   # the main process closed its end (its shutdown) or died: no one to report to
    finally:
        for pid in children.values():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        for pid in children.values():
            with contextlib.suppress(OSError):
                os.waitpid(pid, 0)


def _worker_child(entry: Callable[[int, int, socket.socket], None], worker_id: int, epoch: int,
                  worker_sock: socket.socket, control: socket.socket, pidfds: list[int],
                  zygote_pid: int) -> NoReturn:
    code = 0
    try:
        die_with_parent(zygote_pid)
        control.close()   # only the zygote may hold it: the main process's death must hang it up
        for fd in pidfds:
            os.close(fd)
        entry(worker_id, epoch, worker_sock)
    except SystemExit as e:
        if isinstance(e.code, int):
            code = e.code
        elif e.code is not None:
            code = 1
            with contextlib.suppress(BaseException):
                print(e.code, file=sys.stderr)
    except BaseException:
        code = 1
        with contextlib.suppress(BaseException):
            traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(BaseException):
                stream.flush()
        os._exit(code)
