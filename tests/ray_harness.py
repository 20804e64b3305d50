"""Ray for the tests marked `ray`: one local instance, or one simulated
2-node cluster, at a time for the whole session (a start costs seconds on a
2-core machine), and checks in Ray's own records that a loader left nothing
behind."""
from __future__ import annotations

import importlib.util
import os
import time

import pytest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
# The resource only the second node of the simulated cluster offers.
REMOTE_RESOURCE = "mxload_test_remote"

_current: dict = {"kind": None, "cluster": None}


def _ray_installed() -> bool:
    """Whether Ray can be imported, found without importing it: the test modules do not import
    Ray at collection, so the pytest process does not carry it (its ~30 MB of private memory
    make every fork of that process, every zygote and worker, slower) while the tests that do
    not need it run.  A folder named ray on sys.path (Ray's /tmp/ray session folder) is a
    namespace package, not Ray."""
    spec = importlib.util.find_spec("ray")
    return spec is not None and spec.origin is not None


# The ray test modules' mark: skipped, with a reason, where Ray is not installed.
needs_ray = pytest.mark.skipif(not _ray_installed(), reason="ray is not installed")


def _worker_environment() -> None:
    """Ray's worker processes inherit the driver's environment at start: the
    test modules' datasets must be importable there as they are here."""
    paths = [TESTS_DIR] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))


def stop() -> None:
    """End whichever Ray this module started."""
    import ray
    if ray.is_initialized():
        ray.shutdown()
    cluster, _current["cluster"] = _current["cluster"], None
    if cluster is not None:
        cluster.shutdown()
    _current["kind"] = None


def local() -> dict:
    """A local Ray instance with 2 CPUs (started once, reused)."""
    import ray
    if _current["kind"] != "local":
        stop()
        _worker_environment()
        # address="local": a new instance even when another Ray runs on this machine (another
        # test session's cluster), which ray.init() would otherwise join.
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        _current["kind"] = "local"
    return {"node_id": ray.get_runtime_context().get_node_id()}


def two_nodes() -> dict:
    """A simulated cluster: the head (this driver's node, 1 CPU) and a second
    node with 2 CPUs and REMOTE_RESOURCE, where RayBackend(resources=...)
    places the workers.  Returns the cluster and the nodes."""
    import ray
    from ray.cluster_utils import Cluster
    if _current["kind"] != "cluster":
        stop()
        _worker_environment()
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 1, "include_dashboard": False,
            # Ray notices a dead node through these health checks: at its
            # defaults (3 s x 5) a node death takes 15 s to be declared.
            "_system_config": {"health_check_period_ms": 200, "health_check_failure_threshold": 3,
                               "health_check_initial_delay_ms": 0}})
        _current["cluster"] = cluster
        _current["remote"] = cluster.add_node(num_cpus=2, resources={REMOTE_RESOURCE: 4})
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        _current["kind"] = "cluster"
    return {"cluster": _current["cluster"], "node_id": ray.get_runtime_context().get_node_id()}


def replace_remote_node() -> None:
    """After a test removed the second node: add a fresh one like it (its
    processes are test infrastructure, not the test's leftovers)."""
    cluster = _current["cluster"]
    node = _current["remote"] = cluster.add_node(num_cpus=2, resources={REMOTE_RESOURCE: 4})
    _infrastructure.update(info.process.pid for infos in node.all_processes.values() for info in infos)
    cluster.wait_for_nodes()


_infrastructure: set = set()


def infrastructure_pids() -> set:
    """Processes of cluster nodes the harness added during a test."""
    return _infrastructure


def remote_node():
    """The simulated cluster's current second node (a test may have replaced it)."""
    return _current["remote"]


def live_loader_actors() -> list:
    """This job's LoaderActor actors that Ray does not list as DEAD."""
    import ray
    from ray._private.state import state
    job = ray.get_runtime_context().get_job_id()
    return [a for a in state.actor_table(None).values()
            if a["ActorClassName"].endswith("LoaderActor") and a["JobID"] == job and a["State"] != "DEAD"]


def our_refs() -> dict:
    """The object references this process owns or holds (task results,
    ray.put objects): empty once every loader is done."""
    import ray
    worker = ray._private.worker.global_worker
    # Ray gives each ObjectID as its hex text, in bytes: the keys are ObjectRef.hex()'s.
    return {ref.decode(): count for ref, count in worker.core_worker.get_all_reference_counts().items()}


def assert_nothing_of_ours(within: float = 3.0) -> None:
    """No LoaderActor of this job is alive and this process holds no object
    reference (an actor call still pending would hold its result's), in
    Ray's own records."""
    import ray
    if not ray.is_initialized():
        return
    deadline = time.monotonic() + within
    while True:
        actors, refs = live_loader_actors(), our_refs()
        if not actors and not refs:
            return
        if time.monotonic() > deadline:
            states = [(a["ActorID"], a["State"]) for a in actors]
            raise AssertionError(f"left in Ray after the test: actors {states}, object references {refs}")
        time.sleep(0.02)
