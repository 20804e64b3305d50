"""PyTorch's own ``test/test_dataloader.py`` (its CPU tests), run with its
DataLoader replaced by ``mxload.torch.DataLoader``.

The file is PyTorch's: it is not in the torch wheel, and mxload neither
copies nor ships it.  Point ``MXLOAD_TORCH_TEST_DATALOADER`` at the file in a
checkout of the installed torch's version to run it::

    MXLOAD_TORCH_TEST_DATALOADER=~/src/pytorch/test/test_dataloader.py \\
        python -m pytest -p no:cacheprovider -m upstream tests/upstream -rA

It needs torch's own test dependencies too (``expecttest``; ``psutil`` for
its test_proper_exit).  Without the variable every test here is skipped,
saying why.

How the swap works: the file runs inside a small module of ours
(``_mxload_upstream_dataloader``, written to a temporary folder on
``sys.path``) that replaces ``torch.utils.data.DataLoader`` with mxload's
while the file's imports run, so its ``from torch.utils.data import
DataLoader`` gets mxload's.  Its datasets and functions then belong to that
module, so a spawn worker or a spawned test process imports the same module
by name, and the swap happens there as well.  Tests that reach into torch's
loader internals (``_MultiProcessingDataLoaderIter``, private attributes
mxload does not give) would be reported as not applicable: list them in
``NOT_APPLICABLE`` with the reason.
"""
from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
import textwrap
import unittest

import pytest

pytestmark = pytest.mark.upstream


@pytest.fixture(autouse=True)
def no_leaks():
    """Overrides tests/conftest.py's leak check here: torch's tests are not
    written to mxload's leak contract (they leave persistent-worker loaders to
    the garbage collector and start processes of their own), so each test's
    verdict is the file's own.  (A fixture in this module, not a conftest.py
    beside it: a second module named conftest would shadow the suite's for
    ``from conftest import ...``.)"""
    yield None

ENV = "MXLOAD_TORCH_TEST_DATALOADER"
MODULE = "_mxload_upstream_dataloader"

# test id (Class.test_name) -> why it cannot apply to a drop-in loader: it asserts on torch's
# private iterator machinery, not on behaviour, or on a difference mxload makes on purpose; such a
# test is skipped, saying why.  None today: the tests that read the iterator's _workers (their pid,
# is_alive(), join(), exitcode), the loader's _auto_collation, or expect torch's "Got pickle
# error" warning get what torch gives (mxload.torch.DataLoader is a torch DataLoader subclass).
NOT_APPLICABLE: dict[str, str] = {}

_WRAPPER = textwrap.dedent('''
    """PyTorch's test/test_dataloader.py, with mxload.torch.DataLoader as its DataLoader."""
    import torch.utils.data
    import mxload.torch

    _torch_loader = torch.utils.data.DataLoader
    torch.utils.data.DataLoader = mxload.torch.DataLoader
    try:
        with open({path!r}) as _f:
            exec(compile(_f.read(), {path!r}, "exec"), globals())
    finally:
        torch.utils.data.DataLoader = _torch_loader
''')


def _load():
    path = os.environ.get(ENV)
    if not path:
        pytest.skip(f"{ENV} is not set: point it at PyTorch's test/test_dataloader.py (not shipped in the "
                    f"torch wheel, not copied into mxload) to run PyTorch's own DataLoader tests against "
                    f"mxload.torch.DataLoader", allow_module_level=True)
    if not os.path.isfile(path):
        pytest.skip(f"{ENV}={path!r} is not a file", allow_module_level=True)
    pytest.importorskip("torch")
    folder = tempfile.mkdtemp(prefix="mxload-upstream-")
    atexit.register(shutil.rmtree, folder, True)   # the run's wrapper module, gone with the run
    with open(os.path.join(folder, MODULE + ".py"), "w") as f:
        f.write(_WRAPPER.format(path=os.path.abspath(path)))
    sys.path.insert(0, folder)
    # The file imports from its own folder (torch's test helpers live in the wheel, but a
    # checkout's test/ may hold more): it is importable from there too.
    sys.path.insert(1, os.path.dirname(os.path.abspath(path)))
    import mxload.torch  # noqa: F401  (mxload's own import errors fail here, not as a skip below)
    try:
        return __import__(MODULE)
    except ImportError as e:
        pytest.skip(f"PyTorch's test file could not be imported ({e}); install torch's test "
                    f"dependencies (expecttest, psutil) if it names one", allow_module_level=True)


_upstream = _load()



def _adopt(upstream) -> None:
    """Its unittest classes become this module's, for pytest to collect; the
    tests in NOT_APPLICABLE are skipped, saying why."""
    for name, obj in vars(upstream).items():
        # (IntegrationTestDataLoaderDataPipe too: its DataPipe sharding and seeding.)
        if (isinstance(obj, type) and issubclass(obj, unittest.TestCase)
                and name.startswith(("Test", "IntegrationTest")) and obj.__module__ == MODULE):
            globals()[name] = obj
    for test, reason in NOT_APPLICABLE.items():
        class_name, method = test.split(".")
        cls = globals().get(class_name)
        if cls is not None and hasattr(cls, method):
            setattr(cls, method, unittest.skip(f"not applicable: {reason}")(getattr(cls, method)))


_adopt(_upstream)


@pytest.fixture(autouse=True)
def mxload_as_torchs_loader():
    """While each test runs, ``torch.utils.data.DataLoader`` is mxload's too: the file calls
    it by that path at run time in places (out-of-order, affinity, large samplers, fd limits,
    early exit), not only through the name its imports bound."""
    import torch.utils.data

    import mxload.torch
    torchs = torch.utils.data.DataLoader
    torch.utils.data.DataLoader = mxload.torch.DataLoader
    try:
        yield
    finally:
        torch.utils.data.DataLoader = torchs
