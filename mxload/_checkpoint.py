"""Checkpointable iterator state: which batches of an epoch were taken.

A loader's state is small and JSON-serialisable: the loader seed, the epoch
number, the sampler's state *at the start of that epoch* (it regenerates the
epoch's exact batch list, rollover carry included), the dataset's own
state_dict() if it has one, and the set of batch indices already yielded
(a prefix count plus any out-of-order extras).  Resuming rebuilds the same
batch list and never dispatches the taken batches; an IterableDataset is
replayed from the epoch start and its first batches are dropped.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .sampler import load_sampler_state, sampler_state

if TYPE_CHECKING:
    from .dataloader import DataLoader

STATE_VERSION = 1


class EpochProgress:
    """Which batch indices of one epoch the consumer has taken."""

    __slots__ = ("epoch", "sampler_state", "dataset_state", "prefix", "extra", "count", "_finished", "total",
                 "on_complete")

    def __init__(self, epoch: int, sampler_state: Any, dataset_state: Any,
                 done: dict[str, Any] | None = None):
        self.epoch = epoch
        self.sampler_state = sampler_state
        self.dataset_state = dataset_state
        done = done or {}
        self.prefix = int(done.get("prefix", 0))       # batches 0..prefix-1 taken
        self.extra = set(int(i) for i in done.get("extra", ()))
        self.count = self.prefix + len(self.extra)      # batches taken in all
        self._finished = False                          # the epoch ran to its end
        self.total: int | None = None                # batches in the epoch, when known
        # Called once when every batch was taken (e.g. to pass a rollover
        # batch sampler's leftovers on to the next epoch).
        self.on_complete: Any = None

    @property
    def finished(self) -> bool:
        return self._finished

    @finished.setter
    def finished(self, value: bool) -> None:
        self._finished = value
        if value:
            self._completed()

    def _completed(self) -> None:
        hook, self.on_complete = self.on_complete, None
        if hook is not None:
            hook()

    @property
    def complete(self) -> bool:
        """Every batch was taken (even if the iterator has not said so yet)."""
        return self.finished or (self.total is not None and self.count >= self.total)

    def taken(self, idx: int) -> None:
        self.count += 1
        if idx != self.prefix:
            self.extra.add(idx)
        else:
            self.prefix += 1
            while self.prefix in self.extra:
                self.extra.remove(self.prefix)
                self.prefix += 1
        if self.total is not None and self.count >= self.total:
            self._completed()

    def remaining(self, total: int) -> list[int]:
        """The batch indices of a `total`-batch epoch not taken yet, in order
        (and remember `total`)."""
        self.total = total
        if self.count >= total:
            self._completed()   # nothing left (e.g. a rollover epoch too short for one batch)
        return [i for i in range(self.prefix, total) if i not in self.extra]

    def state(self, seed: int) -> dict[str, Any]:
        return {"version": STATE_VERSION, "seed": seed, "epoch": self.epoch,
                "sampler": self.sampler_state, "dataset": self.dataset_state,
                "done": {"prefix": self.prefix, "extra": sorted(self.extra)}}


def check_state(state: Any) -> dict[str, Any]:
    """Validate a state from state_dict() as a whole (the sampler's own entry
    is checked by the sampler): a clear error naming the field for anything
    else, before any of it is used.  A tampered state must never load: a
    negative position would yield batches twice, a negative epoch would kill
    every worker while seeding."""
    if not isinstance(state, dict):
        raise TypeError(f"loader state must be a dict from DataLoader.state_dict(), "
                        f"got {type(state).__name__}")
    version = state.get("version")
    if version != STATE_VERSION or type(version) is not int:
        raise ValueError(f"unsupported loader state version {version!r} (this mxload writes {STATE_VERSION})")
    missing = [k for k in ("seed", "epoch", "sampler", "done") if k not in state]
    if missing:
        raise ValueError(f"loader state lacks {missing}")
    _check_count(state["seed"], "seed")
    _check_count(state["epoch"], "epoch")
    if state["sampler"] is not None and not isinstance(state["sampler"], dict):
        raise bad_field("sampler", state["sampler"], "a dict or None")
    done = state["done"]
    if not isinstance(done, dict):
        raise bad_field("done", done, "a dict with 'prefix' and 'extra'")
    prefix = _check_count(done.get("prefix"), "done.prefix")
    extra = done.get("extra", [])
    if not isinstance(extra, list):
        raise bad_field("done.extra", extra, "a list of batch indices")
    for i in extra:
        if _check_count(i, "done.extra") <= prefix:
            raise bad_field("done.extra", extra, f"batch indices above done.prefix ({prefix}), "
                            f"as state_dict() writes them")
    if len(set(extra)) != len(extra):
        raise bad_field("done.extra", extra, "distinct batch indices")
    return state


def check_position(state: dict[str, Any], batches: int) -> None:
    """The taken batches of a checked `state` lie in an epoch of `batches` batches."""
    done = state["done"]
    if done["prefix"] > batches:
        raise bad_field("done.prefix", done["prefix"], f"at most the epoch's {batches} batches")
    late = [i for i in done.get("extra", []) if i >= batches]
    if late:
        raise bad_field("done.extra", late, f"batch indices below the epoch's {batches} batches")


def _check_count(value: Any, field: str) -> int:
    if type(value) is not int or value < 0:   # (bool is an int: refused too)
        raise bad_field(field, value, "an int >= 0")
    return value


def bad_field(field: str, value: Any, wanted: str) -> ValueError:
    """The error for a state entry that is not what state_dict() writes."""
    return ValueError(f"loader state field {field!r} must be {wanted}, got {value!r}: the state was changed "
                      f"or damaged since state_dict() wrote it; load one that state_dict() returned")


class LoaderPosition:
    """A loader's side of checkpoints: the latest epoch's progress, and a
    state given to load_state_dict() that waits for the next iter()."""

    def __init__(self) -> None:
        self.progress: EpochProgress | None = None
        self.resume: dict[str, Any] | None = None

    def epoch_starting(self, loader: DataLoader[Any]) -> EpochProgress:
        """The progress of the epoch about to start; call before the sampler advances."""
        resume, self.resume = self.resume, None
        state = None if loader.iterable else sampler_state(loader.batch_sampler)
        progress = EpochProgress(loader.epoch, state, _dataset_state(loader.dataset),
                                 resume["done"] if resume is not None else None)
        # A rollover batch sampler passes its leftovers on only when the epoch
        # is consumed to its end (Gluon's counts after an abandoned epoch).
        progress.on_complete = getattr(loader.batch_sampler, "end_epoch", None)
        self.progress = progress
        return progress

    def state(self, loader: DataLoader[Any]) -> dict[str, Any]:
        seed = loader.seed   # drawn now if torch's is still to come: the state must fix it
        if self.resume is not None:
            return dict(self.resume)
        progress = self.progress
        if progress is None or progress.complete:
            progress = EpochProgress(loader.epoch,
                                     None if loader.iterable else sampler_state(loader.batch_sampler),
                                     _dataset_state(loader.dataset))
        return progress.state(seed)

    def load(self, loader: DataLoader[Any], state: Any) -> None:
        """Check `state` as a whole, then make the loader's next iter() resume
        it; nothing changes if any part is wrong."""
        state = check_state(state)
        load = getattr(loader.dataset, "load_state_dict", None)
        if state.get("dataset") is not None and load is None:
            raise ValueError(f"the state carries dataset state but {type(loader.dataset).__name__} "
                             f"has no load_state_dict()")
        if not loader.iterable:
            # The sampler checks its own entry; the position must lie in the
            # epoch that entry makes.
            before = sampler_state(loader.batch_sampler)
            try:
                load_sampler_state(loader.batch_sampler, state["sampler"])
                try:
                    batches = len(loader.batch_sampler)
                except TypeError:
                    pass   # a user batch sampler without len(): its epoch's size is unknown here
                else:
                    check_position(state, batches)
            except BaseException:
                load_sampler_state(loader.batch_sampler, before)
                raise
        loader.close()  # a live epoch or persistent workers belong to the old position
        loader.seed = state["seed"]
        loader.epoch = state["epoch"]
        if state.get("dataset") is not None:
            assert load is not None
            load(state["dataset"])
        self.progress = None
        self.resume = state


def _dataset_state(dataset: Any) -> Any:
    get = getattr(dataset, "state_dict", None)
    return get() if callable(get) else None
