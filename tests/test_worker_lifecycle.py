"""Worker processes under attack: deaths (one or many at once, at any moment),
restarts, parent death, forked children, Ctrl-C while workers start.

Part of the fault suite (``pytest -m faults``).  The chaos test runs for
MXLOAD_CHAOS_SECONDS per start method (default 4; the acceptance run uses 30).
"""
from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import threading
import time
import warnings

import fresh_python
import numpy as np
import pytest
from conftest import (
    asleep_in,
    assert_gone,
    end_child,
    kill_and_expect_workers_gone,
    process_alive,
    wait_until,
)
from datasets_for_tests import PayloadDataset, SlowDataset, TupleDataset

import mxload

pytestmark = [pytest.mark.faults, pytest.mark.timeout(120)]

ALL_METHODS = ["fork", "spawn", "forkserver"]
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
CHAOS_SECONDS = float(os.environ.get("MXLOAD_CHAOS_SECONDS", "4"))


class ChaosDataset(mxload.Dataset):
    """Sample i: an array whose length cycles with i // group (so slabs keep
    being outgrown and new ones announced with their descriptor), and label i."""

    def __init__(self, n: int, delay: float = 0.001, group: int = 4):
        self.n = n
        self.delay = delay
        self.group = group

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        time.sleep(self.delay)
        return np.full(256 * (1 + (i // self.group) % 97), i, np.int32), i


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


class Killer(threading.Thread):
    """For `seconds`, SIGKILLs a random live worker of `engine` every
    min_s..max_s seconds."""

    def __init__(self, engine, seconds: float, min_s: float, max_s: float, seed: int = 0):
        super().__init__(name="chaos-killer", daemon=True)
        self.engine = engine
        self.seconds = seconds
        self.min_s, self.max_s = min_s, max_s
        self.rng = random.Random(seed)
        self.stop = threading.Event()
        self.kills = 0

    def run(self) -> None:
        parents = (os.getpid(), self.engine.transport.zygote_pid)
        if self.engine.transport.start_method == "forkserver":
            from multiprocessing import forkserver
            parents += (forkserver._forkserver._forkserver_pid,)
        end = time.monotonic() + self.seconds
        while not self.stop.wait(self.rng.uniform(self.min_s, self.max_s)) and time.monotonic() < end:
            pids = [p for p in self.engine.worker_pids() if p is not None]
            if not pids:
                continue
            pid = self.rng.choice(pids)
            if _ppid(pid) in parents and process_alive(pid):   # still a worker: never a reused pid
                try:
                    os.kill(pid, signal.SIGKILL)
                    self.kills += 1
                except ProcessLookupError:
                    pass


def _expected_labels(idx: int, batch_size: int, n: int) -> list[int]:
    return list(range(idx * batch_size, min((idx + 1) * batch_size, n)))


def _through_the_storm(it, killer, bs: int, n: int, train=None) -> int:
    """Take `it`'s batches while `killer` runs, then 20 more (the epoch goes
    on normally), checking each is the next in order; `train()` after each.
    Returns the batches taken."""
    killer.start()
    got = 0
    try:
        after = None
        for idx, (data, labels) in enumerate(it):
            assert labels.tolist() == _expected_labels(idx, bs, n), f"batch {idx}"
            assert (data == labels[:, None]).all(), f"batch {idx} data"
            got += 1
            if train is not None:
                train()
            if after is None and not killer.is_alive():
                after = idx + 20
            if after is not None and idx >= after:
                break
    finally:
        killer.stop.set()
        killer.join(5)
    return got


@pytest.mark.chaos
@pytest.mark.parametrize("start_method", ALL_METHODS)
def test_chaos_random_kills_every_batch_exactly_once_in_order(start_method, seed):
    """Workers SIGKILLed every 50-200 ms at random moments (mid-batch, mid-send of
    a new slab, while starting): every batch arrives exactly once, in order,
    and the fetcher never fails."""
    n, bs = 1_000_000, 4
    loader = mxload.DataLoader(ChaosDataset(n), batch_size=bs, num_workers=4, start_method=start_method,
                               max_worker_restarts=1_000_000, timeout=60)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)   # one "restarting" warning per kill
        it = iter(loader)
        killer = Killer(it.engine, CHAOS_SECONDS, 0.05, 0.2, seed=seed)
        got = _through_the_storm(it, killer, bs, n)
        it.close()
    assert killer.kills >= CHAOS_SECONDS / 0.5, killer.kills
    assert loader.stats["worker_restarts"] >= 1
    print(f"\nchaos {start_method}: {got} batches exactly once in order, {killer.kills} kills, "
          f"{loader.stats['worker_restarts']} restarts")


@pytest.mark.chaos
@pytest.mark.parametrize("start_method", ALL_METHODS)
def test_chaos_kills_while_a_training_loop_holds_tasks_every_batch_exactly_once_in_order(start_method, seed):
    """As the chaos test, with a loop that trains (0.5-3 ms a batch) on
    workers faster than it: tasks are held back for their worker's next one
    (two per message) when the kills land, and a worker dies with tasks of
    its held, sent, or half sent.  Every batch arrives exactly once, in
    order, never a hang."""
    n, bs = 1_000_000, 4
    rng = random.Random(seed)
    loader = mxload.DataLoader(ChaosDataset(n, delay=0), batch_size=bs, num_workers=3,
                               start_method=start_method, max_worker_restarts=1_000_000, timeout=60,
                               prefetch=9)   # deep enough to hold tasks
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)   # one "restarting" warning per kill
        it = iter(loader)
        # A spawned worker takes ~0.1 s to start: kills that far apart let each serve a while.
        gap = (0.02, 0.15) if start_method == "fork" else (0.15, 0.5)
        killer = Killer(it.engine, CHAOS_SECONDS / 2, *gap, seed=seed + 1)

        def train() -> None:   # 0.5-3 ms, busy: the GIL is held
            end = time.perf_counter() + rng.uniform(0.0005, 0.003)
            while time.perf_counter() < end:
                pass
        got = _through_the_storm(it, killer, bs, n, train)
        it.close()
    stats = loader.stats
    assert killer.kills >= CHAOS_SECONDS / 2 / gap[1] / 2, killer.kills
    assert stats["worker_restarts"] >= 1
    assert stats["tasks_sent"] > stats["task_messages"], stats   # tasks were held, and went in pairs
    print(f"\nchaos with a training loop, {start_method}: {got} batches exactly once in order, "
          f"{killer.kills} kills, {stats['tasks_sent']} tasks in {stats['task_messages']} messages")


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_workers_dying_together_are_all_restarted(start_method):
    """Several workers killed at the same moment die in one fetcher round; their
    replacements' sockets reuse the dead ones' descriptor numbers."""
    loader = mxload.DataLoader(SlowDataset(0.002, n=100_000), batch_size=2, num_workers=4,
                               start_method=start_method, max_worker_restarts=10_000, timeout=60)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        it = iter(loader)
        idx = 0
        rounds = 12 if start_method == "fork" else 4
        for _ in range(rounds):
            before = loader.stats["worker_restarts"]
            for pid in reversed(it.engine.worker_pids()):
                os.kill(pid, signal.SIGKILL)
            while loader.stats["worker_restarts"] < before + 4:
                batch = next(it)
                assert batch.ravel().tolist() == [2 * idx, 2 * idx + 1]
                idx += 1
        for _ in range(8):
            assert next(it).ravel().tolist() == [2 * idx, 2 * idx + 1]
            idx += 1
        it.close()


# ---------------------------------------------------------------- whole-process scenarios


_IMPORTS = "from datasets_for_tests import PayloadDataset, SlowDataset, TupleDataset, DyingDataset"


def _script(body: str) -> str:
    return fresh_python.script(body, _IMPORTS)


def _run(body: str, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    return fresh_python.run(body, imports=_IMPORTS, timeout=timeout, **kw)


def _popen(body: str, **kw) -> subprocess.Popen:
    return fresh_python.start(body, imports=_IMPORTS, **kw)


_finish = fresh_python.finish


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_a_forked_child_exiting_normally_leaves_the_parents_workers_alone(start_method):
    result = _run(f"""
        loader = mxload.DataLoader(TupleDataset(64), batch_size=2, num_workers=2,
                                   start_method={start_method!r})
        it = iter(loader)
        first = next(it)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)   # our own fork, threads alive
            pid = os.fork()
        if pid == 0:
            del it   # as a child would, dropping what it inherited, then a normal exit
            sys.exit(0)
        _, status = os.waitpid(pid, 0)
        rest = list(it)
        print(os.waitstatus_to_exitcode(status), 1 + len(rest), flush=True)
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["0", "32"], result.stderr


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_ctrl_c_while_workers_start_is_one_keyboard_interrupt(start_method, seed):
    """SIGINT to the whole group at random moments of a loop that mostly starts
    workers: the main thread gets exactly one KeyboardInterrupt every time and
    nothing is left behind."""
    for trial in range(3):
        proc = _popen(f"""
            from conftest import child_pids
            from datasets_for_tests import PayloadDataset
            # 4 MB: slow to hand to spawned workers, so most of the time is start-up
            loader = mxload.DataLoader(PayloadDataset(np.zeros(4 << 20, np.uint8)), batch_size=2,
                                       num_workers=4, start_method={start_method!r})
            print("ready", flush=True)
            pending = []
            it = None
            try:
                while True:
                    it = None
                    it = iter(loader)
                    # Only start-up is under test here: a Ctrl-C during the
                    # close is held back and re-raised after it.
                    signal.signal(signal.SIGINT, lambda *a: pending.append(1))
                    it.close()
                    signal.signal(signal.SIGINT, signal.default_int_handler)
                    if pending:
                        raise KeyboardInterrupt
            except KeyboardInterrupt:
                print("caught", flush=True)
                if it is not None:
                    # Landed after iter() returned: the program holds a live
                    # iterator, as after any statement; it closes it (or exits).
                    it.close()
            from multiprocessing import resource_tracker
            def children():
                return sorted(child_pids() - {{resource_tracker._resource_tracker._pid}})
            deadline = time.monotonic() + 3
            while children() and time.monotonic() < deadline:
                time.sleep(0.02)
            if children():   # what still holds the workers (for the failure message)
                import gc
                for o in gc.get_objects():
                    if type(o).__name__ in ("Engine", "EpochIterator"):
                        print("alive:", o, [type(r).__name__ for r in gc.get_referrers(o)], file=sys.stderr)
            print("children", children(), flush=True)
            print("threads", threading.active_count(), flush=True)
        """, start_new_session=True)
        try:
            assert proc.stdout.readline().strip() == "ready"
            time.sleep(random.Random(seed).uniform(0.3, 1.2))
            os.killpg(proc.pid, signal.SIGINT)
            out, err = _finish(proc, timeout=40)   # a loaded machine starts 4 interpreters slowly
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        assert out.splitlines() == ["caught", "children []", "threads 1"], (trial, out, err)
        assert "KeyboardInterrupt" not in err, err


def test_kept_batches_do_not_hold_a_descriptor_each():
    """list(loader) of 1,600 batches under RLIMIT_NOFILE=256: the main process
    keeps a bounded number of slab descriptors, not one per live batch."""
    result = _run("""
        import resource
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
        loader = mxload.DataLoader(TupleDataset(3200), batch_size=2, num_workers=2)
        batches = list(loader)
        assert [int(b[1][0]) for b in batches] == list(range(0, 3200, 2))
        print(len(batches), len(os.listdir("/proc/self/fd")) < 64, flush=True)
    """, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["1600", "True"]


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_a_restart_still_starting_when_the_epoch_ends_is_stopped(start_method):
    from multiprocessing import forkserver
    server = forkserver._forkserver._forkserver_pid
    served_before = {p for p in _all_pids() if _ppid(p) == server}
    payload = np.zeros(2 << 20, np.uint8)   # a slow start: the replacement reads 2 MB first
    for _ in range(3):
        ds = PayloadDataset(payload, 24)
        loader = mxload.DataLoader(ds, batch_size=2, num_workers=2, start_method=start_method,
                                   max_worker_restarts=5, prefetch=2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            it = iter(loader)
            got = [int(next(it)[0, 0]) for _ in range(10)]
            victim = it.engine.worker_pids()[0]
            os.kill(victim, signal.SIGKILL)
            time.sleep(0.2)   # the fetcher is now starting its replacement (reading 2 MB first)
            got += [int(b[0, 0]) for b in it]
        assert got == list(range(0, 24, 2))
        assert loader.stats["worker_restarts"] == 1
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        left = {p for p in _all_pids() if _ppid(p) == server and process_alive(p)} - served_before
        if not left:
            break
        time.sleep(0.05)
    assert not left, f"forkserver children left: {left}"


def _all_pids() -> list[int]:
    return [int(e) for e in os.listdir("/proc") if e.isdigit()]


UNGUARDED = """
import os, sys, warnings
sys.path.insert(0, {tests!r})
print("BODY", flush=True)
import mxload
from datasets_for_tests import DyingDataset
warnings.simplefilter("ignore", RuntimeWarning)
transform = lambda x: x * 10
class Mapped(DyingDataset):
    def __getitem__(self, i):
        return transform(super().__getitem__(i))
loader = mxload.DataLoader(Mapped(at=10, how="kill", n=40, only_once_file={marker!r}),
                           batch_size=2, num_workers=2, max_worker_restarts=3)
got = [b.ravel().tolist() for b in loader]
assert got == [[10 * i, 10 * i + 10] for i in range(0, 40, 2)], got
print("restarts", loader.stats["worker_restarts"], loader.stats and "ok", flush=True)
"""


def test_replacements_are_forked_like_the_originals_even_from_python_c(tmp_path):
    """Default fork: a replacement neither re-runs an unguarded script body (as
    forkserver/spawn would, under `python -c` too) nor pickles the dataset."""
    code = UNGUARDED.format(tests=TESTS_DIR, marker=str(tmp_path / "died"))
    result = fresh_python.run(code, prelude=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split("\n")[:2] == ["BODY", "restarts 1 ok"], result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr


def test_a_second_loader_while_another_runs_keeps_fork():
    scale = 3
    first = mxload.DataLoader(TupleDataset(40), batch_size=2, num_workers=2, persistent_workers=True)
    it1 = iter(first)
    next(it1)
    second = mxload.DataLoader(mxload.ArrayDataset(np.arange(8)), batch_size=2, num_workers=2,
                               batchify_fn=lambda samples: np.stack(samples) * scale)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)   # mxload's own fork never warns
        it2 = iter(second)
    assert it2.engine.transport.start_method == "fork"
    assert [b.tolist() for b in it2] == [[0, 3], [6, 9], [12, 15], [18, 21]]
    assert len(list(it1)) == 19
    first.close()


@pytest.mark.parametrize("start_method,from_thread", [
    ("fork", False), ("fork", True), ("spawn", True), ("forkserver", False), ("forkserver", True)])
def test_parent_killed_busy_workers_die_within_two_seconds(start_method, from_thread):
    proc = _popen(f"""
        def run():
            global it
            loader = mxload.DataLoader(SlowDataset(3.0, n=10_000, announce=True), batch_size=2,
                                       num_workers=3, start_method={start_method!r}, timeout=None)
            it = iter(loader)   # its pids in one write below: the workers print too
            os.write(1, (" ".join(str(p) for p in it.engine.worker_pids()) + "\\n").encode())
            next(it)
            time.sleep(60)
        if {from_thread!r}:
            t = threading.Thread(target=run)
            t.start()
            t.join()   # the main thread lives on (Python 3.12 refuses to fork once it has ended)
        else:
            run()
    """)
    pids: list[int] = []
    try:
        busy: set[int] = set()
        while not pids or busy != set(pids):   # the pids, and each worker saying it is busy
            line = proc.stdout.readline()
            assert line, proc.stderr.read()
            if line.startswith("busy "):
                busy.add(int(line.split()[1]))
            else:
                pids = [int(p) for p in line.split()]
                assert len(pids) == 3, line
        wait_until(lambda: all("nanosleep" in asleep_in(p) for p in pids),
                   what="the workers asleep in their samples")
        kill_and_expect_workers_gone(proc, pids, within=2.0)
    finally:
        end_child(proc, pids)


def test_a_worker_whose_zygote_died_before_it_armed_the_death_signal_ends_itself():
    """The zygote can die between forking a worker and the worker arming its
    parent-death signal: armed too late, the signal never comes, so the worker
    checks its parent right after arming it."""
    proc = _popen("""
        from mxload._runtime.local.zygote import die_with_parent
        zygote = os.fork()
        if zygote == 0:
            zygote_pid = os.getpid()
            worker = os.fork()
            if worker == 0:
                time.sleep(1.0)   # the zygote dies meanwhile
                die_with_parent(zygote_pid)
                time.sleep(60)    # an orphan that no signal would ever end
                os._exit(0)
            print(worker, flush=True)
            os._exit(0)
        os.waitpid(zygote, 0)
        time.sleep(60)
    """)
    worker = None
    try:
        worker = int(proc.stdout.readline())
        assert process_alive(worker)
        assert_gone([worker], within=5.0)
    finally:
        end_child(proc, [worker] if worker is not None else [])   # the orphan this test exists to prevent


SLOW_MAIN_MODULE = """
import os, sys, time
sys.path.insert(0, {tests!r})
if __name__ != "__main__":
    time.sleep(60)   # a spawn worker re-imports the main module: a slow one (torch, models...)
import mxload
from datasets_for_tests import SlowDataset
if __name__ == "__main__":
    loader = mxload.DataLoader(SlowDataset(0.01), batch_size=2, num_workers=2, start_method="spawn")
    it = iter(loader)
    print(" ".join(str(p) for p in it.engine.worker_pids()), flush=True)
    time.sleep(60)
"""


def test_parent_killed_while_spawn_workers_still_import_ends_them(tmp_path):
    """The watchdog is armed before a spawn worker imports anything: killed
    while its workers still import the main module (here for 60 s), the main
    process takes them with it at once, not once they have finished."""
    script = tmp_path / "train.py"
    script.write_text(SLOW_MAIN_MODULE.format(tests=TESTS_DIR))
    proc = fresh_python.start_args(str(script))
    pids: list[int] = []
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2, proc.stderr.read()
        wait_until(lambda: all("nanosleep" in asleep_in(p) for p in pids),
                   what="the workers importing the main module (its time.sleep(60))")
        kill_and_expect_workers_gone(proc, pids, within=3.0)
    finally:
        end_child(proc, pids)


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_parent_killed_workers_holding_the_gil_die_with_it(start_method):
    """The watchdog of a spawn or forkserver worker is a native thread: it needs
    no GIL, so a worker whose dataset holds it (a long C call) still dies at
    once with its main process."""
    proc = _popen(f"""
        from datasets_for_tests import GilHoldingDataset
        if __name__ == "__main__":
            loader = mxload.DataLoader(GilHoldingDataset(), batch_size=1, num_workers=2,
                                       start_method={start_method!r}, timeout=None)
            it = iter(loader)
            print(" ".join(str(p) for p in it.engine.worker_pids()), flush=True)
            next(it)
    """)
    pids: list[int] = []
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2, proc.stderr.read()
        # Both workers print "holding" (inherited stdout) once inside the call.
        assert [proc.stdout.readline().strip() for _ in pids] == ["holding", "holding"]
        time.sleep(0.2)
        kill_and_expect_workers_gone(proc, pids, within=3.0)
    finally:
        end_child(proc, pids)


def test_workers_started_from_a_thread_outlive_it():
    """A persistent loader whose first epoch ran in a ThreadPoolExecutor thread
    (which exits): the next epoch still has its workers."""
    from concurrent.futures import ThreadPoolExecutor
    loader = mxload.DataLoader(TupleDataset(16), batch_size=4, num_workers=2, start_method="spawn",
                               persistent_workers=True)
    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(lambda: len(list(loader))).result(timeout=60) == 4
    time.sleep(0.3)
    assert len(list(loader)) == 4
    loader.close()


@pytest.mark.parametrize("restarts", [0, 5])
def test_zygote_killed_is_a_prompt_error_naming_it_and_the_next_epoch_works(restarts):
    """SIGKILL of the zygote (its workers die with it, their exit status lost
    with it): an error naming the worker, the zygote and the signal at once,
    not "(still running)" after the whole shutdown deadline spent waiting for
    an exit status that never comes; restarts left do
    not matter (nothing can fork them); iterating again starts new workers."""
    loader = mxload.DataLoader(SlowDataset(0.002, n=400), batch_size=4, num_workers=3,
                               max_worker_restarts=restarts, persistent_workers=True)
    for _ in range(3):
        it = iter(loader)
        next(it)
        zygote = it.engine.transport.zygote_pid
        workers = it.engine.worker_pids()
        os.kill(zygote, signal.SIGKILL)
        with pytest.raises(mxload.WorkerError) as info:
            for _ in it:
                pass
        message = str(info.value)
        assert f"zygote (pid {zygote})" in message and "killed by SIGKILL" in message, message
        assert "still running" not in message and "iterate the loader again" in message, message
        assert info.value.pid in workers
        assert_gone(workers + [zygote])
    assert len(list(loader)) == 100
    loader.close()


def test_shutdown_keeps_its_deadline_when_the_zygote_does_not_answer():
    """A stopped (or starved) zygote reports no exit status and answers no
    start request: shutdown neither waits 0.2 s per look at a worker's exit
    status nor for a restart's ZYGOTE_REPLY_S, and still ends everything."""
    loader = mxload.DataLoader(SlowDataset(0.01, n=10_000), batch_size=2, num_workers=4,
                               max_worker_restarts=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        it = iter(loader)
        next(it)
        zygote = it.engine.transport.zygote_pid
        pids = it.engine.worker_pids()
        os.kill(zygote, signal.SIGSTOP)
        try:
            os.kill(pids[0], signal.SIGKILL)   # its restart waits for the zygote
            time.sleep(0.5)
            start = time.monotonic()
            it.close()
            elapsed = time.monotonic() - start
        finally:
            with contextlib.suppress(ProcessLookupError):   # shutdown ended it
                os.kill(zygote, signal.SIGCONT)
    assert elapsed < 1.0 + 0.5, f"shutdown took {elapsed:.2f} s"
    assert_gone(pids + [zygote])
