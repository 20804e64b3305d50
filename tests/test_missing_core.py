"""Importing mxload without its compiled core says so, and what to run.

The classic case: `python -m mxload` in the repository root after `pip install .`
imports the checkout's mxload/ folder, which has no compiled core."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import fresh_python
import pytest

import mxload

pytestmark = pytest.mark.timeout(60)

PACKAGE = Path(mxload.__file__).resolve().parent


def _copy_sources(root: Path) -> Path:
    dest = root / "mxload"
    dest.mkdir()
    for path in PACKAGE.iterdir():
        if path.suffix in (".py", ".pyi", ".typed"):
            shutil.copy(path, dest / path.name)
    return dest


# An editable install of the checkout (the README's test command) adds an import hook that
# would supply mxload._core to any mxload package; drop it, as a regular install has none.
_NO_EDITABLE_HOOK = "import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f)]; "


def _run(cwd: Path, code: str) -> subprocess.CompletedProcess[str]:
    return fresh_python.run_args("-c", _NO_EDITABLE_HOOK + code, cwd=cwd, timeout=30)


def test_checkout_without_core_explains_and_names_the_fix(tmp_path: Path) -> None:
    _copy_sources(tmp_path)
    (tmp_path / "csrc").mkdir()  # looks like the repository root
    run_module = "import runpy; sys.argv[1:] = ['bench']; runpy.run_module('mxload', run_name='__main__')"
    for code in ("import mxload", run_module):
        result = _run(tmp_path, code)
        assert result.returncode != 0
        last = result.stderr.strip().splitlines()[-1]
        assert last.startswith("ImportError: mxload's compiled core (mxload._core) is not built"), last
        assert "source checkout" in last and "pip install -e ." in last and "`mxload` command" in last
        assert "(the current directory)" in last
        assert "circular import" not in result.stderr


def test_installed_package_without_core_says_reinstall(tmp_path: Path) -> None:
    _copy_sources(tmp_path)
    result = _run(tmp_path, "import mxload")
    last = result.stderr.strip().splitlines()[-1]
    assert "installation is incomplete" in last and "--force-reinstall" in last, last


def test_core_built_for_another_interpreter_says_reinstall(tmp_path: Path) -> None:
    package = _copy_sources(tmp_path)
    (package / "_core.cpython-311-x86_64-linux-gnu.so").write_bytes(b"not an ELF file")
    (package / "_core.cpython-312-x86_64-linux-gnu.so").write_bytes(b"not an ELF file")
    (package / "_core.cpython-313-x86_64-linux-gnu.so").write_bytes(b"not an ELF file")
    result = _run(tmp_path, "import mxload")
    last = result.stderr.strip().splitlines()[-1]
    assert "compiled core failed to load" in last and "not a core built for this interpreter" in last, last
