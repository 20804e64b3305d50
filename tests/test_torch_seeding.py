"""mxload.torch.DataLoader gives torch's DataLoader's batches bit for bit with
random augmentation drawn in the workers (torch's RNG, ``random``, numpy's
global RNG), for the same num_workers: torch's base seed (drawn at each
``iter()``, once with persistent workers), worker k seeded with ``base_seed + k``
as torch's worker loop seeds it, persistent workers continuing their streams,
batch i loaded by worker i % num_workers; and the training process's RNGs are
left as torch's loader leaves them (the user's next draw is the same).

Each test runs the same script with torch's loader and with mxload's and
compares a hash of every tensor of every batch."""
from __future__ import annotations

import hashlib
import random

import numpy as np
import pytest
from extras import deferred

torch = deferred("torch")
tud = deferred("torch.utils.data")
mxtorch = deferred("mxload.torch")
cases = deferred("torch_seeding_cases")

pytestmark = [pytest.mark.torch, pytest.mark.timeout(120)]


def digest(batch) -> list[str]:
    """A hash of every tensor of the batch (dtype, shape and bytes)."""
    tensors = batch if isinstance(batch, (list, tuple)) else [batch]
    out = []
    for t in tensors:
        assert isinstance(t, torch.Tensor), type(t)
        out.append(hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode() + t.numpy().tobytes()).hexdigest())
    return out


def rng_states() -> tuple[str, str, str]:
    """The training process's RNGs: torch's, Python's, numpy's global."""
    np_state = np.random.get_state()
    return (hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest(),
            hashlib.sha256(repr(random.getstate()).encode()).hexdigest(),
            hashlib.sha256(np_state[1].tobytes() + repr(np_state[2:]).encode()).hexdigest())


def script(loader_class, epochs, dataset=None, sampler=None, generator=None, **kwargs):
    """A training script's use of its loader: seed, build the loader, draw
    the model's initialisation, run the epochs (each followed by a draw, as
    dropout would), and report every batch and the RNGs' states at the end."""
    torch.manual_seed(1234)
    random.seed(5)
    np.random.seed(6)
    g = torch.Generator().manual_seed(77) if generator else None
    if sampler == "torch":   # torch's own RandomSampler, given as sampler= (draws at its first next())
        sampler = tud.RandomSampler(range(cases.N), generator=g)
        g = None
    loader = loader_class(dataset if dataset is not None else cases.AugmentedImages(), batch_size=4,
                          sampler=sampler, generator=g, **kwargs)
    model_init = torch.rand(3)
    epochs_out, draws = [], [model_init]
    for _ in range(epochs):
        epochs_out.append([digest(b) for b in loader])
        draws.append(torch.rand(2))
    if hasattr(loader, "close") and loader_class is mxtorch.DataLoader:
        loader.close()
    return epochs_out, [d.tolist() for d in draws], rng_states()


def assert_same_as_torch(epochs, **kwargs):
    theirs = script(tud.DataLoader, epochs, **kwargs)
    ours = script(mxtorch.DataLoader, epochs, **kwargs)
    for e, (t, o) in enumerate(zip(theirs[0], ours[0])):
        same = [i for i, (a, b) in enumerate(zip(t, o)) if a == b]
        assert t == o, (f"epoch {e}: {len(t)} batches from torch, {len(o)} from mxload; "
                        f"equal: {same}")
    assert theirs[1] == ours[1], "the training process's torch draws differ from those with torch's loader"
    assert theirs[2] == ours[2], "the training process's RNG states (torch, random, numpy) differ"
    return ours


ORDERS = ["sequential", "torch_sampler", "torch_sampler_generator"]


# Each order with 0 and 2 workers, and 1 and 3 workers with one order each: the order (and the
# base seed's draw beside it) is the training process's, whatever the count of workers; the
# count decides the seeds and which worker loads which batch.  Every order with every count
# started ~4 s of worker processes more and went through no other code.
@pytest.mark.parametrize("num_workers,order", [(w, o) for w in (0, 2) for o in ORDERS]
                         + [(1, "torch_sampler_generator"), (3, "torch_sampler")])
