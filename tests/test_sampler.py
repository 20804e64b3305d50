import numpy as np
import pytest

from mxload.sampler import (
    BatchSampler,
    DistributedSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

# --- SequentialSampler -------------------------------------------------------

def test_sequential_order_and_types():
    s = SequentialSampler(5)
    out = list(s)
    assert out == [0, 1, 2, 3, 4]
    assert all(type(i) is int for i in out)
    assert len(s) == 5
    assert isinstance(s, Sampler)


def test_sequential_epoch_indices_is_int64_array():
    idx = SequentialSampler(4).epoch_indices()
    assert isinstance(idx, np.ndarray)
    assert idx.dtype == np.int64 and idx.ndim == 1
    assert idx.tolist() == [0, 1, 2, 3]


def test_sequential_empty():
    assert list(SequentialSampler(0)) == []


def test_sequential_long_iteration_crosses_chunks():
    assert list(SequentialSampler(10_000)) == list(range(10_000))


@pytest.mark.parametrize("bad", [-1, 2.5, "3", None, True])
def test_sequential_bad_n(bad):
    with pytest.raises(ValueError, match="n must be"):
        SequentialSampler(bad)


# --- RandomSampler -----------------------------------------------------------

def test_random_is_permutation():
    s = RandomSampler(100, seed=1)
    out = list(s)
    assert sorted(out) == list(range(100))
    assert out != list(range(100))
    assert all(type(i) is int for i in out)
    assert len(s) == 100


def test_random_matches_documented_scheme():
    s = RandomSampler(50, seed=7)
    for e in range(3):
        expected = np.random.default_rng([7, e]).permutation(50)
        np.testing.assert_array_equal(s.epoch_indices(), expected)


def test_random_reproducible_with_same_seed():
    a, b = RandomSampler(64, seed=123), RandomSampler(64, seed=123)
    for _ in range(3):
        assert list(a) == list(b)


def test_random_epochs_differ_and_counter_advances():
    s = RandomSampler(64, seed=0)
    assert s.epoch == 0
    e0 = list(s)
    assert s.epoch == 1
    e1 = s.epoch_indices().tolist()
    assert s.epoch == 2
    assert e0 != e1
    assert sorted(e0) == sorted(e1) == list(range(64))


def test_random_epoch_advances_when_iter_is_called():
    s = RandomSampler(10, seed=0)
    iter(s)
    assert s.epoch == 1


def test_random_set_epoch_replays_epoch():
    s = RandomSampler(32, seed=5)
    first = [list(s) for _ in range(3)]
    s.set_epoch(1)
    assert list(s) == first[1]
    assert s.epoch == 2
    s.set_epoch(0)
    assert s.epoch_indices().tolist() == first[0]


def test_random_seed_none_draws_different_seeds():
    a, b = RandomSampler(1000), RandomSampler(1000)
    assert isinstance(a.seed, int) and a.seed >= 0
    assert a.seed != b.seed
    assert list(a) != list(b)
    # The drawn seed reproduces the order.
    c, d = RandomSampler(1000), RandomSampler(1000, seed=None)
    assert list(RandomSampler(1000, seed=c.seed)) == list(c)
    assert d.seed != c.seed


@pytest.mark.parametrize("bad", [-1, 1.5, "x"])
def test_random_bad_seed(bad):
    with pytest.raises(ValueError, match="seed must be"):
        RandomSampler(10, seed=bad)


def test_random_bad_epoch():
    s = RandomSampler(10, seed=0)
    with pytest.raises(ValueError, match="epoch must be a non-negative integer, got -1"):
        s.set_epoch(-1)
    with pytest.raises(ValueError, match="epoch must be a non-negative integer, got 1.0"):
        s.set_epoch(1.0)


def test_random_bad_n():
    with pytest.raises(ValueError, match="n must be a non-negative integer, got -3"):
        RandomSampler(-3)


# --- BatchSampler ------------------------------------------------------------

def _batches(bs):
    """One epoch of `bs`, iterated as Gluon 1.9's: each batch a list of ints."""
    out = list(bs)
    for b in out:
        assert type(b) is list and all(type(i) is int for i in b), b
    return out


def test_batch_keep():
    bs = BatchSampler(SequentialSampler(10), 3, "keep")
    assert len(bs) == 4
    assert _batches(bs) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]


def test_batch_default_is_keep():
    assert BatchSampler(SequentialSampler(5), 2).last_batch == "keep"


def test_batch_discard():
    bs = BatchSampler(SequentialSampler(10), 3, "discard")
    assert len(bs) == 3
    assert _batches(bs) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]


def test_batch_exact_multiple_same_for_all_modes():
    for mode in ("keep", "discard", "rollover"):
        bs = BatchSampler(SequentialSampler(9), 3, mode)
        assert len(bs) == 3
        assert _batches(bs) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]


