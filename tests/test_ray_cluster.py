"""backend="ray" on a simulated 2-node cluster (ray.cluster_utils.Cluster):
the workers are forced onto the second node by a custom resource, and that
node is killed mid-epoch."""
from __future__ import annotations

import time

import numpy as np
import pytest
import ray_harness
from datasets_for_tests import AugmentedDataset, SlowDataset

import mxload
from mxload.errors import WorkerError

pytestmark = [pytest.mark.ray, ray_harness.needs_ray, pytest.mark.timeout(180)]

REMOTE = mxload.RayBackend(num_cpus_per_worker=0.5, resources={ray_harness.REMOTE_RESOURCE: 1})


@pytest.fixture(scope="module")
def cluster():
    yield ray_harness.two_nodes()
    ray_harness.stop()


def _assert_same(a, b, skip=()) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for key in x.keys() - set(skip):
            assert np.array_equal(x[key], y[key]), key


def test_workers_run_on_the_other_node_and_match_local_workers(cluster):
    kwargs = dict(batch_size=4, shuffle=True, seed=3, num_workers=2)
    local = list(mxload.DataLoader(AugmentedDataset(24), **kwargs))
    loader = mxload.DataLoader(AugmentedDataset(24), backend=REMOTE, profile=True, **kwargs)
    it = iter(loader)
    remote = [next(it)]
    nodes = {a["Address"]["NodeID"] for a in ray_harness.live_loader_actors()}
    assert nodes == {ray_harness.remote_node().node_id} != {cluster["node_id"]}
    remote += list(it)
    _assert_same(local, remote)
    # Another node's pid means nothing here: the profiler reads no CPU time for it.
    assert [w[4] for w in loader.profiler.workers.values()] == [None, None]
    assert loader.profiler.worker_stage_ns["transport"] > 0


def _remove_remote_node_when_running(cluster, loader):
    """Kill the second node once both its actors delivered a batch."""
    it = iter(loader)
    first = [next(it), next(it)]
    cluster["cluster"].remove_node(ray_harness.remote_node(), allow_graceful=False)
    return it, first, time.monotonic()


def test_node_death_is_a_worker_error_naming_the_node(cluster):
    loader = mxload.DataLoader(SlowDataset(0.1, n=200), batch_size=2, num_workers=2, backend=REMOTE)
    node_id = ray_harness.remote_node().node_id
    try:
        it, first, killed = _remove_remote_node_when_running(cluster, loader)
        with pytest.raises(WorkerError) as info:
            for _ in it:
                pass
        noticed = time.monotonic() - killed
    finally:
        ray_harness.replace_remote_node()
    message = str(info.value)
    assert node_id[:12] in message and "Ray actor" in message and "holding batches [" in message, message
    assert noticed < 10.0, noticed   # Ray's failure detection; measured in bench/ray.py
    del first


def test_node_death_with_restarts_delivers_every_batch_once(cluster):
    """Replacements wait for a node that offers the resource, then load what
    the dead node's actors held: every batch once, as local workers give them."""
    kwargs = dict(batch_size=2, shuffle=True, seed=9, num_workers=2)
    local = list(mxload.DataLoader(AugmentedDataset(40), **kwargs))
    loader = mxload.DataLoader(AugmentedDataset(40), backend=REMOTE, max_worker_restarts=2, prefetch=4,
                               **kwargs)
    with pytest.warns(RuntimeWarning, match="restarting it"):
        it, first, _ = _remove_remote_node_when_running(cluster, loader)
        ray_harness.replace_remote_node()
        remote = first + list(it)
    # A replacement's global RNG starts afresh (as a restarted local worker's); sample_rng() does not.
    _assert_same(local, remote, skip=("global",))
