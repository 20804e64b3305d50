"""backend="ray": the workers are Ray actors (one local Ray instance with 2
CPUs for the whole module).  Every test also proves, in Ray's own records,
that no actor or object reference of the loader is left (conftest.no_leaks)."""
from __future__ import annotations

import os
import signal
import subprocess
import textwrap
import time

import fresh_python
import numpy as np
import pytest
import ray_harness
from conftest import exception_text
from datasets_for_tests import (
    AugmentedDataset,
    CorruptSample,
    DyingDataset,
    PagesDataset,
    RaisingDataset,
    ShardedStream,
    SlowDataset,
    StartedProbe,
    TupleDataset,
    failing_init,
)

import mxload
from mxload.errors import LoaderTimeoutError, WorkerError

pytestmark = [pytest.mark.ray, ray_harness.needs_ray, pytest.mark.timeout(120)]

# Ray actors reserve no whole CPU here: the suite runs 4 workers on a 2-CPU instance.
SMALL = mxload.RayBackend(num_cpus_per_worker=0.25)


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    yield ray_harness.local()
    ray_harness.stop()


def assert_same_batches(a, b) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if isinstance(x, dict):
            assert x.keys() == y.keys()
            assert_same_batches(list(x.values()), list(y.values()))
        elif isinstance(x, (list, tuple)):
            assert_same_batches(list(x), list(y))
        else:
            assert isinstance(y, np.ndarray) and x.dtype == y.dtype and np.array_equal(x, y), (x, y)


def test_batches_are_bit_identical_to_local_workers_with_the_same_seed():
    """sample_rng(), the workers' global RNGs and get_worker_info() (id,
    num_workers, seed) are those of local workers: same batches, same bits."""
    kwargs = dict(batch_size=4, shuffle=True, seed=11, num_workers=2)
    local = list(mxload.DataLoader(AugmentedDataset(), **kwargs))
    remote = list(mxload.DataLoader(AugmentedDataset(), backend=SMALL, **kwargs))
    assert_same_batches(local, remote)
    assert sorted(int(w) for b in remote for w in b["worker"][:, 0]) == sorted(
        int(w) for b in local for w in b["worker"][:, 0])


def test_iterable_dataset_sharded_by_worker_info_in_completion_order():
    local = list(mxload.DataLoader(ShardedStream(), batch_size=4, num_workers=2))
    remote = list(mxload.DataLoader(ShardedStream(), batch_size=4, num_workers=2, backend=SMALL,
                                    in_order=False))

    def key(batch):
        return int(batch[1][0])
    assert_same_batches(sorted(local, key=key), sorted(remote, key=key))


def test_batches_are_writable_zero_copy_views_of_the_object_store():
    loader = mxload.DataLoader(TupleDataset(8), batch_size=8, num_workers=1, backend=SMALL)   # one batch
    for x, label, _half in loader:
        assert x.flags.writeable and label.flags.writeable
        base = x
        while getattr(base, "base", None) is not None and not type(base).__module__.startswith("ray"):
            base = base.base
        # The views' memory is Ray's (the object store's copy), not a private copy.
        assert type(base).__module__.startswith("ray"), type(base)
        x += 1   # writable as local workers' batches are
        # The loader dropped the batch's object reference when it arrived (the
        # arrays alone keep the object store's copy): only the dataset's is left.
        deadline = time.monotonic() + 2
        while len(ray_harness.our_refs()) > 1 and time.monotonic() < deadline:
            time.sleep(0.01)   # Ray drops a resolved call's reference in its own thread, soon after
        assert len(ray_harness.our_refs()) == 1, ray_harness.our_refs()
        break
    del x, label, _half, base
    loader.close()


def test_large_batches_arrive_intact_while_the_actor_reuses_its_buffer():
    """An actor collates every batch into the same buffer: each batch must be
    in the object store before the next one is collated over it."""
    loader = mxload.DataLoader(PagesDataset(), batch_size=4, num_workers=1, prefetch=4, backend=SMALL)
    for k, batch in enumerate(loader):
        assert batch.shape == (4, 256, 1024)
        assert all((batch[j] == 4 * k + j).all() for j in range(4)), k


