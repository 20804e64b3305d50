"""DistributedSampler with torch.distributed, and DataLoader(distributed=True).

The torchrun test launches examples/torchrun_sharding.py on 2 ranks (gloo,
CPU) once per module and checks what every rank wrote.  The other tests need
no launcher; the ones that need torch skip when it is not importable.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import types
from pathlib import Path

import fresh_python
import numpy as np
import pytest

import mxload
from mxload.sampler import DistributedSampler

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "torchrun_sharding.py"
TORCHRUN_TIMEOUT_S = 120
N, BATCH, SEED, EPOCHS, WORLD = 103, 8, 1234, 2, 2


def _require_torch_distributed():
    """Skip (with the reason) unless torch.distributed with gloo can be used."""
    try:
        import torch.distributed as dist
    except ImportError as e:
        pytest.skip(f"torch is not importable ({e}); install torch==2.13.0 for the distributed tests")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("this torch build has no torch.distributed / gloo backend")
    return dist


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def _run(args, timeout, **kw):
    """Run a fresh interpreter with `args` in its own session and wait for it; on timeout kill
    the whole group (torchrun and its ranks and their workers), so nothing outlives us."""
    proc = fresh_python.start_args(*args, stderr=subprocess.STDOUT, start_new_session=True, **kw)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"python {' '.join(args)} did not finish within {timeout} s; output:\n{out}")
    return proc.returncode, out


# --- torchrun: 2 ranks, gloo ---------------------------------------------------

@pytest.fixture(scope="module")
def torchrun_result(tmp_path_factory):
    _require_torch_distributed()
    out_dir = tmp_path_factory.mktemp("torchrun")
    cmd = ["-m", "torch.distributed.run", f"--nproc_per_node={WORLD}",
           f"--master_port={_free_port()}", str(EXAMPLE), "--out", str(out_dir),
           "--num-samples", str(N), "--batch-size", str(BATCH), "--seed", str(SEED), "--epochs", str(EPOCHS),
           "--num-workers", "2"]
    rc, out = _run(cmd, TORCHRUN_TIMEOUT_S, cwd=str(ROOT), env=_env())
    assert rc == 0, f"torchrun exited with {rc}:\n{out}"
    ranks = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for r, res in enumerate(ranks):
        assert (res["rank"], res["world_size"]) == (r, WORLD)
    return ranks


def _flat(batches):
    return [i for b in batches for i in b]


@pytest.mark.e2e
@pytest.mark.torch
@pytest.mark.parametrize("drop_last", [False, True])
def test_torchrun_equal_batch_counts(torchrun_result, drop_last):
    key = f"drop_last={drop_last}"
    per_rank = [res["runs"][key] for res in torchrun_result]
    for r, run in enumerate(per_rank):
        assert run["sampler"] == {"rank": r, "num_replicas": WORLD}  # from the process group
        # The all-gathered counts agree, and match what was actually delivered.
        assert run["batch_counts"] == per_rank[0]["batch_counts"]
        assert run["batch_counts"][r] == [len(e) for e in run["epochs"]]
    per_rank_len = N // WORLD if drop_last else -(-N // WORLD)   # 51 / 52 indices per rank
    expected = per_rank_len // BATCH if drop_last else -(-per_rank_len // BATCH)
    assert [len(e) for e in per_rank[0]["epochs"]] == [expected] * EPOCHS


@pytest.mark.e2e
@pytest.mark.torch
def test_torchrun_padding_covers_dataset(torchrun_result):
    per_rank_len = -(-N // WORLD)                     # 52
    total = per_rank_len * WORLD                      # 104: one index repeated
    for epoch in range(EPOCHS):
        shards = [_flat(res["runs"]["drop_last=False"]["epochs"][epoch]) for res in torchrun_result]
        assert all(len(s) == per_rank_len for s in shards)
        flat = [i for s in shards for i in s]
        assert len(flat) == total
        assert set(flat) == set(range(N))
        # Disjoint except for the padding, which repeats the start of the order.
        merged = np.empty(total, dtype=np.int64)
        for r, s in enumerate(shards):
            merged[r::WORLD] = s
        assert len(set(merged[:N].tolist())) == N
        assert merged[N:].tolist() == merged[:total - N].tolist()
        counts = np.bincount(flat, minlength=N)
        assert sorted(counts.tolist()) == [1] * (2 * N - total) + [2] * (total - N)


@pytest.mark.e2e
@pytest.mark.torch
def test_torchrun_drop_last_disjoint(torchrun_result):
    per_rank_len = N // WORLD                         # 51 from the sampler ...
    delivered = per_rank_len // BATCH * BATCH         # ... 48 in full batches
    for epoch in range(EPOCHS):
        shards = [_flat(res["runs"]["drop_last=True"]["epochs"][epoch]) for res in torchrun_result]
        assert [len(s) for s in shards] == [delivered] * WORLD
        flat = [i for s in shards for i in s]
        assert len(set(flat)) == len(flat)
        for r, s in enumerate(shards):
            expected = DistributedSampler(N, WORLD, r, seed=SEED, drop_last=True)
            expected.set_epoch(epoch)
            assert s == expected.epoch_indices()[:delivered].tolist()


@pytest.mark.e2e
@pytest.mark.torch
def test_torchrun_set_epoch_reshuffles_identically_on_every_rank(torchrun_result):
    total = -(-N // WORLD) * WORLD
    orders = []
    for epoch in range(EPOCHS):
        shards = [_flat(res["runs"]["drop_last=False"]["epochs"][epoch]) for res in torchrun_result]
        merged = np.empty(total, dtype=np.int64)
        for r, s in enumerate(shards):
            merged[r::WORLD] = s
        # One global permutation (the same on every rank), as computed here.
        perm = np.random.default_rng([SEED, epoch]).permutation(N)
        np.testing.assert_array_equal(merged, np.resize(perm, total))
        for r, s in enumerate(shards):
            expected = DistributedSampler(N, WORLD, r, seed=SEED)
            expected.set_epoch(epoch)
            assert s == expected.epoch_indices().tolist()
        orders.append(merged.tolist())
    assert orders[0] != orders[1]


# --- rank / world size: torch.distributed, then env, then 1/0 ---------------------

@pytest.mark.torch
def test_sampler_uses_initialised_process_group(tmp_path, monkeypatch):
    dist = _require_torch_distributed()
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        s = DistributedSampler(10, shuffle=False)
        assert (s.num_replicas, s.rank) == (1, 0)          # the group wins over the env
        assert s.epoch_indices().tolist() == list(range(10))
        loader = mxload.DataLoader(mxload.ArrayDataset(np.arange(10)), batch_size=4, distributed=True)
        assert (loader.sampler.num_replicas, loader.sampler.rank) == (1, 0)
        assert len(loader) == 3
        s = DistributedSampler(10, num_replicas=2, rank=1)  # explicit arguments win over both
        assert (s.num_replicas, s.rank) == (2, 1)
        s = DistributedSampler(10, num_replicas=4)          # rank alone from the group
        assert (s.num_replicas, s.rank) == (4, 0)
    finally:
        dist.destroy_process_group()
    s = DistributedSampler(10)
    assert (s.num_replicas, s.rank) == (4, 3)               # group gone: env again


def _fake_dist(monkeypatch, available=True, initialized=True, world=3, rank=2):
    fake = types.ModuleType("torch.distributed")
    fake.is_available = lambda: available
    fake.is_initialized = lambda: initialized
    fake.get_world_size = lambda: world
    fake.get_rank = lambda: rank
    monkeypatch.setitem(sys.modules, "torch.distributed", fake)


def test_sampler_prefers_process_group_over_env(monkeypatch):
    # A stand-in torch.distributed: runs without torch installed.
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "1")
    _fake_dist(monkeypatch)
    s = DistributedSampler(10)
    assert (s.num_replicas, s.rank) == (3, 2)
    assert len(s) == 4


@pytest.mark.parametrize("available,initialized", [(True, False), (False, False)])
def test_sampler_env_fallback_when_no_group(monkeypatch, available, initialized):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "1")
    _fake_dist(monkeypatch, available=available, initialized=initialized)
    s = DistributedSampler(10)
    assert (s.num_replicas, s.rank) == (4, 1)
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("RANK")
    s = DistributedSampler(10)
    assert (s.num_replicas, s.rank) == (1, 0)


def test_sampler_broken_torch_distributed_falls_back(monkeypatch):
    fake = types.ModuleType("torch.distributed")  # e.g. a stub without is_initialized
    monkeypatch.setitem(sys.modules, "torch.distributed", fake)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert (DistributedSampler(4).num_replicas, DistributedSampler(4).rank) == (2, 1)


def test_sampler_bad_rank_from_group_names_source(monkeypatch):
    _fake_dist(monkeypatch, world=2, rank=1)
    with pytest.raises(ValueError, match=r"rank \(from torch.distributed\) must be in \[0, 1\)"):
        DistributedSampler(10, num_replicas=1)


def test_import_mxload_does_not_import_torch():
    """Nor does a loader over a plain list, or a distributed one, built and iterated."""
    code = ("import sys, numpy as np, mxload\n"
            "list(mxload.DataLoader([1, 2], batch_size=2))\n"
            "s = mxload.sampler.DistributedSampler(10)\n"
            "l = mxload.DataLoader(mxload.ArrayDataset(np.arange(10)), batch_size=4, distributed=True)\n"
            "list(l)\n"
            "print('torch' in sys.modules, 'torch.distributed' in sys.modules)\n")
    rc, out = _run(["-c", code], 60, cwd=str(ROOT), env=_env())
    assert rc == 0, out
    assert out.strip().splitlines()[-1] == "False False"


# --- DataLoader(distributed=True) ------------------------------------------------

def _ds(n=10):
    return mxload.ArrayDataset(np.arange(n, dtype=np.int64))


@pytest.mark.parametrize("kwargs,named", [
    ({"sampler": [0, 1, 2]}, "sampler"),
    ({"batch_sampler": [[0, 1], [2]]}, "batch_sampler"),
    ({"sampler": [0, 1], "batch_sampler": [[0, 1]]}, "sampler, batch_sampler"),
])
def test_loader_distributed_conflicts(kwargs, named):
    with pytest.raises(ValueError, match=f"distributed=True is mutually exclusive with {named}"):
        mxload.DataLoader(_ds(), batch_size=None if "batch_sampler" in kwargs else 2,
                          distributed=True, **kwargs)


def test_loader_distributed_rejects_iterable_dataset():
    class Stream(mxload.IterableDataset):
        def __iter__(self):
            return iter(range(5))

    with pytest.raises(ValueError, match="distributed=True cannot be used with an IterableDataset"):
        mxload.DataLoader(Stream(), batch_size=2, distributed=True)


def test_loader_distributed_builds_sampler(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delitem(sys.modules, "torch.distributed", raising=False)
    loader = mxload.DataLoader(_ds(7), batch_size=2, distributed=True)
    s = loader.sampler
    assert isinstance(s, DistributedSampler)
    assert (s.num_replicas, s.rank, s.shuffle, s.seed, s.drop_last) == (2, 1, False, 0, False)
    assert len(loader) == 2
    assert [b.tolist() for b in loader] == [[1, 3], [5, 0]]        # padded with index 0

    loader = mxload.DataLoader(_ds(7), batch_size=2, shuffle=True, seed=5, drop_last=True,
                               distributed=True)
    s = loader.sampler
    assert (s.shuffle, s.seed, s.drop_last, len(s)) == (True, 5, True, 3)
    perm = np.random.default_rng([5, 0]).permutation(7)
    assert [b.tolist() for b in loader] == [perm[:6][1::2][:2].tolist()]
    # seed=None means 0 on every rank (a random seed would differ per rank).
    assert mxload.DataLoader(_ds(7), batch_size=2, shuffle=True, distributed=True).sampler.seed == 0
    # last_batch="discard" also drops the sampler's tail.
    assert mxload.DataLoader(_ds(7), batch_size=2, last_batch="discard",
                             distributed=True).sampler.drop_last


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_honours_set_epoch(monkeypatch, num_workers):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delitem(sys.modules, "torch.distributed", raising=False)
    n = 40
    with mxload.DataLoader(_ds(n), batch_size=4, shuffle=True, seed=3, num_workers=num_workers,
                           distributed=True) as loader:
        def epoch():
            return [i for b in loader for i in b.tolist()]

        def expected(e):
            return np.random.default_rng([3, e]).permutation(n)[0::2].tolist()

        # PyTorch's idiom: set_epoch(e) before every epoch.
        runs = []
        for e in (0, 1, 1, 0):
            loader.sampler.set_epoch(e)
            runs.append(epoch())
        assert runs == [expected(0), expected(1), expected(1), expected(0)]
        # Without set_epoch the epoch advances by itself (0 was just used).
        assert epoch() == expected(1)
        assert epoch() == expected(2)


def test_loader_explicit_distributed_sampler_set_epoch():
    s = DistributedSampler(20, num_replicas=2, rank=1, seed=9)
    loader = mxload.DataLoader(_ds(20), batch_size=5, sampler=s)
    assert loader.sampler is s
    s.set_epoch(4)
    assert [i for b in loader for i in b.tolist()] == \
        np.random.default_rng([9, 4]).permutation(20)[1::2].tolist()
    assert s.epoch == 5


def test_loader_sampler_attribute_defaults():
    assert isinstance(mxload.DataLoader(_ds(), batch_size=2).sampler, mxload.sampler.SequentialSampler)
    assert isinstance(mxload.DataLoader(_ds(), batch_size=2, shuffle=True).sampler,
                      mxload.sampler.RandomSampler)
    bs = mxload.sampler.BatchSampler(mxload.sampler.SequentialSampler(10), 3)
    assert mxload.DataLoader(_ds(), batch_sampler=bs).sampler is bs.sampler
    assert mxload.DataLoader(_ds(), batch_sampler=[[0, 1], [2]]).sampler is None
