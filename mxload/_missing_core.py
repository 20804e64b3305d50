"""The error for an mxload imported without its compiled core.

The usual cause: Python puts the current directory first on ``sys.path``, so
``python -m mxload`` (or ``import mxload``) run from the repository root imports
the source checkout's ``mxload/`` folder, which has no compiled ``_core`` unless it
was built in place, instead of the installed package.  Without this message the
user sees "cannot import name '_core' from partially initialized module 'mxload'
(most likely due to a circular import)", which points the wrong way.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path


def explain_missing_core(error: ImportError) -> str:
    package_dir = Path(__file__).resolve().parent
    built = sorted(p.name for p in package_dir.glob("_core.*") if p.suffix in (".so", ".pyd"))
    python = f"CPython {sys.version_info.major}.{sys.version_info.minor}"
    if built:
        return (f"mxload's compiled core failed to load from {package_dir} ({error}); the files "
                f"there ({', '.join(built)}) are not a core built for this interpreter ({python}) "
                f"and numpy. Reinstall mxload with this Python: `python -m pip install "
                f"--force-reinstall mxload` (or, in a checkout, `pip install -e .`).")
    in_checkout = (package_dir.parent / "csrc").is_dir()
    if in_checkout:
        here = " (the current directory)" if package_dir.parent == Path(os.getcwd()).resolve() else ""
        return (f"mxload's compiled core (mxload._core) is not built: Python imported the source "
                f"checkout at {package_dir}, because {package_dir.parent}{here} comes first on "
                f"sys.path. Build it in place with `pip install -e .`, or use the installed "
                f"package: run the `mxload` command (e.g. `mxload bench`) or run Python from "
                f"another directory.")
    return (f"mxload's compiled core (mxload._core) is missing from {package_dir}: the "
            f"installation is incomplete. Reinstall it: `python -m pip install --force-reinstall "
            f"mxload` (building from source needs a C compiler).")