def test_prefetch_bounds_how_far_actors_load_ahead(tmp_path):
    loader = mxload.DataLoader(StartedProbe(str(tmp_path), n=64), batch_size=2, num_workers=1, prefetch=3,
                               backend=SMALL)
    it = iter(loader)
    next(it)
    time.sleep(1.0)   # the actors would load much more meanwhile if nothing held them back
    started = len(os.listdir(tmp_path))
    # The batch taken, plus at most 3 in flight: 4 batches of 2 samples.
    assert 2 <= started <= 8, started
    it.close()


def test_dataset_exception_keeps_type_and_traceback_and_the_epoch_goes_on():
    loader = mxload.DataLoader(RaisingDataset(at=5, exc_kind="key"), batch_size=2, num_workers=2,
                               backend=SMALL)
    taken, errors = [], []
    it = iter(loader)
    while True:
        try:
            batch = next(it)
        except StopIteration:
            break
        except KeyError as e:
            errors.append(exception_text(e))
            continue
        taken.extend(int(i) for i in batch[:, 0])
    assert len(errors) == 1 and "missing 5" in errors[0] and "Worker traceback" in errors[0]
    assert "__getitem__" in errors[0]
    assert taken == [i for i in range(20) if i not in (4, 5)]


def test_a_multi_argument_exception_arrives_as_itself_with_its_attributes():
    """As from local workers (issue 39): CorruptSample(path, code), whose args are its message
    alone, is rebuilt without calling its __init__, not a WorkerError."""
    loader = mxload.DataLoader(RaisingDataset(at=5, exc_kind="corrupt"), batch_size=2, num_workers=1,
                               backend=SMALL)
    with pytest.raises(CorruptSample) as info:
        list(loader)
    assert (info.value.path, info.value.code, str(info.value)) == ("/data/5.jpg", 7, "/data/5.jpg: 7")
    assert "batch 2" in exception_text(info.value)


def test_worker_init_fn_failure_is_reported():
    loader = mxload.DataLoader(TupleDataset(), batch_size=2, num_workers=1, backend=SMALL,
                               worker_init_fn=failing_init)
    with pytest.raises(Exception, match="worker_init_fn"):
        list(loader)


def test_timeout_names_the_actors():
    loader = mxload.DataLoader(SlowDataset(5.0, n=8), batch_size=2, num_workers=1, backend=SMALL, timeout=1)
    t0 = time.monotonic()
    with pytest.raises(LoaderTimeoutError, match="Ray actor") as info:
        next(iter(loader))
    assert time.monotonic() - t0 < 8.0   # timeout=1 plus the shutdown; slack for a loaded machine
    assert "timeout=1" in str(info.value)


def test_state_dict_resumes_with_the_same_batches():
    kwargs = dict(batch_size=3, shuffle=True, seed=5, num_workers=1, backend=SMALL)
    loader = mxload.DataLoader(AugmentedDataset(), **kwargs)
    it = iter(loader)
    first = [next(it) for _ in range(4)]
    state = loader.state_dict()
    rest = list(it)
    resumed = mxload.DataLoader(AugmentedDataset(), **kwargs)
    resumed.load_state_dict(state)
    again = list(resumed)
    for batch in rest + again:   # the global RNG restarts with the workers; sample_rng() does not
        del batch["global"]
    assert_same_batches(rest, again)
    del first


def test_persistent_actors_reseed_per_epoch_as_local_workers_do():
    kwargs = dict(batch_size=4, shuffle=True, seed=2, num_workers=2, persistent_workers=True)
    with mxload.DataLoader(AugmentedDataset(20), **kwargs) as local_loader:
        local = [list(local_loader) for _ in range(2)]
    with mxload.DataLoader(AugmentedDataset(20), backend=SMALL, **kwargs) as remote_loader:
        remote = [list(remote_loader) for _ in range(2)]
        assert remote_loader.stats["epochs"] == 2
    for a, b in zip(local, remote):
        assert_same_batches(a, b)


