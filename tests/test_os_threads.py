"""mxload/_runtime/os_threads.py: before the zygote forks, the threads mxload started and
Python saw end are gone from the kernel too, so Python 3.12+ (which counts the kernel's
threads) never warns about a fork that only mxload's ended threads preceded."""
from __future__ import annotations

import os
import sys
import threading
import time
import warnings

import fresh_python
import numpy as np
import pytest
from conftest import race_rounds

import mxload
from mxload._runtime import os_threads

pytestmark = pytest.mark.timeout(60)


class _Clock:
    """os_threads' clock in a test: sleep() moves it on by what was asked and nothing else,
    so a bounded wait's deadline counts polls, never how fast a busy machine wakes a sleeper
    (the real 50 ms grace failed 102 of 300 replays beside 3 busy loops)."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch) -> _Clock:
    fake = _Clock()
    monkeypatch.setattr(os_threads, "time", fake)
    return fake


def _started_and_joined(n: int) -> list[int]:
    threads = [threading.Thread(target=time.sleep, args=(0.001,)) for _ in range(n)]
    for t in threads:
        os_threads.start(t)
    for t in threads:
        t.join()
    return [t.native_id for t in threads]


def test_ended_threads_are_gone_from_the_kernel_once_the_wait_returns():
    tids = _started_and_joined(8)
    os_threads.wait_for_ended_threads()
    assert not {str(t) for t in tids} & set(os.listdir("/proc/self/task"))
    assert not set(tids) & set(os_threads._started)   # forgotten once gone


def test_the_wait_polls_a_thread_the_kernel_still_holds_until_it_is_gone(monkeypatch, clock):
    """A joined thread still counted by the kernel (its last instructions, preempted on a busy
    machine): the wait returns only once it is gone, however long the count held steady."""
    (tid,) = _started_and_joined(1)
    polls = {"n": 0}

    def in_kernel(t: int) -> bool:
        if t != tid:
            return False
        polls["n"] += 1
        return polls["n"] < 40   # "still there" for the first 39 looks (about 20 ms of polls)

    monkeypatch.setattr(os_threads, "_in_kernel", in_kernel)
    os_threads.wait_for_ended_threads()
    assert polls["n"] == 40
    assert clock.now < os_threads.OWN_EXIT_WAIT_S   # it stopped when the thread was gone
    assert tid not in os_threads._started


def test_the_wait_is_bounded_when_an_id_is_reused_by_a_thread_that_lives_on(monkeypatch, clock):
    (tid,) = _started_and_joined(1)
    monkeypatch.setattr(os_threads, "_in_kernel", lambda t: t == tid)
    os_threads.wait_for_ended_threads()
    bound = os_threads.OWN_EXIT_WAIT_S + os_threads.FOREIGN_EXIT_WAIT_S
    assert os_threads.OWN_EXIT_WAIT_S <= clock.now <= bound + os_threads.FOREIGN_POLL_S
    assert tid in os_threads._started   # looked for again before the next fork
    monkeypatch.undo()
    os_threads.wait_for_ended_threads()
    assert tid not in os_threads._started


def test_running_threads_are_not_waited_for(clock):
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    os_threads.start(thread)
    try:
        os_threads.wait_for_ended_threads()
        assert clock.now <= os_threads.FOREIGN_EXIT_WAIT_S + os_threads.FOREIGN_POLL_S
        assert thread.native_id in os_threads._started
    finally:
        stop.set()
        thread.join()
    os_threads.wait_for_ended_threads()
    assert thread.native_id not in os_threads._started


def test_a_thread_started_elsewhere_has_its_id_recorded():
    """Each of mxload's thread starts goes through os_threads.start (the fetcher here)."""
    loader = mxload.DataLoader(mxload.ArrayDataset(np.arange(16)), batch_size=4, num_workers=2)
    it = iter(loader)
    next(it)
    fetcher = it.engine.transport._fetcher._thread
    assert fetcher.native_id in os_threads._started
    assert len(list(it)) == 3


def _fork_warning(text: str = "This process (pid=1) is multi-threaded, use of fork() may lead to "
                  "deadlocks in the child.") -> warnings.WarningMessage:
    return warnings.WarningMessage(DeprecationWarning(text), DeprecationWarning, __file__, 1)


