"""The torch-facing DataLoader: ``from mxload.torch import DataLoader`` in
place of ``from torch.utils.data import DataLoader`` and nothing else changes:
batches are torch tensors, as torch's DataLoader gives them.

The tensors share the memory of mxload's batches (``torch.from_numpy``, no
copy: the shared-memory slab stays alive as long as a tensor does).
``mxload.DataLoader`` itself hands out numpy arrays and never imports torch;
this module is for programs that use torch anyway, and imports it.
"""
from __future__ import annotations

import importlib
from typing import TypeVar

from .dataloader import DataLoader as _NumpyDataLoader

importlib.import_module("torch")   # fail here, clearly, if torch is missing

__all__ = ["DataLoader"]

_T_co = TypeVar("_T_co", covariant=True)


class DataLoader(_NumpyDataLoader[_T_co]):
    """:class:`mxload.DataLoader` whose batches are torch tensors (zero-copy
    views of its numpy batches): the same arguments, torch's types out.

    Args:
        *args: :class:`mxload.DataLoader`'s positional arguments.
        **kwargs: its keyword arguments (all of torch's DataLoader's).

    Example:
        >>> import torch
        >>> from torch.utils.data import TensorDataset
        >>> from mxload.torch import DataLoader
        >>> x, y = next(iter(DataLoader(TensorDataset(torch.zeros(4, 2), torch.arange(4)), batch_size=4)))
        >>> type(x).__name__, x.shape, y.tolist()
        ('Tensor', torch.Size([4, 2]), [0, 1, 2, 3])
    """

    _as_tensors = True
    _torch_switches = True