@pytest.mark.torch
def test_persistent_actors_seeded_as_torch_go_on_as_local_workers_do():
    """seeding="torch" (mxload.torch's): actors seed random, numpy and torch from base_seed + id,
    as local workers do, and persistent ones keep their streams across epochs (no reseed)."""
    torch = pytest.importorskip("torch", reason="seeding='torch' needs torch")
    def epochs(**backend):
        torch.manual_seed(4)
        with mxload.DataLoader(AugmentedDataset(20), batch_size=4, num_workers=2, persistent_workers=True,
                               seeding="torch", **backend) as loader:
            return [list(loader) for _ in range(2)]
    local, remote = epochs(), epochs(backend=SMALL)
    for a, b in zip(local, remote):
        assert_same_batches(a, b)
    globals_drawn = [[int(g) for b in epoch for g in b["global"]] for epoch in remote]
    assert globals_drawn[0] != globals_drawn[1]   # the streams went on


def test_a_killed_actor_is_a_worker_error_naming_actor_node_and_batch():
    loader = mxload.DataLoader(SlowDataset(0.2, n=64), batch_size=2, num_workers=2, backend=SMALL)
    it = iter(loader)
    next(it)
    victim = ray_harness.live_loader_actors()[0]
    os.kill(int(victim["Pid"]), signal.SIGKILL)
    killed = time.monotonic()
    with pytest.raises(WorkerError) as info:
        for _ in it:
            pass
    noticed = time.monotonic() - killed
    message = str(info.value)
    assert "Ray actor" in message and victim["ActorID"][:12] in message and "node" in message
    assert str(victim["Pid"]) in message and "holding batches [" in message
    assert noticed < 5.0, noticed   # 20 ms measured (bench/ray.py); slack for a loaded machine


def test_restarted_actor_delivers_every_batch_exactly_once(tmp_path):
    """The dataset kills its actor once, mid-epoch: a replacement actor loads
    what the dead one held, and every batch arrives once, equal to local workers'."""
    marker = str(tmp_path / "died")
    kwargs = dict(batch_size=2, num_workers=2, prefetch=6)
    with pytest.warns(RuntimeWarning, match="restarting it"):
        remote = list(mxload.DataLoader(DyingDataset(at=9, how="kill", n=40, only_once_file=marker),
                                        backend=SMALL, max_worker_restarts=1, **kwargs))
    assert os.path.exists(marker)
    local = list(mxload.DataLoader(DyingDataset(at=-1, n=40), **kwargs))
    assert_same_batches(local, remote)


def test_profiler_reports_actor_busy_time_and_the_transfer():
    loader = mxload.DataLoader(SlowDataset(0.01, n=32), batch_size=4, num_workers=1, backend=SMALL,
                               profile=True)
    assert len(list(loader)) == 8
    report = loader.profiler.report()
    assert "worker" in str(report).lower()
    assert loader.profiler.worker_stage_ns["transport"] > 0
    busy_ns, batches, _, _, pid, _ = loader.profiler.workers[0]
    assert batches == 8 and busy_ns >= 8 * 4 * 0.01 * 1e9 * 0.9
    assert pid is not None   # an actor on this node: its CPU time is read as a local worker's


_CHILD = textwrap.dedent("""
    import os, sys, time, signal
    signal.signal(signal.SIGINT, signal.default_int_handler)   # even if the suite runs with SIGINT ignored
    sys.path.insert(0, {tests!r})
    import ray, mxload
    from datasets_for_tests import SlowDataset
    ray.init(address={address!r}, log_to_driver=False)
    print(ray.get_runtime_context().get_job_id(), flush=True)
    # An epoch far longer than the test (about 500 s): on a loaded machine the
    # Ctrl-C must still find it in progress, not finished.
    loader = mxload.DataLoader(SlowDataset(0.05, n=20_000), batch_size=2, num_workers=2,
                               backend=mxload.RayBackend(num_cpus_per_worker=0.25))
    it = iter(loader)
    next(it)
    print("iterating", flush=True)
    if {how!r} == "exit":
        sys.stdin.readline()
        sys.exit(0)   # interpreter exit with the epoch in progress
    for batch in it:
        pass
""")


