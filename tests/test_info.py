"""show_config() and ``python -m mxload info``: the build and platform facts."""
from __future__ import annotations

import os
import sys

import fresh_python
import numpy as np
import pytest

import mxload
from mxload import _core
from mxload._info import config

EXPECTED_KEYS = [
    "mxload", "core", "compile_flags", "numpy (built against)", "wait clock (timeouts, Ctrl-C)",
    "numpy (running)", "python",
    "platform", "default start method", "memfd_create (anonymous shared memory)",
    "PR_SET_PDEATHSIG (workers die with parent)", "cpu cores",
]


def test_config_reports_version_build_numpy_and_platform():
    info = config()
    assert list(info) == EXPECTED_KEYS
    assert info["mxload"] == mxload.__version__
    assert info["core"] == _core.__file__ and os.path.exists(info["core"])
    assert info["compile_flags"] == _core.BUILD_INFO["compile_flags"] != "unknown"
    # Built against numpy 2 (pyproject's build requirement), whatever numpy runs.
    built = info["numpy (built against)"]
    assert built == _core.BUILD_INFO["numpy_build_version"]
    assert int(built.split(".")[0]) >= 2
    assert info["numpy (running)"] == np.__version__
    assert info["wait clock (timeouts, Ctrl-C)"] == _core.BUILD_INFO["wait_clock"]
    assert info["default start method"] in ("fork", "spawn", "forkserver")
    assert info["memfd_create (anonymous shared memory)"] is hasattr(os, "memfd_create")
    assert info["PR_SET_PDEATHSIG (workers die with parent)"] is sys.platform.startswith("linux")
    if sys.platform.startswith("linux"):
        assert info["default start method"] == "fork"


def test_show_config_prints_every_fact(capsys):
    assert mxload.show_config() is None
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("  ")[0].rstrip() for line in lines] == EXPECTED_KEYS
    text = "\n".join(lines)
    assert mxload.__version__ in text and np.__version__ in text
    assert _core.BUILD_INFO["compile_flags"] in text


@pytest.mark.e2e
def test_cli_info_prints_the_config():
    out = fresh_python.run_args("-m", "mxload", "info")
    assert out.returncode == 0, out.stderr
    for key in EXPECTED_KEYS:
        assert key in out.stdout
    assert mxload.__version__ in out.stdout and _core.BUILD_INFO["compile_flags"] in out.stdout
    assert str(config()["memfd_create (anonymous shared memory)"]) in out.stdout


@pytest.mark.e2e
def test_cli_help_and_unknown_command():
    out = fresh_python.run_args("-m", "mxload", "--help")
    assert out.returncode == 0 and "info" in out.stdout
    out = fresh_python.run_args("-m", "mxload")
    assert out.returncode == 2 and "usage" in out.stderr  # no command: a usage error
    out = fresh_python.run_args("-m", "mxload", "nope")
    assert out.returncode == 2 and "invalid choice: 'nope'" in out.stderr