def test_batch_rollover_three_epochs():
    bs = BatchSampler(SequentialSampler(10), 4, "rollover")
    assert len(bs) == 2                       # (0 + 10) // 4
    e0 = _batches(bs)
    assert e0 == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert len(bs) == 3                       # (2 + 10) // 4
    e1 = _batches(bs)
    assert e1[0][:2] == [8, 9]                # carried remainder comes first
    assert e1 == [[8, 9, 0, 1], [2, 3, 4, 5], [6, 7, 8, 9]]
    assert len(bs) == 2                       # (0 + 10) // 4
    e2 = _batches(bs)
    assert e2 == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert len(bs) == 3


def test_batch_rollover_random_every_index_appears():
    n, size = 23, 5
    bs = BatchSampler(RandomSampler(n, seed=3), size, "rollover")
    epochs = []
    for _ in range(3):
        expected_len = len(bs)
        batches = _batches(bs)
        assert len(batches) == expected_len
        assert all(len(b) == size for b in batches)
        epochs.append([i for b in batches for i in b])
    # 3 * 23 = 69 indices; 65 delivered, the last 4 are still carried.
    delivered = [i for e in epochs for i in e]
    assert len(delivered) == 65
    assert set(delivered) == set(range(n))
    # Carried remainder of epoch 0 is the tail of epoch 0's permutation and
    # leads epoch 1.
    perm0 = np.random.default_rng([3, 0]).permutation(n).tolist()
    assert epochs[0] == perm0[:20]
    assert epochs[1][:3] == perm0[20:]
    counts = np.bincount(delivered, minlength=n)
    assert counts.min() >= 2 and counts.max() <= 3


@pytest.mark.parametrize("mode", ["keep", "discard", "rollover"])
@pytest.mark.parametrize("n,size", [(0, 3), (1, 3), (7, 3), (9, 3), (10, 1), (5, 8)])
def test_batch_len_matches_yielded(mode, n, size):
    bs = BatchSampler(RandomSampler(n, seed=0), size, mode)
    for _ in range(4):
        expected = len(bs)
        assert len(list(bs)) == expected


def test_batch_epoch_indices_and_batches():
    bs = BatchSampler(SequentialSampler(7), 3, "discard")
    flat = bs.epoch_indices()
    assert flat.dtype == np.int64 and flat.tolist() == [0, 1, 2, 3, 4, 5]
    batches = bs.epoch_batches()
    assert [b.tolist() for b in batches] == [[0, 1, 2], [3, 4, 5]]


def test_batch_with_plain_list_sampler():
    bs = BatchSampler([5, 3, 1, 0, 2], 2, "keep")
    assert len(bs) == 3
    assert _batches(bs) == [[5, 3], [1, 0], [2]]
    # A list is re-iterable, so every epoch is the same.
    assert _batches(bs) == [[5, 3], [1, 0], [2]]


def test_batch_with_custom_iterable_sampler():
    class Reverse:
        def __init__(self, n):
            self.n = n

        def __iter__(self):
            return iter(range(self.n - 1, -1, -1))

        def __len__(self):
            return self.n

    bs = BatchSampler(Reverse(5), 2, "rollover")
    assert len(bs) == 2
    assert _batches(bs) == [[4, 3], [2, 1]]
    assert len(bs) == 3
    assert _batches(bs) == [[0, 4], [3, 2], [1, 0]]


def test_batch_with_numpy_array_sampler():
    bs = BatchSampler(np.array([2, 0, 1]), 2)
    assert _batches(bs) == [[2, 0], [1]]


def test_batch_custom_sampler_float_indices_rejected():
    with pytest.raises(TypeError):
        list(BatchSampler([0.5, 1.0], 1))


@pytest.mark.parametrize("bad", [0, -2, 1.5, "4", None, True])
def test_batch_bad_batch_size(bad):
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        BatchSampler(SequentialSampler(4), bad)


@pytest.mark.parametrize("bad", ["drop", "KEEP", None, 1])
def test_batch_bad_last_batch(bad):
    with pytest.raises(ValueError, match="last_batch must be one of") as info:
        BatchSampler(SequentialSampler(4), 2, bad)
    msg = str(info.value)
    assert repr(bad) in msg
    for mode in ("'keep'", "'discard'", "'rollover'"):
        assert mode in msg


def test_batch_sampler_none():
    with pytest.raises(ValueError, match="sampler must not be None"):
        BatchSampler(None, 2)


# --- DistributedSampler ------------------------------------------------------

def _shards(n, R, **kw):
    return [DistributedSampler(n, num_replicas=R, rank=r, **kw).epoch_indices().tolist()
            for r in range(R)]


