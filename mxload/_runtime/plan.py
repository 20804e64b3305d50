"""Which batches an epoch delivers (EpochPlan): resumed or not, the batch sampler drawn as the
batches are needed (a BatchSupply, csrc/supply.pxi).  The epoch (epoch.py) makes one, and the
engine or the in-process producer delivers it."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .._core import BatchSupply
from ..errors import EpochAbortedError
from .os_signals import raised_by_signal_handler
from .progress import EpochProgress

if TYPE_CHECKING:
    from ..sampler import EpochBatches

__all__ = ["EpochPlan"]


@dataclass(frozen=True)
class EpochPlan:
    """Which batches an epoch delivers.

    Args:
        supply: the batches to deliver, drawn from the batch sampler as they
            are needed; a resumed epoch leaves out those already taken
            (None: an IterableDataset's stream).
        discard: stream batches to drop first (a resumed stream is replayed
            from its start; these were taken before the checkpoint).
        stream_key: what a stream's tasks carry as their indices (None: nothing): a torch
            IterDataPipe's shared seed of the epoch, which each worker applies to its copy
            of the graph before its stream starts (source.py).
    """
    supply: BatchSupply | None
    discard: int = 0
    stream_key: np.ndarray | None = None

    @classmethod
    def of(cls, draw: Callable[[int], EpochBatches] | None, progress: EpochProgress,
           epoch: int, stream_key: np.ndarray | None = None) -> EpochPlan:
        """The plan of epoch `epoch`, whose batches `draw(start)` begins to draw from batch
        `start` on (None: a stream), given what `progress` (fresh, or loaded from a
        state_dict) says was taken."""
        if draw is None:
            return cls(None, progress.count, stream_key)
        start, skip = progress.taken_before()
        drawn = draw(start)
        supply = BatchSupply(drawn.batches, start, skip, drawn.total, drawn.expected, drawn.what, epoch,
                             EpochAbortedError, raised_by_signal_handler)
        progress.drawn_by(supply)
        return cls(supply, 0)
