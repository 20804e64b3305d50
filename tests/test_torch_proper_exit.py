"""torch's test_proper_exit family against mxload.torch.DataLoader: a
training process whose loop ends by the loader's error, a worker's error, a
killed worker or its own death (with and without workers, pinned memory,
persistent workers, a reference to the iterator kept) ends, every worker of
it ends, and the error raised is the one torch raises.  Each scenario runs in
a process of its own (written here from the scenario's intent)."""
from __future__ import annotations

import itertools
import os
import signal
import subprocess
import textwrap

import fresh_python
import pytest
from conftest import assert_gone

pytestmark = [pytest.mark.faults, pytest.mark.torch, pytest.mark.timeout(120)]

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

_PROGRAM = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    import torch
    from conftest import descendant_pids
    from mxload.torch import DataLoader

    ITERABLE, WORKERS, PIN, PERSISTENT = {iterable}, {workers}, {pin}, {persistent}
    HOLD, EXIT = {hold}, {exit!r}
    FLAG = {flag!r}   # once it exists, the last worker's samples fail

    def report(kind, error, tb):   # the error that ended the training process, on stdout
        print("RAISED", kind.__name__, isinstance(error, RuntimeError), flush=True)
        print(str(error).splitlines()[0] if str(error) else "", flush=True)
        os._exit(1)

    sys.excepthook = report

    def last_worker_fails():
        info = torch.utils.data.get_worker_info()
        return info is not None and info.id == info.num_workers - 1 and os.path.exists(FLAG)

    class Samples(torch.utils.data.Dataset):
        def __len__(self):
            return 12
        def __getitem__(self, i):
            if last_worker_fails():
                raise RuntimeError("Worker error")
            return torch.tensor([i])

    class Stream(torch.utils.data.IterableDataset):   # not split: every worker yields all 7
        def __len__(self):
            return 7
        def __iter__(self):
            for _ in range(7):
                if last_worker_fails():
                    raise RuntimeError("Worker error")
                yield torch.tensor(-1000)

    loader = DataLoader(Stream() if ITERABLE else Samples(), batch_size=1, num_workers=WORKERS,
                        pin_memory=PIN, persistent_workers=PERSISTENT)
    it = iter(loader)
    workers = it.engine.worker_pids() if WORKERS else []
    for i, _ in enumerate(it):
        if i == 0:
            print("PIDS", *sorted(descendant_pids()), flush=True)
            if not HOLD:
                del it, loader
            if EXIT == "worker_error":
                open(FLAG, "w").close()
        if i == 2:
            if EXIT == "loader_error":
                raise RuntimeError("Loader error")
            if EXIT == "loader_kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if EXIT == "worker_kill":
                os.kill(workers[-1], signal.SIGKILL)
    print("DONE", flush=True)
""")


def _scenarios():
    # Every exit method with and without a stream; the other switches in two opposite settings.
    for exit_method, workers in [(None, 2), ("loader_error", 2), ("worker_error", 2), ("worker_kill", 2),
                                 (None, 0), ("loader_error", 0), ("loader_kill", 0)]:
        switches = [(True, False, False), (False, True, True)]   # (hold, pin, persistent)
        for iterable, (hold, pin, persistent) in itertools.product([False, True], switches):
            yield pytest.param(iterable, workers, pin, persistent and workers > 0, hold, exit_method,
                               id=f"{exit_method}-{'stream' if iterable else 'map'}-w{workers}"
                                  f"-{'hold' if hold else 'drop'}{'-pin' if pin else ''}"
                                  f"{'-persistent' if persistent and workers else ''}")


@pytest.mark.parametrize("iterable,workers,pin,persistent,hold,exit_method", list(_scenarios()))
def test_proper_exit(tmp_path, iterable, workers, pin, persistent, hold, exit_method):
    program = _PROGRAM.format(tests=TESTS_DIR, iterable=iterable, workers=workers, pin=pin,
                              persistent=persistent, hold=hold, exit=exit_method,
                              flag=str(tmp_path / "fail-now"))
    proc = fresh_python.start_args("-c", program)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the training process did not end:\n{out}\n{err}")
    lines = out.splitlines()
    pids = [int(p) for line in lines if line.startswith("PIDS") for p in line.split()[1:]]
    assert_gone(pids, within=5.0)   # every worker (and zygote) of it ended with it
    if workers:
        assert pids, out + err
    if exit_method is None:
        assert proc.returncode == 0 and "DONE" in lines, out + err
    elif exit_method == "loader_kill":
        assert proc.returncode == -signal.SIGKILL, out + err
    else:
        assert proc.returncode != 0 and "DONE" not in lines, out + err
        raised = lines[lines.index(next(line for line in lines if line.startswith("RAISED"))):]
        assert raised[0].split()[2] == "True", out + err   # a RuntimeError, as torch's
        expected = {"loader_error": "Loader error", "worker_error": "Worker error",
                    "worker_kill": "DataLoader worker (pid"}[exit_method]
        assert expected in raised[1], out + err
