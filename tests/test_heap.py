"""A worker process keeps the memory it frees (mxload/_runtime/local/heap.py), and so does the
training process where mxload loads batches in it (mxload/_runtime/os_malloc.py)."""
from __future__ import annotations

import gc
import os
import resource

import fresh_python
import numpy as np
import pytest
from conftest import start_methods

import mxload
from mxload._runtime.local import heap

glibc = pytest.mark.skipif(not os.confstr("CS_GNU_LIBC_VERSION"), reason="glibc's malloc only")

BLOCKS, BLOCK_BYTES = 16, 1 << 20


class _FaultsPerSample(mxload.Dataset):
    """Each sample allocates and writes 16 blocks of 1 MiB and frees them, as
    decoding a batch of images does, and is the number of page faults that
    took in the worker."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> np.int64:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        blocks = [np.ones(BLOCK_BYTES // 8) for _ in range(BLOCKS)]
        del blocks
        return np.int64(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)


def _faults(**kwargs: object) -> list[int]:
    with mxload.DataLoader(_FaultsPerSample(), batch_size=1, num_workers=1, **kwargs) as loader:
        return [int(b[0]) for b in loader]


@glibc
def test_a_worker_reuses_what_it_freed():
    """The first sample faults its 16 MiB in; the next ones reuse them (a
    page is 4 KiB: 4096 faults for 16 MiB)."""
    faults = _faults()
    assert faults[0] >= BLOCKS * BLOCK_BYTES // 4096 // 2, faults
    assert max(faults[2:]) < 200, faults


@glibc
def test_the_system_policy_is_kept_on_request(monkeypatch):
    """MXLOAD_WORKER_MALLOC=system: glibc's own thresholds, under which the
    freed blocks go back to the kernel and every sample faults them in again
    (what the test above would see without the fix)."""
    monkeypatch.setenv("MXLOAD_WORKER_MALLOC", "system")
    # Spawned: a forked worker would inherit this process's thresholds, which glibc raises
    # whenever a block above them is freed (an earlier test in this process may have).
    faults = _faults(start_method="spawn")
    assert min(faults[2:]) > 1000, faults


@glibc
@pytest.mark.parametrize("env", [{"MALLOC_TRIM_THRESHOLD_": str(1 << 20)},
                                 {"GLIBC_TUNABLES": f"glibc.malloc.trim_threshold={1 << 20}"}],
                         ids=["the program's MALLOC_*", "its GLIBC_TUNABLES"])
def test_a_worker_keeps_the_policy_the_program_set(monkeypatch, env):
    """A program that set its own malloc policy in the environment keeps it in the workers
    too (os_malloc.py: "nothing is changed where the program chose its own policy"): glibc
    applies it at the spawned worker's start, and under it (a fixed trim threshold fixes
    the mmap threshold at 128 KiB) every sample's 1 MiB blocks are mmapped and faulted in
    again."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    faults = _faults(start_method="spawn")
    assert min(faults[2:]) > 1000, faults


def test_nothing_is_done_on_request_or_without_glibc(monkeypatch):
    monkeypatch.setenv("MXLOAD_WORKER_MALLOC", "System ")
    assert heap.keep_freed_memory() is False
    monkeypatch.delenv("MXLOAD_WORKER_MALLOC")
    monkeypatch.setattr(os, "confstr", lambda name: None)
    assert heap.keep_freed_memory() is False


IN_THE_TRAINING_PROCESS = """
    import resource
    from mxload._runtime import os_malloc

    class FaultsPerSample(mxload.Dataset):   # as _FaultsPerSample, in this process's heap
        def __len__(self):
            return 8

        def __getitem__(self, i):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            blocks = [np.ones({block} // 8) for _ in range({blocks})]
            del blocks
            return np.int64(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)

    calls = []
    fix = os_malloc.fix_thresholds
    os_malloc.fix_thresholds = lambda *args: calls.append(args) or fix(*args)
    kwargs = {kwargs}
    with mxload.DataLoader(FaultsPerSample(), batch_size=1, **kwargs) as loader:
        faults = [int(b[0]) for b in loader]
    print(os_malloc.keep_freed_memory_in_training_process(), len(calls), faults)
"""


def _faults_in_the_training_process(kwargs: str, env: dict[str, str]) -> tuple[str, int, list[int]]:
    """(whether the thresholds are fixed, mallopt calls made, page faults of each sample)."""
    result = fresh_python.run(IN_THE_TRAINING_PROCESS.format(block=BLOCK_BYTES, blocks=BLOCKS, kwargs=kwargs),
                              env={**os.environ, **env}, timeout=50)
    assert result.returncode == 0, result.stderr
    fixed, calls, faults = result.stdout.strip().split(" ", 2)
    return fixed, int(calls), [int(f) for f in faults.strip("[]").split(",")]


