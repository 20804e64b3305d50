"""Batches collated in the training process (num_workers=0, thread workers) reuse the private
buffer of a batch the loop has dropped (mxload._collate.plan.ReusedBuffers), as the workers'
batches reuse their slabs: a fresh buffer per batch faulted its pages in again for every large
batch (numpy maps 4 MiB and more afresh).  A batch the loop keeps is never written over."""
from __future__ import annotations

import gc

import numpy as np
import pytest
from extras import TORCH_INSTALLED, deferred

import mxload
from mxload._collate.plan import ReusedBuffers

mxtorch = deferred("mxload.torch")

pytestmark = pytest.mark.timeout(60)

MODES = [pytest.param({}, id="in-process"),
         pytest.param({"num_workers": 2, "thread_pool": True, "persistent_workers": True}, id="threads")]


def _owner(array):
    """The object that owns a batch array's memory (the end of its chain of bases)."""
    while getattr(array, "base", None) is not None:
        array = array.base
    return array


@pytest.mark.parametrize("kw", MODES)
def test_a_dropped_batchs_buffer_is_reused_across_batches_and_epochs(kw):
    """Each batch's memory is a buffer of the loader's pool, and a batch the loop dropped gives
    its buffer to a later one, in the next epoch too: a fresh buffer per batch had its pages
    faulted in again (bench: 900-2,600 minor faults an epoch of 16 batches of 6 MiB images,
    2-4 ms of CPU a batch, where torch's default_collate reused malloc's memory: 0.2 ms)."""
    rows = np.ones((128, 1 << 14), np.float32)   # batches of 32 rows: 2 MiB
    addresses = []
    with mxload.DataLoader(mxload.ArrayDataset(rows), batch_size=32, **kw) as loader:
        for _ in range(3):
            for batch in loader:
                owner = _owner(batch)
                assert hasattr(owner, "slab"), f"batch memory owned by {type(owner).__name__}, not the pool"
                addresses.append(owner.slab.address)
                del batch, owner
    buffers = len(set(addresses))
    assert buffers <= len(addresses) // 2, f"{buffers} buffers for {len(addresses)} batches"


TORCH_FACE = pytest.param("torch", marks=[pytest.mark.torch, pytest.mark.skipif(
    not TORCH_INSTALLED, reason="the torch face needs the torch extra")])
@pytest.mark.parametrize("kw", MODES)
@pytest.mark.parametrize("face", ["numpy", TORCH_FACE])
def test_kept_batches_are_never_written_over(kw, face):
    loader_class = mxtorch.DataLoader if face == "torch" else mxload.DataLoader
    as_numpy = (lambda t: t.numpy()) if face == "torch" else np.asarray
    x = np.arange(64 * 12, dtype=np.float32).reshape(64, 3, 4)
    with loader_class(mxload.ArrayDataset(x, np.arange(64)), batch_size=8, shuffle=True, **kw) as loader:
        for _ in range(2):
            kept = [(as_numpy(xb).copy(), as_numpy(yb).copy(), xb, yb) for xb, yb in loader]
            gc.collect()
            for copy_x, copy_y, xb, yb in kept:
                assert np.array_equal(as_numpy(xb), copy_x) and np.array_equal(as_numpy(yb), copy_y)
                assert np.array_equal(copy_x, x[copy_y])
            del kept


def test_the_pool_keeps_a_few_buffers_of_the_sizes_asked():
    pool = ReusedBuffers(keep=2)
    owners = [pool.take(100_000) for _ in range(3)]
    addresses = {o.slab.address for o in owners}
    assert len(addresses) == 3 and all(o.nbytes == 100_000 for o in owners)
    del owners
    gc.collect()
    again = [pool.take(90_000), pool.take(100_000), pool.take(100_000)]
    assert len({o.slab.address for o in again[:2]} & addresses) == 2, "the two kept were reused"
    assert again[2].slab.address not in {o.slab.address for o in again[:2]}
    assert pool.take(1_000_000).slab.size >= 1_000_000
