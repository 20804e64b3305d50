"""Shared fixtures: every test is checked for leftovers; the suite runs in tiers.

Tiers: a bare ``python -m pytest`` runs the fast default tier; a test marked with one of
OPT_IN_TIERS runs only when asked for (``-m faults``; ``-m ""`` runs every tier) or when
named (``pytest tests/test_faults.py``).  Every other test is marked ``fast`` here, so
``-m "not fast"`` runs the opt-in tiers alone (as CI does: its other steps run the fast
tier).  Random tests draw their seed from the ``seed`` fixture: ``MXLOAD_TEST_SEED``
replays one, and a failure prints the seed it used.

After each test (without a gc.collect(): mxload must not need one) no child
process, thread, file descriptor, /dev/shm entry or mapped slab that the test
created may remain.  Waits are bounded (shutdown is allowed to finish in the background
for a moment), so a leak fails the test instead of hanging it.
"""
from __future__ import annotations

import gc
import multiprocessing as mp
import os
import random
import signal
import socket
import sys
import threading
import time

import pytest
from extras import TORCH_INSTALLED

LEAK_WAIT_S = 3.0

# Markers whose tests stay out of a bare `pytest` run (pyproject.toml registers them).
OPT_IN_TIERS = ("faults", "chaos", "e2e", "ray", "races", "slow", "upstream")


# The test modules whose import imported torch (NOTE [ torch last ]).
TORCH_IMPORTED_BY = pytest.StashKey[list]()


def _chose_tests(config) -> bool:
    """Whether the command line picked the tests itself: a -m expression (even -m ""),
    or test files / ids named instead of the default testpaths."""
    args = [str(a) for a in config.invocation_params.args]
    if any(a == "-m" or (a.startswith("-m") and not a.startswith("--")) for a in args):
        return True
    return config.args_source != pytest.Config.ArgsSource.TESTPATHS


@pytest.hookimpl(tryfirst=True)   # before -m deselects: `-m fast` and `-m "not fast"` see the mark
def pytest_collection_modifyitems(config, items):
    keep, opt_in = [], []
    for item in items:
        tiered = any(item.get_closest_marker(tier) for tier in OPT_IN_TIERS)
        if not tiered:
            item.add_marker(pytest.mark.fast)
        if item.get_closest_marker("torch") and not TORCH_INSTALLED:
            item.add_marker(pytest.mark.skip(reason="needs the torch extra"))
        (opt_in if tiered else keep).append(item)
    if opt_in and not _chose_tests(config):
        config.hook.pytest_deselected(items=opt_in)
        items[:] = keep
    # NOTE [ torch last ]: a fork's cost grows with the forking process's private memory (on
    # these VMs, fork + exit of the test process: ~1 ms bare, ~28 ms once torch is imported,
    # its ~130 MB), and every engine forks the test process (the zygote) and the zygote its
    # workers.  So no test module imports torch at collection (tests/extras.py defers it) and
    # the tests marked `torch` run after all the others; no_leaks fails an unmarked test that
    # imports it, and test_leak_checks a module that does at collection (but tests/upstream/,
    # which must import torch's own test file to collect it, when pointed at one).
    items.sort(key=lambda item: item.get_closest_marker("torch") is not None)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    before = "torch" in sys.modules
    yield
    if isinstance(collector, pytest.Module) and not before and "torch" in sys.modules:
        collector.config.stash.setdefault(TORCH_IMPORTED_BY, []).append(collector.nodeid)


def start_methods(*methods: str) -> list:
    """Parameters over start methods (or "thread"): fork and threads in the default tier; spawn
    and forkserver, which start a fresh interpreter per worker (a second or more on 2 cores),
    in the `slow` tier."""
    return [pytest.param(m, marks=pytest.mark.slow) if m in ("spawn", "forkserver") else m
            for m in methods]


