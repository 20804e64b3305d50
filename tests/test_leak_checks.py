"""The leak checks of conftest.py see what a test leaves, and only that."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import fresh_python
import pytest
from conftest import TORCH_IMPORTED_BY, _snapshot, is_slab_mapping, leftovers

from mxload._runtime.local.slabs import create_shared_fd, map_slab

pytestmark = pytest.mark.timeout(30)


def test_a_mapped_slab_left_behind_is_reported():
    before = _snapshot()
    fd = create_shared_fd(65536)
    slab = map_slab(fd, 65536)
    os.close(fd)
    assert "slab mappings" in leftovers(before)
    del slab
    assert leftovers(before) == {}


def test_shm_entries_of_others_are_ignored_and_ours_reported():
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    before = _snapshot()
    foreign = f"/dev/shm/someone-else-{os.getpid()}"
    ours = f"/dev/shm/mxload-leak-check-{os.getpid()}"
    try:
        open(foreign, "w").close()
        assert leftovers(before) == {}
        open(ours, "w").close()
        assert leftovers(before) == {"shm": [os.path.basename(ours)]}
    finally:
        for path in (foreign, ours):
            if os.path.exists(path):
                os.unlink(path)


def test_semaphores_count_only_while_this_process_tree_holds_them():
    """Another program's multiprocessing semaphore (a training job, another pytest run) made
    while the test ran is not the test's leak; one this process still holds is."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    before = _snapshot()
    theirs = f"/dev/shm/sem.mp-someone-else-{os.getpid()}"
    ours = f"/dev/shm/sem.mp-leak-check-{os.getpid()}"
    held = None
    try:
        open(theirs, "w").close()                 # made, then closed: nobody here holds it
        assert leftovers(before) == {}
        held = open(ours, "w")                    # still open in this process
        assert leftovers(before) == {"shm": [os.path.basename(ours)]}
    finally:
        if held is not None:
            held.close()
        for path in (theirs, ours):
            if os.path.exists(path):
                os.unlink(path)


def test_only_slab_files_count_as_slab_mappings():
    prefix = "7f00-7f10 rw-s 00000000 00:01 1234                       "
    assert is_slab_mapping(prefix + "/memfd:mxload-slab (deleted)\n")
    assert is_slab_mapping(prefix + "/dev/shm/mxload-0123abcd\n")
    assert not is_slab_mapping("7f00-7f10 r-xp 00000000 08:01 99  /tmp/mxload-ci.X/venv/lib/libtorch.so\n")
    assert not is_slab_mapping("7f00-7f10 rw-p 00000000 00:00 0 \n")


def test_ray_allowance_is_narrow():
    """What tests marked `ray` may leave: Ray's idle pool workers and its TCP
    (gRPC) sockets; never a loader's actor, another process, or a socketpair."""
    import socket

    from conftest import RayAllowance

    before = _snapshot()
    idle = subprocess.Popen(["bash", "-c", "exec -a ray::IDLE sleep 30"])
    actor = subprocess.Popen(["bash", "-c", "exec -a ray::LoaderActor sleep 30"])
    other = subprocess.Popen(["sleep", "30"])
    pair = socket.socketpair()
    tcp = socket.socket()
    try:
        tcp.bind(("127.0.0.1", 0))
        tcp.listen()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not all(
                open(f"/proc/{p.pid}/cmdline", "rb").read().startswith((b"ray::", b"sleep"))
                for p in (idle, actor, other)):
            time.sleep(0.01)   # bash has not exec'd yet
        found = leftovers(before, RayAllowance)
        assert sorted(found["children"]) == sorted([actor.pid, other.pid])
        reported = {int(fd.split("->")[0]) for fd in found["fds"]}
        # The socketpair's ends (one may reuse a number the snapshot saw open), never the TCP socket.
        assert reported and reported <= {pair[0].fileno(), pair[1].fileno()}, found["fds"]
    finally:
        for p in (idle, actor, other):
            p.kill()
            p.wait()
        for s in (*pair, tcp):
            s.close()


def _collected(*args: str) -> set[str]:
    """Test ids a fresh pytest collects from this folder with `args`."""
    here = os.path.dirname(os.path.abspath(__file__))
    done = fresh_python.run_args("-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args,
                                 cwd=os.path.dirname(here))
    assert done.returncode == 0, done.stdout + done.stderr
    return {line for line in done.stdout.splitlines() if "::" in line}


@pytest.mark.e2e
def test_tiers_split_the_suite_into_the_default_tier_and_the_opt_in_ones():
    # CI runs -m "not fast" once and the default tier in its other steps: together, every test.
    files = ("tests/test_loader.py", "tests/test_leak_checks.py")
    every, fast, opt_in = (_collected(*files, *m) for m in (["-m", ""], ["-m", "fast"], ["-m", "not fast"]))
    assert fast and opt_in and not fast & opt_in and fast | opt_in == every
    assert "tests/test_loader.py::test_worker_info_seeds_and_init_fn[fork]" in fast
    assert "tests/test_loader.py::test_worker_info_seeds_and_init_fn[spawn]" in opt_in
    assert not [t for t in fast if "[spawn" in t or "[forkserver" in t]
    this_test = sys._getframe().f_code.co_name
    assert f"tests/test_leak_checks.py::{this_test}" in opt_in
    bare = _collected()   # nothing named, no -m: the default tier of the whole suite
    assert {t for t in bare if t.startswith(files)} == fast


def test_no_test_module_imports_torch_at_collection(pytestconfig):
    """NOTE [ torch last ] (conftest.py): torch is imported by the first test that uses it (the
    tests marked `torch`, run last), never while pytest collects the modules, so the tests before
    them fork a test process without torch's memory.  A module that imports torch at its top
    fails here: defer it (tests/extras.py).  (tests/upstream/ imports torch's own test file to
    collect its tests, when MXLOAD_TORCH_TEST_DATALOADER points at one.)"""
    modules = pytestconfig.stash.get(TORCH_IMPORTED_BY, [])
    assert [m for m in modules if not m.startswith("tests/upstream/")] == [], "imported torch at collection"