CLEAN = {"MXLOAD_MALLOC": "", "MXLOAD_WORKER_MALLOC": "", "GLIBC_TUNABLES": ""}


@glibc
@pytest.mark.parametrize("kwargs", ["{}", "{'num_workers': 2, 'thread_pool': True}",
                                    "{'num_workers': 'auto'}"])
def test_the_training_process_reuses_what_it_freed_when_it_loads_batches(kwargs):
    """Loading in the training process (no workers, thread workers, auto's probe), the
    samples' freed blocks are kept for the next ones (os_malloc.py: glibc's thresholds fixed
    at its own largest values); under glibc's moving thresholds every sample faulted its
    16 MiB in again (the next test)."""
    fixed, calls, faults = _faults_in_the_training_process(kwargs, CLEAN)
    assert (fixed, calls) == ("True", 1)
    # In process: 0-20 a sample.  A worker thread's heap (glibc gives each thread an arena of its
    # own) warms on its first samples and settles at 0-800: against 4,064 a sample under glibc's
    # policy (16 MiB in 4 KiB pages, the next test), 556-8,482 with the threads.
    assert max(faults[4:]) < BLOCKS * BLOCK_BYTES // 4096 // 4, faults


@glibc
@pytest.mark.parametrize("env", [{"MXLOAD_MALLOC": "system"},
                                 {"MALLOC_TRIM_THRESHOLD_": str(1 << 20)},
                                 {"GLIBC_TUNABLES": f"glibc.malloc.trim_threshold={1 << 20}"}],
                         ids=["MXLOAD_MALLOC=system", "the program's MALLOC_*", "its GLIBC_TUNABLES"])
def test_the_training_process_keeps_its_own_policy_on_request_or_where_it_set_one(env):
    """No mallopt call.  Under a trim threshold the program set, glibc's mmap threshold stays at
    128 KiB too, so every sample's 1 MiB blocks fault in again; under glibc's moving thresholds
    (MXLOAD_MALLOC=system) where freed blocks go depends on the heap's layout: not asserted."""
    fixed, calls, faults = _faults_in_the_training_process("{}", {**CLEAN, **env})
    assert (fixed, calls) == ("False", 0)
    if "MXLOAD_MALLOC" not in env:
        assert min(faults[2:]) > BLOCKS * BLOCK_BYTES // 4096 // 2, faults


def test_the_training_process_is_left_alone_until_it_loads_a_batch():
    """Importing mxload, building a loader and loading with worker processes change nothing in
    the training process's malloc."""
    result = fresh_python.run("""
        from mxload._runtime import os_malloc
        loader = mxload.DataLoader(list(range(8)), batch_size=2, num_workers=1)
        assert len(list(loader)) == 4
        print(os_malloc._training_process_done)
    """, timeout=50)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["None"]


class _CollectorView(mxload.Dataset):
    """Each sample: the objects frozen and the objects tracked by the garbage
    collector of the worker that loads it, and what a full collection there
    frees of a cycle made just before."""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> tuple[np.int64, np.int64, np.int64]:
        cycle: list[object] = []
        cycle.append(cycle)
        del cycle
        freed = gc.collect()
        return np.int64(gc.get_freeze_count()), np.int64(len(gc.get_objects())), np.int64(freed)


INHERITED_OBJECTS = 200_000


@pytest.mark.parametrize("start_method", start_methods("fork", "forkserver", "spawn"))
def test_a_worker_s_collector_never_walks_what_it_inherited(start_method):
    """A forked worker inherits the training process's heap (hundreds of
    thousands of objects once torch is imported): its full collections
    walked them all, stopping both workers for ~100 ms in the second epoch
    and copying every page of that heap.  Frozen at the worker's start they
    are out of the collector's way; what the worker makes is still collected."""
    inherited = [[i] for i in range(INHERITED_OBJECTS)]   # tracked objects of this process
    loader = mxload.DataLoader(_CollectorView(), batch_size=1, num_workers=1, start_method=start_method)
    with loader:
        for frozen, tracked, freed in loader:
            if start_method == "fork":
                assert int(frozen[0]) >= INHERITED_OBJECTS, (int(frozen[0]), int(tracked[0]))
            assert int(tracked[0]) < INHERITED_OBJECTS // 4, (int(frozen[0]), int(tracked[0]))
            assert int(freed[0]) >= 1
    assert len(inherited) == INHERITED_OBJECTS
