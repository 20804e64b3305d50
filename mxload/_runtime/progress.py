"""Which batches of one epoch the consumer has taken (EpochProgress): what the epoch's
iterator records as it hands batches to the loop, and what a checkpoint of that epoch
(mxload/_checkpoint.py) and a resumed epoch's plan (epoch.py) read.

The record is retry-safe: see NOTE [ Signal-safe hand-over ] (csrc/handoff.pxi)."""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .._core import Handover

__all__ = ["EpochProgress"]


class EpochProgress:
    """Which batch indices of one epoch the consumer has taken.

    Retry-safe: the iterator's thread updates it where a signal handler may
    raise between any two bytecodes.  A batch counts from the moment it is
    added to `extra` (one C call); moving it into `prefix` afterwards may be
    cut short at any point and leaves `extra` holding indices below
    `prefix`, which every reader ignores.  Taking a batch twice counts it once."""

    __slots__ = ("epoch", "sampler_state", "dataset_state", "torch_rng", "prefix", "extra", "_finished",
                 "supply", "_on_complete", "handover", "datapipe_seed")

    def __init__(self, epoch: int, sampler_state: Any, dataset_state: Any,
                 done: dict[str, Any] | None = None, torch_rng: str | None = None):
        self.epoch = epoch
        self.sampler_state = sampler_state
        self.dataset_state = dataset_state
        self.torch_rng = torch_rng   # see LoaderPosition.before_draws
        # A torch IterDataPipe's shared seed of the epoch (RunSeed.datapipe_epoch_starts): what
        # fixes its shuffled stream, which a resumed epoch replays.
        self.datapipe_seed: int | None = None
        done = done or {}
        self.prefix = int(done.get("prefix", 0))       # batches 0..prefix-1 taken
        self.extra = set(int(i) for i in done.get("extra", ()))   # and these (those < prefix: stale)
        self._finished = False                          # the epoch ran to its end
        # The epoch's batches as they are drawn (_runtime: a BatchSupply); None: a stream.
        self.supply: Any = None
        # Called once when every batch was taken (e.g. to pass a rollover
        # batch sampler's leftovers on to the next epoch): popped by one C
        # call, so two threads that see the epoch complete call it once.
        self._on_complete: list[Callable[[], Any]] = []
        # The epoch's hand-over (_core.Handover, set as the epoch starts): the batch it handed to
        # the loop (`pending`) counts as taken here before it is settled; one it still holds
        # (`ready`: a signal handler's exception cut its way short) does not.  See
        # NOTE [ Signal-safe hand-over ] (csrc/handoff.pxi).
        self.handover: Handover | None = None

    @property
    def total(self) -> int | None:
        """The batches in the epoch, once known (drawn to its end, or known before)."""
        supply = self.supply
        return supply.total if supply is not None else None

    @property
    def finished(self) -> bool:
        return self._finished

    @finished.setter
    def finished(self, value: bool) -> None:
        self._finished = value
        if value:
            self._completed()

    @property
    def on_complete(self) -> Callable[[], Any] | None:
        return self._on_complete[0] if self._on_complete else None

    @on_complete.setter
    def on_complete(self, hook: Callable[[], Any] | None) -> None:
        self._on_complete = [] if hook is None else [hook]

    def _completed(self) -> None:
        try:
            hook = self._on_complete.pop()
        except IndexError:
            return   # called already
        hook()

    def done(self) -> tuple[int, list[int]]:
        """(prefix, the other taken indices, sorted), the pending batch
        included if the loop has it: what a checkpoint records."""
        prefix = self.prefix
        extra = {i for i in list(self.extra) if i >= prefix}
        delivered = self._delivered()
        if delivered is not None:
            extra.add(delivered)
        while prefix in extra:
            extra.remove(prefix)
            prefix += 1
        return prefix, sorted(extra)

    @property
    def count(self) -> int:
        """Batches taken in all (the pending one only once settled)."""
        prefix = self.prefix
        return prefix + sum(1 for i in list(self.extra) if i >= prefix)

    @property
    def complete(self) -> bool:
        """Every batch was taken (even if the iterator has not said so yet)."""
        return self.finished or (self.total is not None and
                                 self.count + (self._delivered() is not None) >= self.total)

    def _delivered(self) -> int | None:
        """The batch the hand-over gave the loop and did not settle yet, if not counted."""
        handover = self.handover
        idx = handover.pending if handover is not None else -1
        if idx < 0 or idx < self.prefix or idx in self.extra:
            return None
        return idx

    def settle(self) -> None:
        """Count the batch the hand-over gave the loop (Handover.settle).  The
        iterator's own thread, or once it is over: readers from other threads
        use _delivered(), which changes nothing."""
        if self.handover is not None:
            self.handover.settle()

    def taken(self, idx: int) -> None:
        """Count batch `idx` taken (again: nothing changes).  Handover.settle calls it once a
        batch, in the training loop's thread."""
        extra = self.extra
        if idx == self.prefix and not extra:
            self.prefix = idx + 1   # (the batches in order: counted by this one store)
        else:
            if idx < self.prefix or idx in extra:
                return
            extra.add(idx)   # counted from here on
            while self.prefix in extra:
                self.prefix += 1   # (cut short here: prefix - 1 stays in extra, ignored)
                extra.discard(self.prefix - 1)
        supply = self.supply   # (its compiled field, not the property: this runs once a batch)
        total = supply.total if supply is not None else None
        # (prefix + len(extra) bounds the count from above: the count's walk only near the end)
        if total is not None and self.prefix + len(self.extra) >= total and self.count >= total:
            self._completed()

    def drawn_by(self, supply: Any) -> None:
        """The epoch's batches are drawn by `supply` (it knows their count once it is known)."""
        self.supply = supply
        total = supply.total
        if total is not None and self.count >= total:
            self._completed()   # nothing left (e.g. a rollover epoch too short for one batch)

    def taken_before(self) -> tuple[int, set[int]]:
        """The batches taken before this epoch (resumed) began: every one below the first of
        them, and those above it."""
        prefix = self.prefix
        return prefix, {i for i in self.extra if i >= prefix}
