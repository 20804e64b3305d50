"""The launcher's ending of its worker processes (mxload/_runtime/local/launcher.py,
Launcher.end_processes and end_all), with fake processes: no worker started, no wait on the
clock (the grace and terminate points have passed when the call starts, and a fake ends the
moment its signal says so).  Grace, then SIGTERM for a worker still inside a batch, then SIGKILL
for whatever is left; a worker between tasks is never sent SIGTERM; every one is reaped and
closed."""
from __future__ import annotations

import os
import time

import pytest

from mxload._runtime.local.launcher import Launcher
from mxload._runtime.shutdown import SHUTDOWN_TERMINATE_S

pytestmark = pytest.mark.timeout(10)


class FakeProcess:
    """A worker process as the launcher sees it: its sentinel (a pipe, readable once it ended),
    its exit code, and what it was sent.  `honours` says which signals end it."""

    def __init__(self, exits_with=None, honours=("kill",)):
        self._r, self._w = os.pipe()
        self.sentinel = self._r
        self.exitcode = None
        self.sent: list[str] = []
        self.honours = honours
        self.closed = False
        if exits_with is not None:
            self._end(exits_with)

    def _end(self, code):
        self.exitcode = code
        os.write(self._w, b"x")

    def terminate(self):
        self.sent.append("terminate")
        if "terminate" in self.honours:
            self._end(-15)

    def kill(self):
        self.sent.append("kill")
        if "kill" in self.honours:
            self._end(-9)

    def join(self, timeout=None):
        pass

    def close(self):
        self.closed = True
        os.close(self._r)
        os.close(self._w)


@pytest.fixture
def launcher():
    return Launcher(None, "fork", "FakeDataset", None)


def _end(launcher, procs, between_tasks=()):
    start = time.monotonic() - SHUTDOWN_TERMINATE_S - 0.1   # grace and terminate points passed
    launcher.end_all(procs, start, time.monotonic() + 5, between_tasks)


def test_a_worker_that_ended_in_the_grace_is_sent_nothing(launcher):
    done = FakeProcess(exits_with=0)
    _end(launcher, [done])
    assert done.sent == [] and done.exitcode == 0 and done.closed


def test_a_worker_inside_a_batch_gets_sigterm_then_sigkill_if_it_ignores_it(launcher):
    stops, ignores = FakeProcess(honours=("terminate", "kill")), FakeProcess(honours=("kill",))
    _end(launcher, [stops, ignores])
    assert stops.sent == ["terminate"] and stops.exitcode == -15
    assert ignores.sent == ["terminate", "kill"] and ignores.exitcode == -9
    assert stops.closed and ignores.closed


def test_a_worker_between_tasks_is_never_sent_sigterm_and_is_killed_if_still_there(launcher):
    """It exits 0 on the stop message, as torch's workers do at an epoch's end; one still there at
    the terminate point is stuck (SIGSTOPped, say): SIGKILL, as the others."""
    idle, busy = FakeProcess(honours=("terminate", "kill")), FakeProcess(honours=("terminate", "kill"))
    _end(launcher, [idle, busy], between_tasks=[idle])
    assert idle.sent == ["kill"] and idle.exitcode == -9
    assert busy.sent == ["terminate"] and busy.exitcode == -15