def test_batches_bit_for_bit_as_torch(num_workers, order):
    sampler = None if order == "sequential" else "torch"
    ours = assert_same_as_torch(2, sampler=sampler, generator=order.endswith("generator"),
                                num_workers=num_workers)
    if num_workers:
        assert ours[0][0] != ours[0][1], "each iter() draws a new base seed: the epochs differ"


@pytest.mark.parametrize("num_workers,generator", [(0, False), (0, True), (2, False), (2, True), (3, False)])
def test_shuffled_batches_bit_for_bit_as_torch(num_workers, generator):
    assert_same_as_torch(2, shuffle=True, generator=generator, num_workers=num_workers)


@pytest.mark.parametrize("num_workers,order", [(1, "sequential"), (2, "torch_sampler"), (3, "sequential"),
                                               (2, "torch_sampler_generator")])
def test_persistent_workers_continue_their_streams_as_torch(num_workers, order):
    sampler = None if order == "sequential" else "torch"
    ours = assert_same_as_torch(3, sampler=sampler, generator=order.endswith("generator"),
                                num_workers=num_workers, persistent_workers=True)
    assert len({tuple(map(tuple, e)) for e in ours[0]}) == 3, "the streams go on: 3 different epochs"


@pytest.mark.parametrize("persistent", [False, True])
def test_persistent_shuffled_as_torch(persistent):
    assert_same_as_torch(3, shuffle=True, num_workers=2, persistent_workers=persistent)


def test_uneven_stream_shards_interleave_as_torch():
    """An IterableDataset whose workers' streams end apart: after a worker's
    end, torch's round-robin goes on from the next worker, not from batch
    index % the workers left.  (One epoch each: a second draws a new base seed, which
    test_batches_bit_for_bit_as_torch compares.)"""
    for num_workers in (2, 3, 4):
        assert_same_as_torch(1, dataset=cases.UnevenShards(), num_workers=num_workers)


@pytest.mark.parametrize("num_workers,persistent", [(1, False), (2, False), (3, False), (2, True)])
def test_per_sample_seeding_gives_the_same_batches_for_any_num_workers(num_workers, persistent):
    """The opt-in (seeding="per_sample"): torch's, Python's and numpy's global RNGs seeded from
    (seed, epoch, sample index) before each sample, so torchvision-style transforms give the same
    batches with 0 or N workers; in-process, the training loop's RNGs are left as torch's loader
    leaves them."""
    def images_and_labels(**kwargs):
        epochs, draws, states = script(mxtorch.DataLoader, 2, seeding="per_sample", **kwargs)
        return [[b[:2] for b in e] for e in epochs], draws, states
    in_process = images_and_labels(num_workers=0)
    with_workers = images_and_labels(num_workers=num_workers, persistent_workers=persistent)
    assert with_workers[0] == in_process[0]
    assert in_process[0][0] != in_process[0][1]   # each epoch draws anew
    # The loop's own draws and RNG states are as with workers (which never touch them): only
    # what torch's iter() draws (a base seed each, not again for persistent workers), not the
    # samples' draws (torch's loader, in-process, makes them from the loop's RNGs).
    if not persistent:
        assert in_process[1:] == with_workers[1:], "in-process per-sample seeding changed the loop's RNGs"


def test_seeding_torch_needs_torch():
    from fresh_python import run
    result = run("""
        try:
            mxload.DataLoader(list(range(4)), seeding="torch")
        except ValueError as e:
            print(e)
    """)
    assert ("seeding='torch' seeds the workers as torch's DataLoader does, and this program has not "
            "imported torch") in result.stdout, result.stdout + result.stderr


def test_thread_workers_leave_the_global_rngs_to_the_training_loop():
    """thread_pool=True in seeding="torch": the threads share the training process's RNGs, which
    stay as torch's loader leaves them (only the base seed is drawn); each worker's info says
    base_seed + id, as a torch worker's would."""
    torch.manual_seed(3)
    base = int(torch.empty((), dtype=torch.int64).random_().item())   # what iter() draws first
    after_torch = torch.rand(2)
    torch.manual_seed(3)
    loader = mxtorch.DataLoader(cases.WhoSeeded(), batch_size=2, num_workers=2, thread_pool=True)
    rows = torch.cat(list(loader))
    assert torch.equal(torch.rand(2), after_torch)
    assert {(int(w), int(s)) for w, s in rows.tolist()} == {(0, base), (1, base + 1)}
