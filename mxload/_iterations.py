"""A DataLoader's epochs in progress: the live iterators (the newest is the
one persistent workers serve), the persistent workers' engine, the latest
engine's counters (``loader.stats``) and, with ``auto_reload``, the epoch
already loading ahead of its ``iter()``.  ``close()`` ends all of them."""
from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ._collate.plan import ReusedBuffers
from ._cpus import usable_cores
from ._runtime.autotune import AutoTuner
from ._runtime.engine import Engine
from .sampler import load_sampler_state, sampler_state

if TYPE_CHECKING:
    from ._options import LoaderOptions
    from ._runtime.epoch import EpochIterator


class Iterations:
    def __init__(self, options: LoaderOptions) -> None:
        self.engine: Engine | None = None          # persistent workers' engine
        # max_worker_restarts is a budget per loader: every epoch's engine spends from this one.
        self.restarts = {"worker_restarts": 0}
        # The private buffers of the batches it collates in this process (no workers), reused
        # from epoch to epoch: a new epoch's first batches fault no fresh pages in.
        self.buffers = ReusedBuffers()
        # num_workers="auto": picks the workers and window of every epoch (its counters join stats).
        self.tuner = AutoTuner(options.workers.num_workers, usable_cores(), options.workers.auto_window,
                               options.workers.prefetch) if options.workers.autotune else None
        # The latest engine's (Engine.counters), and the tuner's.
        self.counters: list[dict[str, int]] = [self.tuner.counts] if self.tuner is not None else []

        self._newest: weakref.ref[EpochIterator] | None = None
        # Plain weak references, not a WeakSet: a WeakSet's callback would run
        # Python code as an iterator dies, after its finalizer, where a
        # Ctrl-C the finalizer made pending again would be swallowed.
        self._live: list[weakref.ref[EpochIterator]] = []
        self.ahead: Any = None                     # auto_reload: the next epoch, already loading
        # The batch sampler as it was before and after that epoch was drawn (sampler_marks).
        self._ahead_marks: tuple[Any, Any] | None = None

    def use_engine(self, engine: Engine, persistent: bool) -> None:
        """The engine of the epoch starting: its counters are the loader's; persistent workers' is kept."""
        self.counters = engine.counters() + ([self.tuner.counts] if self.tuner is not None else [])
        if persistent:
            self.engine = engine

    def newest(self) -> Any:
        return self._newest() if self._newest is not None else None

    def started(self, it: EpochIterator) -> None:
        self._newest = weakref.ref(it)
        self._live = [ref for ref in self._live if ref() is not None] + [self._newest]

    # ------------------------------------------------------------ auto_reload

    def load_ahead(self, start: Callable[[], Any], batch_sampler: Any, iterable: bool) -> None:
        """Start the next epoch now (`start`), noting the sampler before and after its batches were drawn."""
        before = sampler_marks(batch_sampler, iterable)
        self.ahead = start()
        self._ahead_marks = (before, sampler_marks(batch_sampler, iterable))

    def ahead_is_stale(self, batch_sampler: Any, iterable: bool) -> bool:
        """The epoch loaded ahead will be dropped by the next iter() (see take_ahead)."""
        marks = self._ahead_marks
        return (self.ahead is not None and marks is not None and not iterable
                and not _still_valid(batch_sampler, *marks))

    def take_ahead(self, batch_sampler: Any, iterable: bool) -> tuple[Any, bool]:
        """(the epoch loaded ahead or None, whether one was dropped).  It is
        dropped (closed) unless it is the one iter() would draw now: the
        sampler was changed since (set_epoch(e) before the loop, as
        documented), so that epoch was drawn too early."""
        ahead, self.ahead = self.ahead, None
        marks, self._ahead_marks = self._ahead_marks, None
        if ahead is None:
            return None, False
        if marks is None or iterable or _still_valid(batch_sampler, *marks):
            return ahead, False
        ahead.close()
        return None, True

    # ------------------------------------------------------------ ending

    def close(self) -> None:
        """End every live iteration, the epoch loaded ahead and persistent workers."""
        ahead, self.ahead = self.ahead, None
        if ahead is not None:
            ahead.close()
        for ref in self._live:
            it = ref()
            if it is not None:
                it.close()
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.shutdown()

    def loader_collected(self) -> None:
        """The loader was freed.  A live epoch may outlive it (`for b in
        DataLoader(...)`): let it finish, then end the persistent workers
        with it; else end them now.  The loader's last reference is often
        the newest iterator's own (`it = iter(DataLoader(...))`, `del it`):
        then this runs inside that iterator's finalizer, which already ended
        its epoch, so the workers end here, not at a garbage collection."""
        if self.engine is None:
            return
        it = self.newest()
        if it is None or not it.release_engine_at_end(self.engine):
            self.engine.shutdown()


def sampler_marks(batch_sampler: Any, iterable: bool) -> Any:
    """What set_epoch() changes: the batch sampler's state_dict() and the
    `epoch` of it and its sampler (torch's DistributedSampler has no state_dict)."""
    if iterable:
        return None
    inner = getattr(batch_sampler, "sampler", None)
    return (sampler_state(batch_sampler), getattr(batch_sampler, "epoch", None),
            getattr(inner, "epoch", None))


def _still_valid(batch_sampler: Any, before: Any, after: Any) -> bool:
    """Whether the epoch drawn ahead is the one iter() would draw now: the
    sampler is as the draw left it, or as it was before the draw (set_epoch(e)
    with the epoch the draw used: put back as the draw left it)."""
    now = sampler_marks(batch_sampler, False)
    try:
        if now == after:
            return True
        if now != before:
            return False
    except (TypeError, ValueError):   # states that do not compare (arrays): as before, keep it
        return True
    if after[0] is not None:
        load_sampler_state(batch_sampler, after[0])
    inner: Any = getattr(batch_sampler, "sampler", None)
    for obj, epoch in ((batch_sampler, after[1]), (inner, after[2])):
        if epoch is not None and getattr(obj, "epoch", None) is not None:
            obj.epoch = epoch
    return True