@pytest.mark.parametrize("n,R", [(10, 3), (10, 4), (12, 4), (3, 4), (1, 3), (0, 2)])
def test_distributed_no_drop_equal_counts_and_covers(n, R):
    shards = _shards(n, R, seed=1)
    per_rank = -(-n // R)
    assert all(len(s) == per_rank for s in shards)
    assert all(len(DistributedSampler(n, R, r)) == per_rank for r in range(R))
    assert set(i for s in shards for i in s) == set(range(n))


@pytest.mark.parametrize("n,R", [(10, 3), (10, 4), (12, 4), (3, 4)])
def test_distributed_drop_last_disjoint(n, R):
    shards = _shards(n, R, seed=1, drop_last=True)
    assert all(len(s) == n // R for s in shards)
    flat = [i for s in shards for i in s]
    assert len(flat) == len(set(flat)) == (n // R) * R
    assert len(DistributedSampler(n, R, 0, drop_last=True)) == n // R


def test_distributed_pytorch_layout():
    # Reconstruct the padded, interleaved layout PyTorch uses.
    n, R = 10, 4
    perm = np.random.default_rng([9, 0]).permutation(n).tolist()
    padded = perm + perm[:2]
    assert _shards(n, R, seed=9) == [padded[r::R] for r in range(R)]
    assert _shards(n, R, seed=9, drop_last=True) == [perm[:8][r::R] for r in range(R)]


def test_distributed_padding_longer_than_dataset():
    # 2 samples over 5 ranks: padding repeats the dataset cyclically.
    assert _shards(2, 5, shuffle=False) == [[0], [1], [0], [1], [0]]


def test_distributed_no_shuffle():
    assert _shards(7, 3, shuffle=False) == [[0, 3, 6], [1, 4, 0], [2, 5, 1]]


def test_distributed_same_permutation_across_ranks():
    n, R = 40, 4
    samplers = [DistributedSampler(n, R, r, seed=11) for r in range(R)]
    for epoch in range(2):
        shards = [s.epoch_indices() for s in samplers]
        merged = np.empty(n, dtype=np.int64)
        for r, s in enumerate(shards):
            merged[r::R] = s
        np.testing.assert_array_equal(merged, np.random.default_rng([11, epoch]).permutation(n))


def test_distributed_set_epoch_reshuffles():
    s = DistributedSampler(50, 2, 0, seed=0)
    s.set_epoch(0)
    e0 = s.epoch_indices().tolist()
    s.set_epoch(1)
    e1 = s.epoch_indices().tolist()
    assert e0 != e1
    s.set_epoch(0)
    assert s.epoch_indices().tolist() == e0
    # Without set_epoch the epoch still advances.
    assert s.epoch == 1
    assert list(s) == e1


def test_distributed_seed_changes_order():
    assert _shards(50, 2, seed=0) != _shards(50, 2, seed=1)


def test_distributed_env_defaults(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "2")
    s = DistributedSampler(10)
    assert (s.num_replicas, s.rank) == (4, 2)
    assert len(s) == 3
    # Explicit arguments win over the environment.
    s = DistributedSampler(10, num_replicas=2, rank=1)
    assert (s.num_replicas, s.rank) == (2, 1)


def test_distributed_env_unset(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    s = DistributedSampler(5, shuffle=False)
    assert (s.num_replicas, s.rank) == (1, 0)
    assert list(s) == [0, 1, 2, 3, 4]


def test_distributed_bad_env(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "abc")
    with pytest.raises(ValueError, match="RANK='abc' is not an integer"):
        DistributedSampler(10)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="WORLD_SIZE='two' is not an integer"):
        DistributedSampler(10)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(ValueError, match=r"rank \(from RANK\) must be in \[0, 2\).*got rank=2"):
        DistributedSampler(10)
    monkeypatch.setenv("WORLD_SIZE", "0")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match=r"num_replicas \(from WORLD_SIZE\) must be >= 1, got 0"):
        DistributedSampler(10)


@pytest.mark.parametrize("R,r,pattern", [
    (0, 0, "num_replicas must be >= 1, got 0"),
    (-1, 0, "num_replicas must be >= 1, got -1"),
    (2, -1, r"rank must be in \[0, 2\).*got rank=-1"),
    (3, 3, r"rank must be in \[0, 3\).*got rank=3"),
    (2.0, 0, "num_replicas must be an integer, got 2.0"),
    (2, "1", "rank must be an integer, got '1'"),
])
def test_distributed_bad_args(R, r, pattern):
    with pytest.raises(ValueError, match=pattern):
        DistributedSampler(10, num_replicas=R, rank=r)


def test_distributed_bad_seed_and_n():
    with pytest.raises(ValueError, match="seed must be a non-negative integer, got -1"):
        DistributedSampler(10, 1, 0, seed=-1)
    with pytest.raises(ValueError, match="n must be a non-negative integer, got -5"):
        DistributedSampler(-5, 1, 0)


def test_distributed_inside_batch_sampler():
    s = DistributedSampler(10, num_replicas=2, rank=1, shuffle=False)
    bs = BatchSampler(s, 2, "keep")
    assert len(bs) == 3
    assert list(bs) == [[1, 3], [5, 7], [9]]
