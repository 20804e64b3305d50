"""The samples of one batch: the same code in the calling thread
(num_workers=0), in worker threads and in worker processes."""
from __future__ import annotations

import functools
import operator
from typing import Any

import numpy as np

from .. import _rng
from .._collate.rows import RowsOfColumns, TensorColumns, fetches_columns
from .._keys import decode_key
from .._torch_compat import seed_datapipe
from ..dataset import takes_index_arrays

__all__ = ["SampleSource", "fetch_samples"]

def fetch_key(dataset: Any, words: np.ndarray, seed: int = 0, epoch: int = 0,
              seed_globals: bool = False) -> list[Any]:
    """batch_size=None: the one sample of `words`' key, ``dataset[key]`` as
    torch's fetcher does without auto-batching (never __getitems__).
    `seed_globals` (seeding="per_sample"): the global RNGs are seeded from
    (seed, epoch, key) first (a key that is not an int: from its indices' words)."""
    key = decode_key(words)
    try:
        _rng.set_sample(seed, epoch, key if isinstance(key, int) else None)
        if seed_globals:
            _rng.seed_globals(seed, epoch, *words.tolist())   # an int key is one word, itself
        return [dataset[key]]
    finally:
        _rng.clear_sample()


def fetch_samples(dataset: Any, indices: np.ndarray, seed: int = 0, epoch: int = 0,
                  seed_globals: bool = False, gather_tensors: bool = True) -> Any:
    """The samples of one batch: one ``__getitems__`` call where the dataset
    offers it (torch 2.x protocol: a list of Python ints, as torch passes it; an
    SQLite dataset binding a numpy int64 would match no row; mxload's own
    datasets that gather with numpy, ``takes_index_arrays``, get the int64
    array itself), else one ``__getitem__`` per index.
    Each call runs inside its sample_rng() context (seed, epoch, index);
    `seed_globals` (seeding="per_sample"): the global RNGs are seeded from
    (seed, epoch, index) before each ``__getitem__``, from (seed, epoch,
    every index) before ``__getitems__``.  `gather_tensors`: a torch ``TensorDataset``'s batch may
    be gathered a tensor at a time (TensorColumns); False where it goes to a function that wants
    the rows (plan.collates_itself), which then come from ``dataset[i]`` straight away."""
    getitems = getattr(dataset, "__getitems__", None)
    try:
        if getitems is not None:
            _rng.set_sample(seed, epoch, None)
            if seed_globals:
                _rng.seed_globals(seed, epoch, *indices.tolist())
            if takes_index_arrays(dataset):
                return getitems(indices)
            if fetches_columns(dataset):   # Hugging Face's: its batch of columns, unsplit
                return RowsOfColumns.fetch(dataset, indices.tolist())
            return getitems(indices.tolist())
        if gather_tensors and not seed_globals:   # (per-sample seeding runs before each dataset[i])
            gathered = TensorColumns.fetch(dataset, indices)   # torch's TensorDataset
            if gathered is not None:
                return gathered
        # dataset[i] exactly (the type's __getitem__), called from C
        return _rng.fetch_each(functools.partial(operator.getitem, dataset), indices.tolist(), seed, epoch,
                               seed_globals)
    finally:
        _rng.clear_sample()


class _Stream:
    """Batches drawn from an IterableDataset (this worker's shard)."""

    def __init__(self, dataset: Any, batch_size: int, drop_last: bool):
        self._it = iter(dataset)
        self._batch_size = batch_size
        self._drop_last = drop_last
        self.exhausted = False

    def next_samples(self) -> list[Any] | None:
        if self.exhausted:
            return None
        samples = []
        for sample in self._it:
            samples.append(sample)
            if len(samples) == self._batch_size:
                return samples
        self.exhausted = True
        if not samples or (self._drop_last and len(samples) < self._batch_size):
            return None
        return samples


class SampleSource:
    """Where batches come from: indices into a map-style dataset, or, for an
    IterableDataset, this worker's stream (restarted each epoch).

    Args:
        dataset: the user's dataset (this worker's copy).
        iterable: it is an IterableDataset (a stream).
        batch_size: samples per batch of a stream.
        drop_last: a stream's incomplete last batch is dropped.
        seed: the loader's seed (sample_rng contexts).
        keyed: batch_size=None on a map-style dataset: each batch is one
            sampler key (encode_key), fetched as ``dataset[key]``.
        seeding: the loader's (_options.SEEDINGS); "per_sample" seeds the
            global RNGs before each sample (fetch_samples).
        restore: put the global RNGs' states back after each batch (the
            training process's own, with num_workers=0 and "per_sample").
        gather_tensors: a torch ``TensorDataset``'s batch may be gathered (fetch_samples);
            False where the batchify function wants rows (plan.collates_itself).
    """

    def __init__(self, dataset: Any, iterable: bool, batch_size: int, drop_last: bool, seed: int,
                 keyed: bool = False, seeding: str = "per_worker", restore: bool = False,
                 gather_tensors: bool = True):
        self._seed_globals = seeding == "per_sample" and not iterable
        self._gather_tensors = gather_tensors
        self._restore = restore and self._seed_globals
        self._dataset = dataset
        self._keyed = keyed and not iterable
        self._iterable = iterable
        self._batch_size = batch_size
        self._drop_last = drop_last
        self._seed = seed
        self._stream: _Stream | None = None
        self._stream_epoch: int | None = None

    def samples(self, epoch: int, indices: np.ndarray | None) -> Any:
        """The samples of one batch, or None when this worker's stream is done."""
        if not self._iterable:
            assert indices is not None, "a map-style dataset's batch has indices"
            states = _rng.global_states() if self._restore else None
            try:
                if self._keyed:
                    return fetch_key(self._dataset, indices, self._seed, epoch, self._seed_globals)
                return fetch_samples(self._dataset, indices, self._seed, epoch, self._seed_globals,
                                     self._gather_tensors)
            finally:
                if states is not None:
                    _rng.set_global_states(states)
        if self._stream is None or self._stream_epoch != epoch:
            if indices is not None:   # the epoch's shared seed of a torch IterDataPipe (EpochPlan.stream_key)
                self._dataset = seed_datapipe(self._dataset, int(indices[0]))
            self._stream = _Stream(self._dataset, self._batch_size, self._drop_last)
            self._stream_epoch = epoch
        return self._stream.next_samples()

    def close(self) -> None:
        """Drop the stream's iterator (an abandoned epoch releases it now)."""
        self._stream = None