@pytest.mark.parametrize("looks", [4, int(os_threads.ENDING_GRACE_S / os_threads.POLL_S) + 1])
def test_a_fork_warning_about_threads_that_finish_ending_is_dropped(monkeypatch, clock, looks):
    """Python counted threads a fork handler had just joined (OpenBLAS stops its pool at a
    fork): the kernel's count falls to one within the grace period (at its last look here),
    so the warning is dropped."""
    counts = iter([3] + [2] * (looks - 2) + [1])
    monkeypatch.setattr(os_threads, "os_thread_count", lambda: next(counts))
    assert os_threads.fork_warning_counted_ending_threads(_fork_warning(), python_threads=1)
    assert clock.now == pytest.approx((looks - 1) * os_threads.POLL_S)


def test_a_fork_warning_is_kept_when_the_count_falls_only_after_the_grace_period(monkeypatch, clock):
    counts = iter([2] * (int(os_threads.ENDING_GRACE_S / os_threads.POLL_S) + 2) + [1])
    monkeypatch.setattr(os_threads, "os_thread_count", lambda: next(counts))
    assert not os_threads.fork_warning_counted_ending_threads(_fork_warning(), python_threads=1)


@pytest.mark.parametrize("case", ["native thread lives on", "python thread at the fork",
                                  "python thread now", "another warning", "no /proc"])
def test_a_fork_warning_about_threads_that_live_on_is_kept(monkeypatch, clock, case):
    stop = threading.Event()
    live = threading.Thread(target=stop.wait)
    warning, python_threads = _fork_warning(), 1
    monkeypatch.setattr(os_threads, "os_thread_count", lambda: 2)
    if case == "python thread at the fork":
        python_threads = 2
    elif case == "python thread now":
        live.start()
    elif case == "another warning":
        warning = _fork_warning("something else is deprecated")
    elif case == "no /proc":
        monkeypatch.setattr(os_threads, "os_thread_count", lambda: None)
    try:
        assert not os_threads.fork_warning_counted_ending_threads(warning, python_threads)
        assert clock.now <= os_threads.ENDING_GRACE_S + os_threads.POLL_S
    finally:
        stop.set()
        if live.is_alive():
            live.join()


class _Rows(mxload.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int):
        return np.full(8, i, np.float32)


@pytest.mark.races
@pytest.mark.skipif(sys.version_info < (3, 12), reason="Python warns about forking with threads from 3.12")
def test_an_epoch_after_an_epoch_forks_without_a_warning_on_a_busy_machine():
    """Each non-persistent epoch joins its fetcher, and the next epoch forks a zygote right
    after: with both cores kept busy (the fetcher's exit is preempted), no fork warns."""
    hogs = [fresh_python.start_args("-c", "while True: pass") for _ in range(os.cpu_count() or 2)]
    try:
        loader = mxload.DataLoader(_Rows(), batch_size=8, num_workers=2)
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)
            for _ in range(race_rounds(50)):
                assert sum(1 for _ in loader) == 8
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def test_before_fork_waits_only_where_the_fork_would_warn(monkeypatch, clock):
    """Python 3.12+ warns about a fork with threads alive, so the zygote's fork first waits for
    the ended ones; before 3.12 nothing warns: ended threads are forgotten without a wait (the
    wait cost 4-6 ms of every non-persistent epoch's start beside a native thread pool)."""
    (tid,) = _started_and_joined(1)
    monkeypatch.setattr(os_threads, "_in_kernel", lambda t: t == tid)   # it never leaves
    monkeypatch.setattr(os_threads, "os_thread_count", lambda: threading.active_count() + 4)  # a pool
    monkeypatch.setattr(os_threads, "FORK_WARNS", False)
    os_threads.before_fork()
    assert clock.now == 0.0 and tid not in os_threads._started
    (tid,) = _started_and_joined(1)
    monkeypatch.setattr(os_threads, "FORK_WARNS", True)
    os_threads.before_fork()
    assert clock.now >= os_threads.OWN_EXIT_WAIT_S   # waited for it, up to the bound
