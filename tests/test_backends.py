"""The DataLoader's `backend` argument, without Ray: checks, and importing
mxload never imports ray (only iterating a backend="ray" loader does)."""
from __future__ import annotations

import textwrap

import fresh_python
import numpy as np
import pytest

import mxload

pytestmark = pytest.mark.timeout(60)


def test_ray_backend_checks_its_arguments():
    assert mxload.RayBackend() == mxload.RayBackend(address=None, num_cpus_per_worker=1)
    with pytest.raises(ValueError, match="num_cpus_per_worker"):
        mxload.RayBackend(num_cpus_per_worker=-1)
    with pytest.raises(ValueError, match="resources"):
        mxload.RayBackend(resources={"gpu_box": "one"})
    with pytest.raises(ValueError, match="runtime_env"):
        mxload.RayBackend(runtime_env="env")


@pytest.mark.parametrize("kwargs, match", [
    (dict(backend="rya", num_workers=2), "backend must be"),
    (dict(backend="ray"), "backend option needs num_workers > 0"),
    (dict(backend="ray", num_workers=2, thread_pool=True), "thread_pool"),
    (dict(backend=mxload.RayBackend(), num_workers=2, start_method="spawn"), "start_method"),
])
def test_loader_rejects_backend_conflicts(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mxload.DataLoader(mxload.ArrayDataset(np.arange(4)), batch_size=2, **kwargs)


def test_importing_mxload_never_imports_ray_and_a_missing_ray_is_a_clear_error():
    script = textwrap.dedent("""
        import sys
        sys.modules["ray"] = None   # as if ray were not installed
        import numpy as np, mxload
        assert "ray" not in [m.split(".")[0] for m in sys.modules if sys.modules[m] is not None]
        loader = mxload.DataLoader(mxload.ArrayDataset(np.arange(4)), batch_size=2, num_workers=2,
                                   backend="ray")
        try:
            next(iter(loader))
        except ImportError as e:
            print(e)
    """)
    out = fresh_python.run_args("-c", script, timeout=50)
    assert out.returncode == 0, out.stderr
    assert "pip install 'mxload[ray]'" in out.stdout


def test_a_transport_of_our_own_plugs_in_through_its_backend_alone():
    """tests/transport_for_tests.py is a whole transport and its backend: the loader uses it
    with no other change, delivers every batch in order, reports its counters in stats, and
    the shutdown ends its workers (the leak check sees no thread left)."""
    from transport_for_tests import CountingBackend

    ds = mxload.ArrayDataset(np.arange(40).reshape(20, 2), np.arange(20))
    loader = mxload.DataLoader(ds, batch_size=3, num_workers=2, backend=CountingBackend())
    expected = [[y.tolist() for _, y in mxload.DataLoader(ds, batch_size=3)]]
    got = [[y.tolist() for _, y in loader]]
    assert got == expected
    assert loader.stats["counted_tasks"] == 7 and loader.stats["batches"] == 7
    for _batch in loader:   # break: the shutdown ends its threads at once
        break


def test_a_builtin_backend_subclass_that_makes_its_own_transport_is_asked_for_it():
    """A subclass of one of mxload's backends that overrides make_transport gets its transport
    from there, as any backend of one's own; Backend itself stays abstract."""
    from transport_for_tests import CountingTransport

    class CountingThreads(mxload.backends.LocalThreads):
        def make_transport(self, setup):
            return CountingTransport(setup)

    loader = mxload.DataLoader(mxload.ArrayDataset(np.arange(12)), batch_size=3, num_workers=2,
                               backend=CountingThreads())
    assert [b.tolist() for b in loader] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    assert loader.stats["counted_tasks"] == 4
    with pytest.raises(TypeError, match="abstract"):
        mxload.backends.Backend()


def test_a_backend_that_is_not_one_is_refused():
    with pytest.raises(ValueError, match="backend must be"):
        mxload.DataLoader(mxload.ArrayDataset(np.arange(4)), batch_size=2, num_workers=2, backend=object())