def _actors_of_job(job: str) -> list:
    from ray._private.state import state
    return [a for a in state.actor_table(None).values()
            if a["JobID"] == job and a["ActorClassName"].endswith("LoaderActor") and a["State"] != "DEAD"]


@pytest.mark.parametrize("how", ["exit", "ctrl-c"])
def test_interpreter_exit_and_ctrl_c_kill_the_actors(how):
    import ray
    address = ray.get_runtime_context().gcs_address
    script = _CHILD.format(tests=ray_harness.TESTS_DIR, address=address, how=how)
    child = fresh_python.start_args("-c", script, stdin=subprocess.PIPE)
    try:
        job = child.stdout.readline().strip()
        assert child.stdout.readline().strip() == "iterating", child.stderr.read()
        deadline = time.monotonic() + 10
        while len(_actors_of_job(job)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)   # the second actor may still be registering
        assert len(_actors_of_job(job)) == 2
        if how == "ctrl-c":
            child.send_signal(signal.SIGINT)
        _, err = child.communicate("exit\n", timeout=60)
        if how == "ctrl-c":
            assert "KeyboardInterrupt" in err
        else:
            assert child.returncode == 0, err
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    deadline = time.monotonic() + 5
    while _actors_of_job(job) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _actors_of_job(job) == []


def test_break_kills_every_actor_and_releases_every_reference():
    """`for ...: break`, again and again (MXLOAD_RAY_CYCLES, default 2; bench/ray.py runs 100):
    the actors are dead and no reference is held once the loop let go of the
    iterator, without a garbage collection."""
    for _ in range(int(os.environ.get("MXLOAD_RAY_CYCLES", "2"))):
        for _batch in mxload.DataLoader(TupleDataset(16), batch_size=2, num_workers=2, backend=SMALL):
            assert len(ray_harness.live_loader_actors()) == 2
            break
        ray_harness.assert_nothing_of_ours(within=1.5)


def test_the_fetcher_keeps_no_object_reference_once_it_stopped():
    """CI: after a node's death, the teardown found an ObjectRef still held
    ('local': 1).  The fetcher took a completion just as the shutdown
    began and returned with it in its frame; an actor call that had failed
    before (its error raised and caught in the fetcher, the error's traceback
    holding the fetcher's frames: a cycle) kept that frame, and the ref in
    it, until a garbage collection.  Here the shutdown lands exactly there:
    with the collector off, no reference may be left."""
    import gc
    import queue
    import threading
    from concurrent.futures import Future
    from types import SimpleNamespace

    import ray

    from mxload._runtime import messages as m
    from mxload._runtime.ray import transport as ray_transport
    from mxload._runtime.transport import TransportSetup

    lost = []
    sink = SimpleNamespace(deliver=lambda *a: None, worker_lost=lost.append, fail=lambda e: None)
    transport = ray_transport.RayTransport(
        TransportSetup(sink, threading.RLock(), SimpleNamespace(num_workers=1), None, "Dataset", 1, None),
        SMALL)
    transport._ray = ray
    actor = ray_transport._Actor(0, None)
    died, late = Future(), Future()
    died.set_exception(RuntimeError("the actor's node died"))
    late.set_result(None)
    ref = ray.put(0)
    held = ref.hex()
    completions = queue.SimpleQueue()
    completions.put((actor, None, m.Task(0, 0, None), died))
    completions.put((actor, ref, m.Task(0, 1, None), late))
    del ref

    class ShutdownMeanwhile:
        """The fetcher's queue, with stop_receiving landing as the last completion is taken."""
        def get(self, timeout):
            item = completions.get_nowait()
            if completions.empty():
                transport._stopping = True
            return item

    transport._done = ShutdownMeanwhile()
    fetcher = threading.Thread(target=transport._fetch_loop)
    gc.disable()
    try:
        fetcher.start()
        fetcher.join(timeout=10)
        assert not fetcher.is_alive()
        assert [loss.worker_id for loss in lost] == [0]   # the failed call was handled
        left = ray_harness.our_refs()
    finally:
        gc.enable()
    assert held not in left, left


