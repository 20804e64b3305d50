"""RowsOfColumns: the rows a dataset's ``__getitems__`` returns, kept as the dict of columns
it fetched them from.

Hugging Face ``datasets.Dataset.__getitems__`` (datasets 2.x-5.x) is ``batch =
self.__getitem__(keys)`` split into one dict per row, ``{col: column[i]}``; collating those rows
stacks each column back.  The worker fetches such a dataset's batch as its code does and keeps
it unsplit: default collation (mxload.batchify) copies a tensor column once, the rows' stack
bit for bit, which saves the split, the per-row views and the stack (a quarter of such a batch's
time), and anything else that asks for the samples gets the very list the dataset builds.
"""
from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from typing import Any

from .. import _torch_compat as _torch

__all__ = ["RowsOfColumns", "SamplesLater", "TensorColumns", "fetches_columns"]

# (module, qualified name) of the __getitems__ that RowsOfColumns.fetch reproduces, and of the
# __getitem__ that gives a contiguous run of rows for a slice exactly as for the list of them.
_COLUMNAR_GETITEMS = (("datasets.arrow_dataset", "Dataset.__getitems__"),)
_SLICING_GETITEM = (("datasets.arrow_dataset", "Dataset.__getitem__"),)
# The _getitem that _gather_in_one_chunk reproduces, and what it reads of the dataset and of
# datasets.formatting (datasets 2.x-5.x).
_GATHERING_GETITEM = (("datasets.arrow_dataset", "Dataset._getitem"),)
_FORMAT_STATE = ("_format_type", "_format_kwargs", "_format_columns", "_output_all_columns", "_info", "_data",
                 "_indices")
_FORMATTING = ("get_formatter", "query_table", "format_table")


def _is_one_of(function: Any, names: tuple[tuple[str, str], ...]) -> bool:
    return (getattr(function, "__module__", None), getattr(function, "__qualname__", None)) in names


def fetches_columns(dataset: Any) -> bool:
    """Whether `dataset`'s ``__getitems__`` is one RowsOfColumns.fetch reproduces (a Hugging
    Face ``datasets.Dataset``'s own, not a subclass's override).  Never imports the library."""
    return _is_one_of(getattr(type(dataset), "__getitems__", None), _COLUMNAR_GETITEMS)


def _fetch_rows(dataset: Any, keys: list[int]) -> Any:
    """``dataset.__getitem__(keys)``, where the dataset's own ``__getitem__`` is Hugging Face's,
    asked for the cheapest way to the same rows: a contiguous run as its slice, a gather formatted
    in one chunk (_gather_in_one_chunk); any other ``__getitem__`` gets the list itself."""
    if _is_one_of(getattr(type(dataset), "__getitem__", None), _SLICING_GETITEM):
        run = _same_rows_as_slice(dataset, keys)
        batch = dataset.__getitem__(run) if run is not None else _gather_in_one_chunk(dataset, keys)
        if batch is not None:
            return batch
    return dataset.__getitem__(keys)


def _same_rows_as_slice(dataset: Any, keys: list[int]) -> slice | None:
    """`keys` as a slice where they are a contiguous ascending run of valid row numbers (Hugging
    Face's ``__getitem__`` gives the same rows through the same formatting for both, with or
    without an indices mapping): an unshuffled batch of 256 rows then costs 0.5 ms instead of
    2.8 (a slice of the Arrow table against a gather of each row).  None otherwise."""
    n = len(keys)
    if n < 2 or keys[0] < 0 or keys[-1] - keys[0] != n - 1:
        return None
    if keys[-1] >= len(dataset) or keys != list(range(keys[0], keys[-1] + 1)):
        return None   # out of range: the list's IndexError, where a slice would stop short
    return slice(keys[0], keys[-1] + 1)


