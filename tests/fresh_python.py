"""Code run in a fresh interpreter, as a user's own script runs: the one helper behind every
test that needs a process of its own (a whole training program, a parent to kill, a process
group to Ctrl-C, an import to observe from the outside).

    result = run('''print(len(list(mxload.DataLoader(TupleDataset(8), batch_size=2))))''')
    proc = start(body, start_new_session=True); out, err = finish(proc, timeout=20)
    result = run_args("-m", "mxload", "info")      # arguments as they are: a script, -m, ...

The script is PRELUDE, then `imports`, then `body` (each dedented).  PRELUDE restores
Python's Ctrl-C handling (the suite may run with SIGINT ignored, as background jobs and some
CI runners do, and an ignored signal stays ignored in children), puts tests/ on sys.path,
dumps every thread's stack on SIGUSR1 (finish() asks for it before killing a hung child), and
imports numpy and mxload.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

PRELUDE = f"""
import os, sys, time, signal, threading, warnings
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.path.insert(0, {TESTS_DIR!r})
import faulthandler
faulthandler.register(signal.SIGUSR1, all_threads=True)
import numpy as np, mxload
"""


def script(body: str, imports: str = "", prelude: bool = True) -> str:
    return (PRELUDE if prelude else "") + textwrap.dedent(imports) + "\n" + textwrap.dedent(body)


def run(body: str, *args: str, imports: str = "", prelude: bool = True, timeout: float = 60,
        **kw) -> subprocess.CompletedProcess:
    """Run it to the end (text output captured); TimeoutExpired past `timeout`."""
    return run_args("-c", script(body, imports, prelude), *args, timeout=timeout, **kw)


def start(body: str, *args: str, imports: str = "", prelude: bool = True, **kw) -> subprocess.Popen:
    """Start it, stdout and stderr piped as text; end it with finish()."""
    return start_args("-c", script(body, imports, prelude), *args, **kw)


def run_args(*args: str, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    """A fresh interpreter with these arguments as they are (a script file, ``-m mxload ...``,
    ``-c`` code that must run without the prelude), run to the end with its text output
    captured; TimeoutExpired past `timeout`."""
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, **kw)


def start_args(*args: str, **kw) -> subprocess.Popen:
    """A fresh interpreter with these arguments as they are, started, stdout and stderr piped
    as text unless `kw` says otherwise; end it with finish() (or conftest.end_child)."""
    kw.setdefault("stdout", subprocess.PIPE)
    kw.setdefault("stderr", subprocess.PIPE)
    return subprocess.Popen([sys.executable, *args], text=True, **kw)


def finish(proc: subprocess.Popen, timeout: float = 20) -> tuple[str, str]:
    """Its output once it ends.  One that outlives `timeout` prints its threads' stacks
    (SIGUSR1), is killed with its process group when it leads one, and the output says so."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.kill(proc.pid, signal.SIGUSR1)
            time.sleep(0.5)
        except ProcessLookupError:
            pass
        try:
            if os.getpgid(proc.pid) == proc.pid:
                os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.kill()
        out, err = proc.communicate()
        note = f"\n[the child hung for {timeout} s and was killed]"
        return out + note, err + note