def test_an_actor_that_cannot_be_created_says_why_without_colour_codes(tmp_path):
    """`python bench/ray.py` from the repository root: Ray puts the driver's
    working directory first on its workers' sys.path, where the source
    folder mxload/ (no compiled core) shadows the installed mxload, and the
    error said only "ActorDiedError ... TemporaryActor ... check RayBackend's
    resources and runtime_env", with raw colour codes; the ImportError was
    only in Ray's worker log.  The loader's error must carry the cause, say
    what to do, and hold no escape code.  (A child process whose working
    directory holds such an mxload/, on this module's Ray instance.)"""
    import ray
    shadow = tmp_path / "mxload"
    shadow.mkdir()
    (shadow / "__init__.py").write_text('raise ImportError("simulated: no compiled core in this mxload/")\n')
    real = os.path.dirname(os.path.dirname(os.path.abspath(mxload.__file__)))
    script = textwrap.dedent(f"""
        import sys
        here = ("", {str(tmp_path)!r})   # the driver imports the real mxload; Ray's workers get this folder
        sys.path[:] = [{real!r}, {ray_harness.TESTS_DIR!r}] + [p for p in sys.path if p not in here]
        import numpy as np, ray, mxload
        ray.init(address={ray.get_runtime_context().gcs_address!r}, log_to_driver=False)
        loader = mxload.DataLoader(mxload.ArrayDataset(np.arange(8)), batch_size=2, num_workers=1, timeout=60,
                                   backend=mxload.RayBackend(num_cpus_per_worker=0.25))
        try:
            list(loader)
            print("no error")
        except mxload.WorkerError as e:
            print(repr(str(e)))
    """)
    proc = fresh_python.run_args("-c", script, timeout=100, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    message = eval(proc.stdout.strip().splitlines()[-1])   # the repr printed above
    assert "ImportError: simulated: no compiled core in this mxload/" in message, message
    assert "run the script from another directory" in message, message
    assert "\x1b" not in message, message


@pytest.mark.faults
def test_a_stopped_actor_is_named_stopped_with_the_hint_to_continue_it():
    """A SIGSTOPped actor on the trainer's node was called "alive" in the
    timeout error; local workers are named "stopped" with the hint to
    SIGCONT them.  The same for Ray.  (timeout covers the first batch, the actor's start
    included: 2 s timed out before Ray placed it on a loaded machine.)"""
    loader = mxload.DataLoader(SlowDataset(0.05, n=64), batch_size=2, num_workers=1, backend=SMALL, timeout=8)
    it = iter(loader)
    next(it)
    victim = ray_harness.live_loader_actors()[0]
    os.kill(int(victim["Pid"]), signal.SIGSTOP)
    try:
        with pytest.raises(LoaderTimeoutError) as info:
            for _ in it:
                pass
    finally:
        os.kill(int(victim["Pid"]), signal.SIGCONT)
    message = str(info.value)
    assert "stopped" in message and "kill -CONT" in message, message
    assert "alive" not in message, message
    del it


@pytest.mark.faults
def test_ray_shut_down_while_an_epoch_runs_is_a_worker_error_within_seconds():
    """ray.shutdown() while an epoch runs: the loop waited for `timeout`
    (forever with None) and then called the dead actors "alive", or Ray's
    bare "Failed to submit task to actor" escaped.  It must fail within
    seconds with a WorkerError saying what happened, and leave nothing: the
    shutdown's ray.kill() started a new local Ray (Ray's auto-init: 2.4 s
    quiet, 13-18 s on a loaded machine, and a Ray instance the user had
    just shut down running again).  (In a child process: this module's Ray
    instance must stay up.)"""
    script = textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
        import ray, mxload, ray_harness
        from datasets_for_tests import SlowDataset

        def children():
            found = []
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    with open(f"/proc/{{pid}}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                if int(fields[1]) == os.getpid() and fields[0] != "Z":
                    found.append(pid)
            return found

        ray_harness.local()
        loader = mxload.DataLoader(SlowDataset(0.1, n=400), batch_size=2, num_workers=2,
                                   backend=mxload.RayBackend(num_cpus_per_worker=0.25), timeout=None)
        it = iter(loader)
        next(it)
        ray.shutdown()
        t0 = time.monotonic()
        try:
            for _ in it:
                pass
            print("no error", flush=True)
        except mxload.WorkerError as e:
            took = time.monotonic() - t0
            print(f"the error came {{took:.2f}} s after ray.shutdown(): {{e}}", file=sys.stderr)
            print("WorkerError", took < 10, "shut down" in str(e), "alive" not in str(e), flush=True)
        except BaseException as e:
            print("other", type(e).__name__, e, flush=True)
        del it
        print("left", ray.is_initialized(), children(), flush=True)
    """)
    proc = fresh_python.run_args("-c", script, timeout=100)
    assert proc.stdout.splitlines()[-2:] == ["WorkerError True True True", "left False []"], (
        proc.stdout, proc.stderr[-3000:])
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.faults
def test_persistent_actors_after_ray_was_restarted_are_started_anew():
    """A persistent Ray loader, Ray shut down and started again between
    epochs: Ray's bare "Exception: Failed to submit task to actor" escaped
    (after ~8 s).  The next epoch starts new actors in the new Ray and
    delivers every batch.  (In a child process: this module's Ray instance
    must stay up.)"""
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
        import numpy as np, ray, mxload, ray_harness
        ray_harness.local()
        loader = mxload.DataLoader(mxload.ArrayDataset(np.arange(40)), batch_size=4, num_workers=2,
                                   persistent_workers=True, timeout=30,
                                   backend=mxload.RayBackend(num_cpus_per_worker=0.25))
        first = np.concatenate(list(loader)).tolist()
        ray_harness.stop()
        ray_harness.local()
        t0 = time.monotonic()
        try:
            second = np.concatenate(list(loader)).tolist()
            print("second epoch", first == second == list(range(40)), time.monotonic() - t0 < 20, flush=True)
        except BaseException as e:
            print("error", type(e).__name__, e, flush=True)
        loader.close()
    """)
    proc = fresh_python.run_args("-c", script, timeout=100)
    assert proc.stdout.splitlines()[-1:] == ["second epoch True True"], (proc.stdout, proc.stderr[-3000:])
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_an_infinite_sampler_is_drawn_as_the_actors_need_it_and_resumes():
    """Samplers are drawn lazily on Ray too (its dispatch has no task queue): an infinite one
    gives batches, a checkpoint mid-stream resumes in a fresh loader exactly, and a sampler
    that raises mid-epoch raises itself after the batches before it, leaving no actor."""
    from test_lazy_sampler import BreaksAt, Endless, Squares

    def loader(sampler):
        return mxload.DataLoader(Squares(), batch_size=4, sampler=sampler, num_workers=2, backend=SMALL,
                                 timeout=60)
    with loader(Endless(1000, seed=1)) as first:
        it = iter(first)
        taken = [next(it)[:, 0].tolist() for _ in range(6)]
        state = first.state_dict()
        more = [next(it)[:, 0].tolist() for _ in range(4)]
    flat = [i for _, i in zip(range(40), iter(Endless(1000, seed=1)))]
    assert taken + more == [flat[i:i + 4] for i in range(0, 40, 4)]
    with loader(Endless(1000, seed=1)) as resumed:
        resumed.load_state_dict(state)
        it = iter(resumed)
        assert [next(it)[:, 0].tolist() for _ in range(4)] == more
        it.close()
    with loader(BreaksAt(100, good=10)) as broken:
        it = iter(broken)
        assert [next(it)[:, 0].tolist() for _ in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
        with pytest.raises(ValueError, match="corrupt"):
            next(it)
        assert it.engine.state == "closed"