def _gather_in_one_chunk(dataset: Any, keys: list[int]) -> Any:
    """``dataset.__getitem__(keys)`` computed as datasets' own ``Dataset._getitem`` computes it,
    with one step added: the gathered rows' Arrow table is made one chunk before it is formatted.
    datasets gathers a list of rows as one chunk per row, and its formatter converts a column
    chunk by chunk before joining them (a batch of 256 shuffled rows of 64 floats: 2.2-4.7 ms,
    against 0.9-2.1 ms in one chunk); the values and their order are the same either way, and
    so are the formatted tensors (checked bit for bit in tests/test_columnar_fetch.py).  For a
    dataset whose ``__getitem__`` is datasets' own; None where its ``_getitem`` is not, or
    datasets lacks what this reads: the caller then asks the dataset itself."""
    if not _is_one_of(getattr(type(dataset), "_getitem", None), _GATHERING_GETITEM):
        return None
    formatting = sys.modules.get("datasets.formatting")
    if (formatting is None or not all(hasattr(formatting, name) for name in _FORMATTING)
            or not all(hasattr(dataset, name) for name in _FORMAT_STATE)):
        return None
    kwargs = dataset._format_kwargs if dataset._format_kwargs is not None else {}
    formatter = formatting.get_formatter(dataset._format_type, features=dataset._info.features, **kwargs)
    table = formatting.query_table(dataset._data, keys, indices=dataset._indices)
    if table.num_rows > 1:
        table = table.combine_chunks()
    return formatting.format_table(table, keys, formatter=formatter, format_columns=dataset._format_columns,
                                   output_all_columns=dataset._output_all_columns)


class SamplesLater(Sequence[Any]):
    """A batch's samples that a dataset handed over in another form (columns), read as the
    list :meth:`rows` makes on first need; equal to a list of the same samples, unhashable as
    a list.  Subclasses: RowsOfColumns, and GatheredSamples (gathered.py)."""

    __slots__ = ()

    def rows(self) -> list[Any]:
        raise NotImplementedError

    def __getitem__(self, i: Any) -> Any:
        return self.rows()[i]

    def __iter__(self) -> Iterator[Any]:
        return iter(self.rows())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (list, type(self))):
            return self.rows() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.rows()!r})"


class RowsOfColumns(SamplesLater):
    """Reads as the list of row dicts the dataset's ``__getitems__`` returns; holds the dict of
    columns (`batch`) it splits them from.  A function that is not one of mxload's planned
    batchify functions (a user's ``collate_fn``) gets that list itself (:meth:`rows`)."""

    __slots__ = ("batch", "n", "_rows")

    def __init__(self, batch: Any, n: int):
        self.batch = batch
        self.n = n
        self._rows: list[Any] | None = None

    @classmethod
    def fetch(cls, dataset: Any, keys: list[int]) -> RowsOfColumns | list[Any]:
        """What ``dataset.__getitems__(keys)`` returns, fetched as its code does (the same
        calls, so the same values and the same exceptions), its rows left unsplit."""
        batch = _fetch_rows(dataset, keys)
        kept = cls(batch, len(batch[next(iter(batch))]))
        return kept if type(batch) is dict else kept.rows()   # only a dict's columns are planned

    def rows(self) -> list[Any]:
        """The list of row dicts, as the dataset's own ``__getitems__`` builds it."""
        if self._rows is None:
            self._rows = [{col: array[i] for col, array in self.batch.items()} for i in range(self.n)]
        return self._rows

    def __len__(self) -> int:
        return self.n


class TensorColumns(SamplesLater):
    """Reads as the list of rows a torch ``TensorDataset`` gives, ``dataset[i]`` for each index;
    holds each of its tensors' rows at the batch's indices, gathered in one go (`columns`,
    _torch_compat.gather_tensor_dataset): the default collation hands them out (in the training
    process) or copies each once (in a worker), instead of a ``__getitem__`` per index and a
    stack per field (a batch of 256 rows of two tensors: 1 ms of Python for 30 us of gather).
    A function that is not one of mxload's planned batchify functions (a user's ``collate_fn``)
    gets the rows themselves (:meth:`rows`)."""

    __slots__ = ("columns", "_dataset", "_indices", "_rows")

    def __init__(self, columns: tuple[Any, ...], dataset: Any, indices: Any):
        self.columns = columns
        self._dataset = dataset
        self._indices = indices
        self._rows: list[Any] | None = None

    @classmethod
    def fetch(cls, dataset: Any, indices: Any) -> TensorColumns | None:
        """The batch's rows gathered, or None where the dataset is to be asked per index."""
        columns = _torch.gather_tensor_dataset(dataset, indices)
        return cls(columns, dataset, indices) if columns is not None else None

    def rows(self) -> list[Any]:
        """The list of row tuples, each ``dataset[i]`` (as torch's fetcher makes it)."""
        if self._rows is None:
            self._rows = [self._dataset[i] for i in self._indices.tolist()]
        return self._rows

    def __len__(self) -> int:
        return len(self._indices)
