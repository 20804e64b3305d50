"""The command line (``python -m mxload`` and the ``mxload`` script), run as a
user runs it: in a subprocess, output captured (not a terminal) unless a test
gives it a pseudo-terminal.  Mistakes in the command line are one line on
stderr with exit status 2; failures in the user's code show their traceback,
then one line, with exit status 1; nothing ever hangs (every run has a timeout)."""
from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys
import textwrap

import fresh_python
import pytest
from extras import TORCH_INSTALLED

import mxload

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

QUICK = ["--batches", "3", "--workloads", "tabular", "dict16"]


def cli(*args, timeout=60, cwd=None, script=None):
    if script is None:
        return fresh_python.run_args("-m", "mxload", *args, timeout=timeout, cwd=cwd)
    return subprocess.run([script, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd)


def one_line_error(out, *needles):
    assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
    assert out.stdout == ""
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert "Traceback" not in out.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


# ------------------------------------------------------------------ program


def test_version():
    out = cli("--version")
    assert out.returncode == 0 and out.stdout == f"mxload {mxload.__version__}\n" and out.stderr == ""


def test_help_command_is_the_help_option():
    top = cli("--help")
    assert top.returncode == 0 and "bench" in top.stdout and "profile" in top.stdout
    assert cli("help").stdout == top.stdout
    for command in ("bench", "profile", "info"):
        assert cli("help", command).stdout == cli(command, "--help").stdout
    one_line_error(cli("help", "frobnicate"), "unknown command 'frobnicate'")


def test_no_command_prints_the_usage_and_fails():
    out = cli()
    assert out.returncode == 2 and out.stdout == "" and "usage: mxload" in out.stderr


def test_unknown_command_and_option_are_one_line():
    one_line_error(cli("frobnicate"), "invalid choice: 'frobnicate'")
    one_line_error(cli("--frob"), "unrecognized arguments: --frob")
    one_line_error(cli("info", "--frob"), "mxload info: error: unrecognized arguments: --frob")


def _console_script():
    here = os.path.join(os.path.dirname(sys.executable), "mxload")
    return here if os.access(here, os.X_OK) else None


@pytest.mark.skipif(_console_script() is None, reason="the mxload script is not installed beside python")
def test_console_script_is_the_same_program():
    script = _console_script()
    for args in (["--version"], ["help"], ["help", "profile"], ["bench", "--batches", "0"],
                 ["profile", "nocolon"], []):
        a, b = cli(*args), cli(*args, script=script)
        assert (a.returncode, a.stdout, a.stderr) == (b.returncode, b.stdout, b.stderr), args


def test_importing_mxload_and_its_command_line_never_imports_torch():
    out = fresh_python.run_args("-c", "import sys, mxload, mxload.__main__, mxload._bench, mxload.synthetic\n"
                                      "print('torch' in sys.modules)")
    assert out.returncode == 0 and out.stdout == "False\n", out.stderr


# ------------------------------------------------------------------ bench


@pytest.mark.parametrize("args,needle", [
    (["--batches", "0"], "--batches: must be a positive integer, got '0'"),
    (["--batches", "-5"], "--batches: must be a positive integer, got '-5'"),
    (["--batches", "many"], "--batches: must be a positive integer, got 'many'"),
    (["--workers", "-1"], "--workers: must be an integer >= 0, got '-1'"),
    (["--rounds", "2"], "--rounds: must be an integer >= 3, got '2'"),
    (["--workers"], "--workers: expected at least one argument"),
    (["--workers", "2", "2"], "--workers lists a count twice"),
    (["--workers", "1000"], "more than 256"),
    (["--workloads", "imagez"], "unknown workload 'imagez'; choose from images, tabular"),
    (["--frob"], "mxload bench: error: unrecognized arguments: --frob"),
])
def test_bench_option_errors_are_one_line(args, needle):
    one_line_error(cli("bench", *args, timeout=30), needle, "mxload bench")


def test_bench_redirected_has_no_progress_fits_100_columns_and_shows_baselines():
    out = cli("bench", *QUICK, "--workers", "0", "2", timeout=150)
    assert out.returncode == 0, out.stderr
    assert out.stderr == "" and "\r" not in out.stdout
    lines = out.stdout.splitlines()
    assert max(map(len, lines)) <= 100, max(lines, key=len)
    text = out.stdout
    assert f"{mxload._cpus.usable_cores()} usable CPU cores" in text
    assert "in-process" in text and "torch" in text
    assert "tabular" in text and "1024 per batch" in text and "(256,) float32" in text
    rows = [line.split() for line in lines if re.match(r"(tabular|dict16)\s+\d", line)]
    assert [(r[0], r[1]) for r in rows] == [("tabular", "0"), ("tabular", "2"), ("dict16", "0"),
                                            ("dict16", "2")]
    torch_there = TORCH_INSTALLED   # (not imported here: NOTE [ torch last ] in conftest.py)
    for row in rows:
        # mxload b/s ±spread, MB/s, first ms, in-process b/s ±spread: medians of the rounds
        float(row[2]), float(row[6])
        assert re.fullmatch(r"±\d+%", row[3]) and re.fullmatch(r"±\d+%", row[7]), row
        if torch_there:
            float(row[-3]), float(row[-1].rstrip("x"))
            assert re.fullmatch(r"±\d+%", row[-2]), row
    assert "5 alternated rounds of 1 batches each" in " ".join(text.split())
    assert "profiler verdicts" in text
    verdicts = " ".join(text.split("profiler verdicts")[1].split())
    for name in ("tabular", "dict16"):
        assert f"{name}, 0 workers: " in verdicts
        two = verdicts.split(f"{name}, 2 workers: ")[1]
        # Advice for or against workers only from rounds that do not overlap.
        assert (two.startswith("2 workers and in-process loading are within noise")
                or two.startswith("2 workers were slower than in-process loading in all 5")
                or two.startswith(("loader-bound", "CPU-bound", "consumer-bound",
                                   "too few batches to judge"))), two


def test_bench_without_torch_says_so():
    out = cli("bench", "--batches", "2", "--workloads", "dict16", "--no-torch", timeout=60)
    assert out.returncode == 0, out.stderr
    assert "torch baseline is skipped (--no-torch)" in out.stdout
    row = next(line for line in out.stdout.splitlines() if line.startswith("dict16 "))
    assert row.split()[-2:] == ["-", "-"]


def _run_on_a_terminal(args, timeout=90, columns=None):
    """Run the CLI with stderr on a pseudo-terminal (`columns` wide); (exit status, what the
    terminal got)."""
    master, slave = pty.openpty()
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    try:
        if columns is not None:
            import fcntl
            import struct
            import termios
            fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
        proc = fresh_python.start_args("-m", "mxload", *args, stdout=subprocess.DEVNULL, stderr=slave,
                                       env=env)
    finally:
        os.close(slave)
    chunks = []
    try:
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:   # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        rc = proc.wait(timeout=timeout)
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return rc, b"".join(chunks).decode(errors="replace")


def test_bench_progress_only_on_a_terminal_and_not_with_no_progress():
    rc, shown = _run_on_a_terminal(["bench", "--batches", "3", "--workloads", "dict16", "--no-torch"])
    assert rc == 0 and "\r" in shown and "batches" in shown
    rc, shown = _run_on_a_terminal(["bench", "--batches", "3", "--workloads", "dict16", "--no-torch",
                                    "--no-progress"])
    assert rc == 0 and shown == ""


@pytest.mark.parametrize("columns", [80, 40])
def test_bench_progress_fits_the_terminal_so_it_never_wraps(columns):
    """A progress line padded to 99 columns wrapped at every update on an 80-column terminal
    (~600 lines a bench): each update fits the width less one column."""
    rc, shown = _run_on_a_terminal(["bench", "--batches", "3", "--workloads", "dict16", "--no-torch",
                                    "--workers", "1"], columns=columns)
    assert rc == 0
    updates = shown.split("\r")
    assert len(updates) > 5 and any(u.startswith("dict16, 1 worker, round") for u in updates), shown
    assert max(len(u) for u in updates) <= columns - 1, max(updates, key=len)
    if columns == 40:   # cut, not wrapped
        assert any(u.startswith("dict16, 1 worker, round 1/5") and len(u) == 39 for u in updates), updates


# ------------------------------------------------------------------ profile


USER_MODULE = '''
import numpy as np
import mxload

class Good(mxload.Dataset):
    def __len__(self):
        return 64
    def __getitem__(self, i):
        return np.full(4, i, np.float32)

class Broken(Good):
    def __getitem__(self, i):
        if i == 9:
            raise KeyError("sample 9 is missing from the index")
        return super().__getitem__(i)

def make_good():
    return Good()

def make_raising():
    config = {}
    return Good(config["path"])

def make_number():
    return 42

def make_broken():
    return Broken()

NOT_A_FUNCTION = 3
'''


@pytest.fixture
def user_module(tmp_path):
    (tmp_path / "userdata.py").write_text(textwrap.dedent(USER_MODULE))
    (tmp_path / "badimport.py").write_text("import numpy\nraise RuntimeError('no config file')\n")
    return tmp_path


def test_profile_of_a_factory_by_module_name_and_by_path(user_module):
    out = cli("profile", "userdata:make_good", "--batches", "3", "--batch-size", "4", "--workers", "1",
              cwd=user_module)
    assert out.returncode == 0, out.stderr
    assert "mxload profile: 3 batches" in out.stdout and "verdict:" in out.stdout
    assert out.stderr == ""
    out = cli("profile", f"{user_module / 'userdata.py'}:make_good", "--batches", "2", "--json",
              "--workers", "0")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["batches"] == 2


@pytest.mark.parametrize("spec,needle", [
    ("userdata", "expected MODULE:FACTORY"),
    ("userdata:", "expected MODULE:FACTORY"),
    ("nosuchmodule:make", "no module named 'nosuchmodule'"),
    ("nosuchdir/nosuch.py:make", "no such file: nosuchdir/nosuch.py"),
    ("userdata:make_goood", "has no attribute 'make_goood'; did you mean 'make_good'?"),
    ("userdata:NOT_A_FUNCTION", "is a int, not a function"),
    ("userdata:make_number", "make_number() returned a int, not a dataset"),
])
def test_profile_bad_factory_is_one_line(user_module, spec, needle):
    one_line_error(cli("profile", spec, "--batches", "2", cwd=user_module), needle)


@pytest.mark.parametrize("args,needle", [
    (["--batch-size", "0"], "--batch-size: must be a positive integer, got '0'"),
    (["--workers", "two"], "--workers: must be an integer >= 0, got 'two'"),
    (["--batches", "0"], "--batches: must be a positive integer, got '0'"),
    (["--trace", "no/such/folder/t.json"], "folder"),
])
def test_profile_option_errors_are_one_line(user_module, args, needle):
    one_line_error(cli("profile", "userdata:make_good", *args, cwd=user_module), needle)


def _user_error(out, *needles):
    """The user's traceback, then exactly one line of ours, exit status 1."""
    assert out.returncode == 1, (out.returncode, out.stdout, out.stderr)
    lines = out.stderr.rstrip("\n").splitlines()
    # A worker's exception prints its cause first: the worker's own traceback.
    assert lines[0] == "Traceback (most recent call last):" \
        or lines[0].startswith("mxload.errors.WorkerTraceback: Raised in worker"), out.stderr
    assert lines[-1].startswith("mxload: error: ") and lines[-1].endswith("(traceback above)")
    assert "__main__.py" not in out.stderr and "importlib" not in out.stderr, out.stderr
    for needle in needles:
        assert needle in out.stderr, (needle, out.stderr)
    return lines


def test_a_factory_that_raises_shows_the_users_traceback_then_one_line(user_module):
    lines = _user_error(cli("profile", "userdata:make_raising", cwd=user_module),
                        "userdata.py", 'return Good(config["path"])', "KeyError: 'path'")
    assert lines[-1] == "mxload: error: userdata:make_raising() raised KeyError (traceback above)"


def test_a_module_that_fails_to_import_shows_its_traceback(user_module):
    lines = _user_error(cli("profile", "badimport:make", cwd=user_module),
                        "badimport.py", "RuntimeError: no config file")
    assert lines[-1] == "mxload: error: importing 'badimport' failed with RuntimeError (traceback above)"


def test_a_dataset_failing_while_profiled_shows_the_traceback(user_module):
    lines = _user_error(cli("profile", "userdata:make_broken", "--batch-size", "4", "--workers", "1",
                            cwd=user_module), "sample 9 is missing from the index")
    assert "loading batches from userdata:make_broken() failed with" in lines[-1]


# ------------------------------------------------------------------ bench: rounds and their verdict


def test_bench_rounds_alternate_so_drift_falls_on_every_loader_alike():
    from mxload._bench import alternate
    order = []
    alternate(4, {who: (lambda r, who=who: order.append((r, who))) for who in "ABC"})
    assert [who for _, who in order] == list("ABCCBAABCCBA")
    assert [r for r, _ in order] == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3


def _run(rates, verdict="loader-bound: the training loop waited for data 90% of the time; add workers"):
    from mxload._bench import Run
    return Run(0.1, list(rates), 1e6, [verdict] * len(rates))


@pytest.mark.parametrize("workers, mx, in_process, starts, absent", [
    # augment's flip-flop (0.75 / 1.66 / 0.95x over single runs): rounds that overlap advise nothing
    (2, [9.5, 10.4, 11.0, 8.9, 10.1], [10.6, 9.8, 10.9, 11.2, 10.2],
     "2 workers and in-process loading are within noise of each other (0.95x; 5 alternated rounds "
     "overlap: 8.9-11.0 b/s against 9.8-11.2)", ("num_workers=0", "add workers")),
    (1, [5.0, 5.2, 4.9], [9.0, 9.5, 9.2], "1 worker was slower than in-process loading", ()),
    (2, [5.0, 5.2, 4.9], [9.0, 9.5, 9.2],
     "2 workers were slower than in-process loading in all 3 alternated rounds (0.54x; 4.9-5.2 b/s "
     "against 9.0-9.5): use num_workers=0 for this workload on this machine; profile: loader-bound",
     ("within noise",)),
    (2, [20.0, 21.0, 19.0], [9.0, 9.5, 9.2], "loader-bound: the training loop waited", ("within noise",)),
])
def test_bench_advises_on_workers_only_when_the_rounds_do_not_overlap(workers, mx, in_process, starts,
                                                                      absent):
    from mxload._bench import judge
    verdict = judge(workers, _run(mx), _run(in_process, "consumer-bound"))
    assert verdict.startswith(starts), verdict
    assert not any(word in verdict for word in absent), verdict


def test_bench_row_shows_each_loaders_median_and_spread():
    from mxload._bench import _rate
    run = _run([8.0, 10.0, 12.0, 9.0, 11.0])
    run.verdicts = [f"round {r}" for r in range(5)]
    assert run.batches_per_s == 10.0 and run.spread == pytest.approx(0.2)
    assert _rate(run, 14) == "10.0 ±20%".rjust(14) and _rate(None, 14) == "-".rjust(14)
    assert run.verdict == "round 1"   # the median round's (10.0 b/s)
