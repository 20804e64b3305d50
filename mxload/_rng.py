"""Per-sample random streams: ``mxload.sample_rng()``.

A dataset that draws its random augmentations from ``sample_rng()`` gets the
same numbers for the same (loader seed, epoch, sample index) whichever worker,
process, thread or start method loads the sample: the batch stream is then
bit-identical for any ``num_workers``.  The loader sets the context around
every ``__getitem__`` call (in workers and in-process); the generator is made
on first use, so datasets that never ask pay one attribute store per sample.
"""
from __future__ import annotations

import functools
import random
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from ._core import SampleContext

__all__ = ["sample_rng", "derived_seed"]

# current: the SampleContext of the sample loading (None between loads); rngs: the generators
# made during the load `rngs_for` ((context, its load count): a new load starts new streams).
_context = threading.local()


def derived_seed(*keys: int) -> int:
    """A 63-bit seed that follows from `keys` (integers; a negative one, such as a sample index
    -1, as its 64-bit two's complement): the same keys give the same seed on every platform,
    different keys unrelated ones."""
    state = np.random.SeedSequence([k % 2 ** 64 for k in keys]).generate_state(1, np.uint64)
    return int(state[0]) % (2 ** 63)


def seed_globals(*keys: int) -> None:
    """seeding="per_sample": seed Python's ``random``, numpy's global RNG and (when the program
    imported it) torch's CPU generator from `keys` (seed, epoch, sample index), before that
    sample loads (about 25 us in all)."""
    seed = derived_seed(*keys)
    random.seed(seed)
    np.random.seed([seed & 0xFFFFFFFF, seed >> 32])
    torch = sys.modules.get("torch")
    if torch is not None:
        # The CPU generator, where transforms draw: torch.manual_seed() also seeds every
        # accelerator's (117 us a call here, against 1.5 us).
        torch.default_generator.manual_seed(seed)


def global_states() -> tuple[Any, ...]:
    """The states of the RNGs seed_globals seeds (to put back the training process's)."""
    torch = sys.modules.get("torch")
    return random.getstate(), np.random.get_state(), torch.get_rng_state() if torch is not None else None


def set_global_states(states: tuple[Any, ...]) -> None:
    python, numpy, torch_state = states
    random.setstate(python)
    np.random.set_state(numpy)
    if torch_state is not None:
        sys.modules["torch"].set_rng_state(torch_state)


def set_sample(seed: int, epoch: int, index: int | None) -> None:
    """The loader is about to load sample `index` of `epoch` (None: a whole
    batch through __getitems__)."""
    _context.current = SampleContext(seed, epoch, index)


def clear_sample() -> None:
    _context.current = None
    _context.rngs = {}
    _context.rngs_for = None


def fetch_each(getitem: Callable[[int], Any], indices: list[int], seed: int, epoch: int,
               seed_each: bool = False) -> list[Any]:
    """[getitem(i) for i in indices], each inside its sample's context (the loop is compiled:
    SampleContext.fetch_each, two C stores a sample beyond torch's list comprehension);
    `seed_each` (seeding="per_sample"): seed_globals(seed, epoch, i) first."""
    context = _context.current = SampleContext(seed, epoch)
    seeding = functools.partial(seed_globals, seed, epoch) if seed_each else None
    return context.fetch_each(getitem, indices, seeding)


@contextmanager
def sample_scope(index: int) -> Iterator[None]:
    """Inside a batch fetch, narrow the context to one sample (if a loader set one)."""
    current = getattr(_context, "current", None)
    if current is None:
        yield
        return
    saved = (current, getattr(_context, "rngs", {}), getattr(_context, "rngs_for", None))
    _context.current = SampleContext(current.seed, current.epoch, int(index))
    try:
        yield
    finally:   # the enclosing load's streams go on where they were
        _context.current, _context.rngs, _context.rngs_for = saved


def sample_rng(index: int | None = None) -> np.random.Generator:
    """A ``numpy.random.Generator`` seeded from (loader seed, epoch, sample index).

    Call it inside ``__getitem__`` or a transform: repeated calls while the
    same sample loads continue one stream.  Inside ``__getitems__`` (a whole
    batch) pass the sample's index explicitly.  Random augmentation drawn from
    it is the same for any ``num_workers``, processes or threads, any start
    method, and after resuming from a checkpoint.

    Args:
        index (int | None): the sample's index; required inside
            ``__getitems__``, optional (the sample being loaded) elsewhere.

    Returns:
        numpy.random.Generator: the sample's random stream.

    Raises:
        RuntimeError: called outside a loader's ``__getitem__``,
            ``__getitems__`` or transform.

    Example:
        >>> import numpy as np, mxload
        >>> class Noisy(mxload.Dataset):
        ...     def __len__(self):
        ...         return 4
        ...     def __getitem__(self, i):
        ...         return mxload.sample_rng().random()
        >>> a = list(mxload.DataLoader(Noisy(), batch_size=2, seed=3))
        >>> b = list(mxload.DataLoader(Noisy(), batch_size=2, seed=3, num_workers=2))
        >>> all(np.array_equal(x, y) for x, y in zip(a, b))
        True
    """
    context = getattr(_context, "current", None)
    if context is None:
        raise RuntimeError("mxload.sample_rng() is only valid while a DataLoader loads a sample "
                           "(inside __getitem__, __getitems__ or a transform)")
    seed, epoch = context.seed, context.epoch
    if index is None:
        if context.index is None:
            raise RuntimeError("inside __getitems__, call mxload.sample_rng(index) with the sample's index")
        index = context.index
    index = int(index)
    load = (context, context.load)
    if getattr(_context, "rngs_for", None) != load:   # the first draw of this load
        _context.rngs = {}
        _context.rngs_for = load
    rng: np.random.Generator | None = _context.rngs.get(index)
    if rng is None:
        rng = _context.rngs[index] = np.random.default_rng([seed, epoch, index])
    return rng
