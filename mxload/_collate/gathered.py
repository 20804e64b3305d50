"""GatheredSamples: a batch's samples as the columns a dataset fetched them
from, so collation can gather each column in one go.

It lives beside the planner rather than in :mod:`mxload.dataset` (which
makes them, in ``ArrayDataset.__getitems__``) or :mod:`mxload.batchify`
(whose default function recognises them) because it is the contract between
the two: a dataset hands over (sources, indices), collation plans them as
"take" fields.  Keeping it in neither public module means dataset.py needs
nothing of the batchify functions; users still import it as
``mxload.batchify.GatheredSamples``, where it is documented.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from .layout import Node
from .plan import Planner, gather_columns
from .rows import SamplesLater

__all__ = ["GatheredSamples"]


class GatheredSamples(SamplesLater):
    """Samples fetched by a vectorised ``__getitems__`` (see ArrayDataset).

    Behaves as the list of samples, but default collation sees the source
    arrays and the indices instead: each column is gathered once, straight
    into the batch buffer (``np.take(..., out=)``), with no per-sample
    Python and no intermediate copy.  Return one from your own
    ``__getitems__`` over in-memory numpy columns.

    Args:
        sources (Sequence[numpy.ndarray]): the columns, indexed along axis 0.
        indices (numpy.ndarray): the batch's validated 1-D int64 indices.
        single (bool): samples are bare elements of ``sources[0]``, not tuples.

    Example:
        >>> import numpy as np
        >>> from mxload.batchify import GatheredSamples, default_batchify
        >>> samples = GatheredSamples([np.arange(10) * 2], np.array([3, 1]), single=True)
        >>> [int(s) for s in samples], default_batchify(samples).tolist()
        ([6, 2], [6, 2])
    """

    __slots__ = ("sources", "indices", "single", "_columns", "_samples")

    def __init__(self, sources: Sequence[Any], indices: NDArray[np.int64], single: bool):
        self.sources = tuple(sources)     # numpy arrays, indexed along axis 0
        self.indices = indices            # validated, 1-D int64
        self.single = single              # samples are bare elements, not tuples
        self._columns: tuple[Any, ...] | None = None
        self._samples: list[Any] | None = None

    @property
    def columns(self) -> tuple[Any, ...]:
        if self._columns is None:
            self._columns = tuple(a[self.indices] for a in self.sources)
        return self._columns

    def rows(self) -> list[Any]:
        """The samples, as ``dataset[i]`` gives each."""
        if self._samples is None:
            if self.single:
                self._samples = list(self.columns[0])
            else:
                self._samples = list(zip(*self.columns))
        return self._samples

    def __len__(self) -> int:
        return len(self.indices)

    def plan_columns(self, path: str, planner: Planner, tuples: type | None = None) -> Node | None:
        """Plan the columns as gathers (a sample's fields collated into a tuple, or into
        `tuples`), or None if one is not plainly numeric."""
        return gather_columns(planner, self.sources, self.indices, self.single, path, tuples)
