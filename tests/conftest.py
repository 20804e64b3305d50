"""Shared fixtures: every test is checked for leftovers.

After each test (without a gc.collect(): mxload must not need one) no child
process, thread, file descriptor, /dev/shm entry or mapped slab that the test
created may remain.  Waits are bounded (shutdown is allowed to finish in the background
for a moment), so a leak fails the test instead of hanging it.
"""
from __future__ import annotations

import gc
import multiprocessing as mp
import os
import signal
import threading
import time

import pytest

LEAK_WAIT_S = 3.0


def _parents() -> dict:
    """pid -> ppid of every process (zombies included)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry)] = int(fields[1])  # fields: state, ppid, ...
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


# /dev/shm is machine-wide: other programs create and remove entries there at any moment.
# Only names that this process (mxload, multiprocessing, torch) could have made count.
SHM_PREFIXES = ("mxload", "psm_", "sem.mp-", "mp-", "torch_")


def shm_entries() -> set:
    try:
        return {name for name in os.listdir("/dev/shm") if name.startswith(SHM_PREFIXES)}
    except FileNotFoundError:
        return set()


def is_slab_mapping(maps_line: str) -> bool:
    """Whether a /proc/self/maps line maps an mxload slab: a memfd named
    mxload-slab, or (without memfd_create) a POSIX shm object /mxload-*.  Only the
    file name counts: a library under a folder called mxload-* is no slab."""
    parts = maps_line.split(None, 5)
    path = parts[5].strip() if len(parts) == 6 else ""
    return path.startswith(("/memfd:mxload-slab", "/dev/shm/mxload-"))


def slab_mappings() -> set:
    """Address ranges where this process maps an mxload slab: a slab still mapped
    after the test is memory the test leaked."""
    with open("/proc/self/maps") as f:
        return {line.split(None, 1)[0] for line in f if is_slab_mapping(line)}


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
    worker opens to new actors and keeps cached: mxload's Ray backend opens
    no socket, pipe or slab itself, and a local worker's leaked socketpair
    is still reported."""

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
            return target[len("socket:["):-1] in _tcp_inodes()
        return target.startswith("anon_inode:")


def _tcp_inodes() -> set:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                inodes.update(line.split()[9] for line in list(f)[1:])
        except (OSError, IndexError):
            pass
    return inodes


def leftovers(before: dict, allowance: type[RayAllowance] | None = None) -> dict:
    """What exists now that did not before (fds re-checked: still open), less
    what `allowance` lets Ray add."""
    now = _snapshot()
    found = {key: sorted(now[key] - before[key], key=str) for key in before}
    if allowance is not None:
        found["children"] = [p for p in found["children"] if not allowance.child(p)]
        found["fds"] = [fd for fd in found["fds"] if not allowance.fd(fd)]
    if found["fds"]:
        described = []
        for fd in found["fds"]:
            try:
                described.append(f"{fd}->{os.readlink(f'/proc/self/fd/{fd}')}")
            except OSError:
                continue  # closed while we looked (e.g. listdir's own fd)
        found["fds"] = described
    if found["threads"]:
        found["threads"] = [t.name for t in threading.enumerate() if t.ident in found["threads"]]
    return {k: v for k, v in found.items() if v}


def assert_no_leftovers(before: dict, wait_s: float = LEAK_WAIT_S,
                        allowance: type[RayAllowance] | None = None) -> None:
    deadline = time.monotonic() + wait_s
    found = leftovers(before, allowance)
    while found and time.monotonic() < deadline:
        time.sleep(0.02)
        found = leftovers(before, allowance)
    if set(found) == {"slab mappings"}:
        # A batch may still be referenced from a cycle the test made itself (pytest.raises
        # keeps the traceback, whose frame holds the loop variable): only a slab that
        # survives a collection is mxload's leak.
        gc.collect()
        found = leftovers(before, allowance)
    assert not found, f"left behind after the test: {found}"


@pytest.fixture(autouse=True)
def no_leaks(request):
    """Autouse: fail any test that leaves a process, thread, fd or shm entry.
    Tests marked `ray` may leave what Ray itself adds (RayAllowance), and are
    also checked in Ray's own records (ray_harness.assert_nothing_of_ours)."""
    ray_test = request.node.get_closest_marker("ray") is not None
    before = _snapshot()
    yield before
    if ray_test:
        from ray_harness import assert_nothing_of_ours
        assert_nothing_of_ours()
    assert_no_leftovers(before, allowance=RayAllowance if ray_test else None)
    assert not mp.active_children(), "multiprocessing still lists live children"
