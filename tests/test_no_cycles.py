"""A batch makes no reference cycle, in the training process or in a worker: everything a batch
used (its samples, its plan, the closures that planned it, its buffer) is freed the moment the
batch goes, by reference counting, without waiting for the cyclic collector.

A recursive closure in the tree planner once made every batch a cycle: its samples stayed
alive until the collector ran, and its private buffer never went back to the pool, so each
in-process batch of 32 images of 3x128x128 faulted a fresh 6 MiB in (120-450 minor faults a
batch, +50% CPU over torch's collation).  These tests count what the collector finds."""
from __future__ import annotations

import gc

import pytest
from datasets_for_tests import GcProbe

import mxload

pytestmark = pytest.mark.timeout(60)

MODES = [pytest.param({}, id="in-process"),
         pytest.param({"num_workers": 1, "thread_pool": True}, id="thread-worker"),
         pytest.param({"num_workers": 1}, id="process-worker"),
         pytest.param({"num_workers": 1, "persistent_workers": True}, id="persistent-worker")]
KINDS = ["tuple", "dict", "ragged"]
BATCH = 8
MEASURED_BATCHES = 6


def _unreachable(batch) -> int:
    column = batch["unreachable"] if isinstance(batch, dict) else batch[-1]
    return int(column[-1])


def assert_no_cycles(loader) -> None:
    """Neither the training process over MEASURED_BATCHES batches taken mid-epoch, nor the process
    that fetched the samples over the whole epoch (the dataset's last sample reports it), left
    an object for the cyclic collector."""
    it = iter(loader)
    try:
        next(it)
        next(it)   # starting the epoch may make cycles of its own, once: not a batch's
        gc.collect()
        gc.disable()
        for _ in range(MEASURED_BATCHES):
            batch = next(it)
            del batch
        in_loop = gc.collect()
    finally:
        gc.enable()
    rest = list(it)
    assert rest, "the epoch ended before its last batch"
    where_fetched = _unreachable(rest[-1])
    assert in_loop == 0, f"{in_loop} objects in reference cycles from {MEASURED_BATCHES} batches in the loop"
    assert where_fetched == 0, f"{where_fetched} objects in reference cycles where the samples were fetched"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", KINDS)
def test_batches_make_no_reference_cycle(kind, mode):
    batchify = mxload.batchify.Dict(seq=mxload.batchify.Pad()) if kind == "ragged" else None
    with mxload.DataLoader(GcProbe(kind), batch_size=BATCH, batchify_fn=batchify, **mode) as loader:
        assert_no_cycles(loader)


@pytest.mark.torch
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["tensor", "tensor-dict"])
def test_tensor_batches_make_no_reference_cycle(kind, mode):
    from mxload.torch import DataLoader
    with DataLoader(GcProbe(kind), batch_size=BATCH, **mode) as loader:
        assert_no_cycles(loader)