def wait_until(condition, timeout: float = 10.0, what: str = "the condition") -> None:
    """Poll `condition()` until it holds: how a test waits for another thread or process to
    reach a state (a buffer's waiters, a worker's pid...), never a sleep that hopes it got
    there.  AssertionError naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout} s")
        time.sleep(0.002)


def asleep_in(pid: int, tid: int | None = None) -> str:
    """The kernel function thread `tid` of process `pid` sleeps in ('' when it runs or is
    gone): e.g. poll_schedule_timeout for a thread blocked in poll(), futex_wait_queue for a
    condition variable or a lock.  With wait_until: wait for another process's thread to be
    blocked in a C wait, which no message from it can say."""
    base = f"/proc/{pid}/task/{tid if tid is not None else pid}"
    try:
        with open(f"{base}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] != "S":
                return ""
        with open(f"{base}/wchan") as f:
            return f.read().strip()
    except OSError:
        return ""


def next_in_thread(it) -> tuple[threading.Thread, list]:
    """Start a thread that calls next(it): (the thread, a list that gets next()'s batch or
    exception when it ends)."""
    got: list = []

    def take_one():
        try:
            got.append(next(it))
        except BaseException as e:
            got.append(e)

    consumer = threading.Thread(target=take_one)
    consumer.start()
    return consumer, got


def next_waiting_in_thread(it, thread_workers: bool, what: str) -> tuple[threading.Thread, list]:
    """next_in_thread(it), returned once the thread waits for its batch: in the buffer where
    the workers are threads, in poll() where it receives from worker processes itself."""
    consumer, got = next_in_thread(it)
    buffer = it.engine.buffer
    wait_until(lambda: buffer.waiting if thread_workers
               else "poll" in asleep_in(os.getpid(), consumer.native_id), what=what)
    return consumer, got


def exception_text(error: BaseException) -> str:
    """An exception as a traceback prints it: its cause (a worker's traceback), its notes
    (which worker, pid and batch) and its message."""
    import traceback
    return "".join(traceback.format_exception(error))


def race_rounds(default: int) -> int:
    """How many times a `races` test tries its race: MXLOAD_RACE_ROUNDS (long mode: 50)."""
    return int(os.environ.get("MXLOAD_RACE_ROUNDS", default))


def once_and_as_race(rounds: int) -> list:
    """The `rounds` parameter of a test that repeats a race: one round in the default tier (the
    behaviour), `rounds` (race_rounds) in the races tier.  The test runs tries(rounds) rounds."""
    return [pytest.param(None, id="once"), pytest.param(rounds, marks=pytest.mark.races, id="race")]


def tries(rounds: int | None) -> int:
    """How many rounds a once_and_as_race case runs."""
    return 1 if rounds is None else race_rounds(rounds)


@pytest.fixture
def seed(request) -> int:
    """A random test's seed: MXLOAD_TEST_SEED when set (to replay a failure), otherwise
    a fresh one; a failing test's report says which it was."""
    chosen = os.environ.get("MXLOAD_TEST_SEED")
    value = int(chosen) if chosen else random.SystemRandom().randrange(2 ** 32)
    request.node.stash[_SEED_KEY] = value
    return value


_SEED_KEY = pytest.StashKey[int]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if report.failed and _SEED_KEY in item.stash:
        report.sections.append(("seed", f"replay with MXLOAD_TEST_SEED={item.stash[_SEED_KEY]}"))


def _parents() -> dict:
    """pid -> ppid of every process (zombies included).  Every test reads it twice or more
    (no_leaks), over every process of the machine: read with raw os calls, half the time of
    open() and text decoding (this kernel has no /proc/<pid>/task/<tid>/children to walk
    our own tree instead)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fd = os.open(f"/proc/{entry}/stat", os.O_RDONLY)
        except OSError:
            continue   # gone meanwhile
        try:
            stat = os.read(fd, 4096)
        except OSError:
            continue
        finally:
            os.close(fd)
        if stat:
            parents[int(entry)] = int(stat.rsplit(b")", 1)[1].split(None, 2)[1])  # state, ppid, ...
    return parents


def child_pids() -> set:
    """Live (or zombie) direct children of this process."""
    me = os.getpid()
    return {pid for pid, ppid in _parents().items() if ppid == me}


def descendant_pids() -> set:
    """Children, grandchildren (workers forked by a zygote, or by the fork
    server: its children are ours to end too)... of this process."""
    parents = _parents()
    found, frontier = set(), {os.getpid()}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - found
        found |= frontier
    return found


def process_alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def assert_gone(pids, within: float = 2.0) -> None:
    """Every pid is gone (exited, reaped or a zombie) within `within` s."""
    deadline = time.monotonic() + within
    alive = list(pids)
    while time.monotonic() < deadline:
        alive = [p for p in pids if process_alive(p)]
        if not alive:
            return
        time.sleep(0.02)
    raise AssertionError(f"processes still alive after {within} s: {alive}")


def kill_and_expect_workers_gone(proc, pids, within: float) -> None:
    """SIGKILL the training process `proc`: every worker of its in `pids` must
    be gone within `within` s (its death is theirs)."""
    proc.kill()
    proc.wait(5)
    assert_gone(pids, within=within)


def end_child(proc, orphans=()) -> None:
    """A test's cleanup of the child process it started: end it, and any of
    `orphans` (its workers) still alive, which a failing test would leave."""
    for pid in orphans:
        if process_alive(pid):
            os.kill(pid, signal.SIGKILL)
    proc.kill()
    proc.wait(5)
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


def open_fds() -> set:
    return set(os.listdir("/proc/self/fd"))


# /dev/shm is machine-wide: other programs (a training job, another pytest run) create and
# remove entries there at any moment.  mxload's own names (its POSIX-shm fallback) always
# count; the others that this process tree could have made (multiprocessing's semaphores and
# SharedMemory, torch) count only while one of our processes has them open or mapped.
OWN_SHM_PREFIX = "mxload"
SHM_PREFIXES = (OWN_SHM_PREFIX, "psm_", "sem.mp-", "mp-", "torch_")


def shm_entries() -> set:
    try:
        return {name for name in os.listdir("/dev/shm") if name.startswith(SHM_PREFIXES)}
    except FileNotFoundError:
        return set()


def _shm_names_held_by(pids) -> set:
    """/dev/shm names that the processes `pids` have open or mapped."""
    held = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                held.update(line.rsplit("/dev/shm/", 1)[1].split()[0] for line in f if "/dev/shm/" in line)
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("/dev/shm/"):
                    held.add(target[len("/dev/shm/"):].split()[0])
        except OSError:
            continue   # gone meanwhile, or not ours to read
    return held


def shm_entries_of_ours(new: set) -> set:
    """Of the /dev/shm entries `new` (made while a test ran), those of this process tree."""
    foreign_looking = {name for name in new if not name.startswith(OWN_SHM_PREFIX)}
    held = _shm_names_held_by({os.getpid()} | descendant_pids()) if foreign_looking else set()
    return (new - foreign_looking) | (foreign_looking & held)


def is_slab_mapping(maps_line: str) -> bool:
    """Whether a /proc/self/maps line maps an mxload slab: a memfd named
    mxload-slab, or (without memfd_create) a POSIX shm object /mxload-*.  Only the
    file name counts: a library under a folder called mxload-* is no slab."""
    parts = maps_line.split(None, 5)
    path = parts[5].strip() if len(parts) == 6 else ""
    return path.startswith(("/memfd:mxload-slab", "/dev/shm/mxload-"))


def slab_mappings(pid: int | str = "self") -> set:
    """Address ranges where this process (or process `pid`) maps an mxload slab:
    a slab still mapped after the test is memory the test leaked."""
    with open(f"/proc/{pid}/maps") as f:
        maps = f.read()
    # Read at each test's start and end: only the lines that can name a slab are parsed.
    return {line.split(None, 1)[0] for line in maps.splitlines()
            if "mxload-" in line and is_slab_mapping(line)}


def thread_idents() -> set:
    return {t.ident for t in threading.enumerate()}


@pytest.fixture(scope="session", autouse=True)
def _long_lived_helpers():
    """multiprocessing's fork server and resource tracker live for the whole
    session by design; start them first so they are part of every baseline."""
    from multiprocessing import forkserver, resource_tracker
    forkserver.ensure_running()
    resource_tracker.ensure_running()
    yield


# NOTE [ frozen session heap ]: the test process holds every collected test module, item and
# pytest's own state (~0.5 M objects; ~0.2 M more once torch is imported), and every full
# collection walked them all: 0.05-0.2 s for each gc.collect() a test makes to free the cycles
# it made itself, and for each of the collector's own full passes.  They live as long as the
# session, so they are frozen (gc.freeze) once collected, and again once torch is imported
# (before the next test's baseline): a collection then walks what the session made since,
# every test's own objects included, so nothing a test checks by collecting escapes it.
_FROZEN_WITH_TORCH = False


def pytest_collection_finish(session):
    gc.collect()
    gc.freeze()


def _freeze_torch_once_imported() -> None:
    global _FROZEN_WITH_TORCH
    if not _FROZEN_WITH_TORCH and "torch" in sys.modules:
        _FROZEN_WITH_TORCH = True
        gc.collect()
        gc.freeze()


def _snapshot() -> dict:
    return {"children": descendant_pids(), "threads": thread_idents(), "fds": open_fds(),
            "shm": shm_entries(), "slab mappings": slab_mappings()}


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _fd_target(fd: str) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


class RayAllowance:
    """What Ray itself may add while a test marked `ray` runs (and nothing
    of mxload's): idle pool workers the raylet starts at will, the processes
    of a cluster node the test added (ray_harness.replace_remote_node) and
    theirs; never a loader's actor (titled ray::LoaderActor, it must be
    gone).  Also the gRPC (TCP) sockets and event descriptors Ray's core
    worker opens to new actors and keeps cached, and those its gRPC server
    accepted from a node that died: Ray shuts such a connection down at once
    but keeps its descriptor until the dead node's pending long poll ends
    (over a minute; a bare-Ray script with one actor borrowing a ray.put
    object on the killed node keeps it too).  mxload's Ray backend opens no
    socket, pipe or slab itself, and a local worker's leaked socketpair (an
    AF_UNIX socket) is still reported."""

    @staticmethod
    def child(pid: int) -> bool:
        command = _cmdline(pid)
        if "LoaderActor" in command:
            return False
        if command.startswith("ray::IDLE"):
            return True
        from ray_harness import infrastructure_pids
        allowed, parents = infrastructure_pids(), _parents()
        while pid in parents and pid not in allowed:
            pid = parents[pid]
        return pid in allowed

    @staticmethod
    def fd(fd: str) -> bool:
        target = _fd_target(fd)
        if target.startswith("socket:["):   # only TCP (gRPC): a worker's socketpair is AF_UNIX
            return _socket_kind(int(fd)) in ("AF_INET/SOCK_STREAM", "AF_INET6/SOCK_STREAM")
        return target.startswith("anon_inode:")


def _socket_kind(fd: int) -> str:
    """The family and type of this process's socket `fd`, asked of the socket
    itself: a TCP connection shut down after its peer died is in no
    /proc/net/tcp table, yet still open and still TCP.  "" if it is gone."""
    try:
        dup = os.dup(fd)
    except OSError:
        return ""   # closed meanwhile
    try:
        sock = socket.socket(fileno=dup)   # reads the family and type from the descriptor
    except OSError:
        os.close(dup)
        return ""
    with sock:   # closes the duplicate only
        return f"{sock.family.name}/{sock.type.name}"


def leftovers(before: dict, allowance: type[RayAllowance] | None = None) -> dict:
    """What exists now that did not before (fds re-checked: still open), less
    what `allowance` lets Ray add."""
    now = _snapshot()
    found = {key: sorted(now[key] - before[key], key=str) for key in before}
    found["shm"] = sorted(shm_entries_of_ours(set(found["shm"])))
    if allowance is not None:
        found["children"] = [p for p in found["children"] if not allowance.child(p)]
        found["fds"] = [fd for fd in found["fds"] if not allowance.fd(fd)]
    if found["fds"]:
        described = []
        for fd in found["fds"]:
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue  # closed while we looked (e.g. listdir's own fd)
            kind = f" ({_socket_kind(int(fd))})" if target.startswith("socket:[") else ""
            described.append(f"{fd}->{target}{kind}")
        found["fds"] = described
    if found["threads"]:
        found["threads"] = [t.name for t in threading.enumerate() if t.ident in found["threads"]]
    return {k: v for k, v in found.items() if v}


def assert_no_leftovers(before: dict, wait_s: float = LEAK_WAIT_S,
                        allowance: type[RayAllowance] | None = None) -> None:
    """Wait (bounded) for what the test left to go.  Processes, threads, fds and shm entries
    must go without a collection; a slab still mapped may be held by a cycle the test made
    itself (pytest.raises keeps the traceback, whose frame holds the loop variable), so once
    nothing else is left it gets one collection at once, not after the whole wait."""
    deadline = time.monotonic() + wait_s
    collected = False
    found = leftovers(before, allowance)
    while found:
        if not collected and set(found) == {"slab mappings"}:
            gc.collect()
            collected = True
        elif time.monotonic() < deadline:
            time.sleep(0.02)
        else:
            break
        found = leftovers(before, allowance)
    assert not found, f"left behind after the test: {found}"


@pytest.fixture(autouse=True)
def no_leaks(request):
    """Autouse: fail any test that leaves a process, thread, fd or shm entry, or imports torch
    unmarked (NOTE [ torch last ]).
    Tests marked `ray` may leave what Ray itself adds (RayAllowance), and are
    also checked in Ray's own records (ray_harness.assert_nothing_of_ours)."""
    ray_test = request.node.get_closest_marker("ray") is not None
    torch_before = "torch" in sys.modules
    _freeze_torch_once_imported()   # NOTE [ frozen session heap ]
    before = _snapshot()
    yield before
    if not torch_before and "torch" in sys.modules and not request.node.get_closest_marker("torch"):
        pytest.fail("this test imported torch without the `torch` mark: mark it, so that it runs after "
                    "the tests that do not need torch (NOTE [ torch last ] in conftest.py)")
    if ray_test:
        from ray_harness import assert_nothing_of_ours
        assert_nothing_of_ours()
    assert_no_leftovers(before, allowance=RayAllowance if ray_test else None)
    assert not mp.active_children(), "multiprocessing still lists live children"
