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

from collections.abc import Iterator, Sequence
from typing import Any

__all__ = ["RowsOfColumns", "fetches_columns"]

# (module, qualified name) of the __getitems__ that RowsOfColumns.fetch reproduces.
_COLUMNAR_GETITEMS = (("datasets.arrow_dataset", "Dataset.__getitems__"),)


def fetches_columns(dataset: Any) -> bool:
    """Whether `dataset`'s ``__getitems__`` is one RowsOfColumns.fetch reproduces (a Hugging
    Face ``datasets.Dataset``'s own, not a subclass's override).  Never imports the library."""
    getitems = getattr(type(dataset), "__getitems__", None)
    name = (getattr(getitems, "__module__", None), getattr(getitems, "__qualname__", None))
    return name in _COLUMNAR_GETITEMS


class RowsOfColumns(Sequence[Any]):
    """Reads as the list of row dicts the dataset's ``__getitems__`` returns; holds the dict of
    columns (`batch`) it splits them from.  A function that is not one of mxload's planned
    batchify functions (a user's ``collate_fn``) gets that list itself (:meth:`rows`)."""

    __slots__ = ("batch", "n", "_rows")

    def __init__(self, batch: dict[Any, Any], n: int):
        self.batch = batch
        self.n = n
        self._rows: list[Any] | None = None

    @classmethod
    def fetch(cls, dataset: Any, keys: list[int]) -> RowsOfColumns | list[Any]:
        """What ``dataset.__getitems__(keys)`` returns, fetched as its code does (the same
        calls, so the same values and the same exceptions), its rows left unsplit."""
        batch = dataset.__getitem__(keys)
        n = len(batch[next(iter(batch))])
        if type(batch) is not dict:
            return [{col: array[i] for col, array in batch.items()} for i in range(n)]
        return cls(batch, n)

    def rows(self) -> list[Any]:
        """The list of row dicts, as the dataset's own ``__getitems__`` builds it."""
        if self._rows is None:
            self._rows = [{col: array[i] for col, array in self.batch.items()} for i in range(self.n)]
        return self._rows

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: Any) -> Any:
        return self.rows()[i]

    def __iter__(self) -> Iterator[Any]:
        return iter(self.rows())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (list, RowsOfColumns)):
            return self.rows() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"RowsOfColumns({self.rows()!r})"
