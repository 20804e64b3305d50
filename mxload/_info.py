"""show_config(): how this mxload was built and what the platform offers."""
from __future__ import annotations

import multiprocessing as mp
import os
import platform
import sys
from typing import Any

import numpy as np

from . import _core
from ._version import __version__


def config() -> dict[str, Any]:
    """The facts show_config() prints, as a dict."""
    return {
        "mxload": __version__,
        "core": _core.__file__,
        "compile_flags": _core.BUILD_INFO["compile_flags"],
        "numpy (built against)": _core.BUILD_INFO["numpy_build_version"],
        "wait clock (timeouts, Ctrl-C)": _core.BUILD_INFO["wait_clock"],
        "numpy (running)": np.__version__,
        "python": platform.python_version(),
        "platform": f"{sys.platform} {platform.machine()}",
        "default start method": "fork" if sys.platform.startswith("linux") else mp.get_start_method(),
        "memfd_create (anonymous shared memory)": hasattr(os, "memfd_create"),
        "PR_SET_PDEATHSIG (workers die with parent)": sys.platform.startswith("linux"),
        "cpu cores": os.cpu_count(),
    }


def show_config() -> None:
    """Print the version, the compiled core's build flags, numpy version,
    the clock waits are timed on, start method, and whether memfd_create and
    PR_SET_PDEATHSIG are available (what ``python -m mxload info`` prints;
    attach it to bug reports).

    Example:
        >>> import mxload
        >>> mxload.show_config()   # doctest: +ELLIPSIS
        mxload ...
        core ...
        ...
    """
    info = config()
    width = max(map(len, info))
    for key, value in info.items():
        print(f"{key:<{width}}  {value}")
