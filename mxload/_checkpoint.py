"""Checkpointable iterator state: which batches of an epoch were taken.

A loader's state is small and JSON-serialisable: the loader seed, the epoch
number, the sampler's state *at the start of that epoch* (it regenerates the
epoch's exact batches, rollover carry included), the dataset's own
state_dict() if it has one, and the set of batch indices already yielded
(a prefix count plus any out-of-order extras).  Resuming draws the same
batches again and never dispatches the taken ones (a sampler without a
state, an infinite one included, is replayed to where the stream got); an
IterableDataset is replayed from the epoch start and its first batches are
dropped.
"""
from __future__ import annotations

import copy
from typing import Any, Protocol

from ._runtime.progress import EpochProgress
from ._torch_compat import generator_state, set_generator_state, shuffle_generator
from .sampler import load_sampler_state, sampler_state


class LoaderView(Protocol):
    """What a loader's checkpoints read of it (dataloader.DataLoader, which imports this module:
    so it is named by what it offers).  Nothing here sets anything on the loader: what a loaded
    state changes, the loader applies itself."""

    @property
    def dataset(self) -> Any: ...

    @property
    def sampler(self) -> Any: ...

    @property
    def _index_sampler(self) -> Any: ...   # torch's name: the batch sampler, else the sampler

    @property
    def iterable(self) -> bool: ...

    @property
    def epoch(self) -> int: ...

    @property
    def seed(self) -> int: ...   # drawn when read, if torch's is still to come

STATE_VERSION = 1


def epoch_state(progress: EpochProgress, seed: int) -> dict[str, Any]:
    """The checkpoint of `progress`'s epoch under the run's `seed` (state_dict()'s format)."""
    prefix, extra = progress.done()
    state = {"version": STATE_VERSION, "seed": seed, "epoch": progress.epoch,
             "sampler": copy.deepcopy(progress.sampler_state),
             "dataset": copy.deepcopy(progress.dataset_state),
             "done": {"prefix": prefix, "extra": extra}}
    if progress.torch_rng is not None:
        state["torch_rng"] = progress.torch_rng
    if progress.datapipe_seed is not None:
        state["datapipe_seed"] = progress.datapipe_seed
    return state


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
    if _check_count(state["epoch"], "epoch") >= 2**63:   # the core counts epochs in an int64
        raise bad_field("epoch", state["epoch"], "an int >= 0 and < 2**63")
    for optional in ("batches", "samples"):   # (states of mxload before they were written lack them)
        if state.get(optional) is not None:
            _check_count(state[optional], optional)
    if state["sampler"] is not None and not isinstance(state["sampler"], dict):
        raise bad_field("sampler", state["sampler"], "a dict or None")
    if "datapipe_seed" in state and (type(state["datapipe_seed"]) is not int
                                     or not -2**63 <= state["datapipe_seed"] < 2**63):
        raise bad_field("datapipe_seed", state["datapipe_seed"], "an int64 (an IterDataPipe's shared seed)")
    if "torch_rng" in state and not isinstance(state["torch_rng"], str):
        raise bad_field("torch_rng", state["torch_rng"], "a torch.Generator state as text")
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
        self._torch_rng: str | None = None

    def before_draws(self, loader: LoaderView) -> None:
        """An iter() begins, before it draws from torch's RNGs (its base seed, then a torch
        RandomSampler's order): the state of the generator that order comes from is what fixes
        it, recorded here for the epoch's checkpoints (torch's samplers have no state of their
        own), and set back to the checkpoint's when resuming: the resumed iter() then draws
        what the checkpointed one drew."""
        generator = shuffle_generator(loader.sampler)
        if generator is None:
            self._torch_rng = None
            return
        resume = self.resume
        if resume is not None and resume.get("torch_rng") is not None:
            set_generator_state(generator, resume["torch_rng"])
        self._torch_rng = generator_state(generator)

    def epoch_starting(self, loader: LoaderView) -> EpochProgress:
        """The progress of the epoch about to start; call before the sampler advances."""
        resume, self.resume = self.resume, None
        if self.progress is not None:
            # The last epoch's last batch, if the loop got it and asked no more (its rollover
            # leftovers go on to this epoch only once counted; NOTE [ Signal-safe hand-over ]).
            self.progress.settle()
        state = None if loader.iterable else sampler_state(loader._index_sampler)
        progress = EpochProgress(loader.epoch, state, _dataset_state(loader.dataset),
                                 resume["done"] if resume is not None else None, self._torch_rng)
        # A rollover batch sampler passes its leftovers on only when the epoch
        # is consumed to its end (Gluon's counts after an abandoned epoch).
        progress.on_complete = getattr(loader._index_sampler, "end_epoch", None)
        self.progress = progress
        return progress

    def state(self, loader: LoaderView, redrawn: bool = False) -> dict[str, Any]:
        """The loader's position; `redrawn`: the epoch auto_reload drew ahead is stale (the
        sampler changed since) and the next iter() draws it again, under its epoch number,
        from the sampler as it is now."""
        seed = loader.seed   # drawn now if torch's is still to come: the state must fix it
        if self.resume is not None:
            return copy.deepcopy(self.resume)
        progress = self.progress
        if redrawn or progress is None or progress.complete:
            if progress is not None and not redrawn:
                # Its last batch reached the loop, which asked no more: counted at the next
                # call, but its rollover leftovers belong to the next epoch's state now.
                progress._completed()
            generator = None if redrawn else shuffle_generator(loader.sampler)
            progress = EpochProgress(loader.epoch - 1 if redrawn else loader.epoch,
                                     None if loader.iterable else sampler_state(loader._index_sampler),
                                     _dataset_state(loader.dataset),
                                     torch_rng=None if generator is None else generator_state(generator))
        state = epoch_state(progress, seed)
        # What the position means: a loader with another batch size, dataset length or
        # number of replicas would read it as other samples (checked by load()).
        batches = progress.total if progress.total is not None else _length(loader._index_sampler)
        samples = None if loader.iterable else _length(loader.dataset)
        if batches is not None and not loader.iterable:
            state["batches"] = batches
        if samples is not None:
            state["samples"] = samples
        return state

    def load(self, loader: LoaderView, given: Any) -> dict[str, Any]:
        """Check `state` as a whole and load the sampler's and the dataset's parts (nothing
        changes if any part is wrong); returns the checked state, for the loader to end what
        belongs to the old position, take the state's seed and epoch, and hand the state to
        resume_from() so that its next iter() resumes it."""
        # A copy: the caller may change its dict afterwards (checked now, used at the next iter()).
        state = check_state(copy.deepcopy(given))
        load = getattr(loader.dataset, "load_state_dict", None)
        if state.get("dataset") is not None and load is None:
            raise ValueError(f"the state carries dataset state but {type(loader.dataset).__name__} "
                             f"has no load_state_dict()")

        def load_dataset() -> None:   # the dataset's own check: it may refuse its part
            if state.get("dataset") is not None:
                assert load is not None
                load(state["dataset"])
        if not loader.iterable:
            # The sampler checks its own entry; the position must lie in the
            # epoch that entry makes.
            before = sampler_state(loader._index_sampler)
            try:
                load_sampler_state(loader._index_sampler, state["sampler"])
                samples = _length(loader.dataset)
                if state.get("samples") is not None and samples is not None and samples != state["samples"]:
                    raise ValueError(f"the loader state was written for a dataset of {state['samples']} "
                                     f"samples; this loader's has {samples}: load it into a loader over "
                                     f"the same dataset")
                batches = _length(loader._index_sampler)   # None: a user batch sampler without len()
                if batches is not None:
                    if state.get("batches") is not None and batches != state["batches"]:
                        raise ValueError(
                            f"the loader state was written for an epoch of {state['batches']} batches; "
                            f"this loader makes {batches} of the same epoch: its batch_size, drop_last "
                            f"(last_batch) or number of replicas (distributed) differ from the loader "
                            f"that wrote it, so its position would name other samples")
                    check_position(state, batches)
                load_dataset()
            except BaseException:
                load_sampler_state(loader._index_sampler, before)
                raise
        else:
            load_dataset()
        return state

    def resume_from(self, state: dict[str, Any]) -> None:
        """The next iter() resumes `state` (checked by load())."""
        self.progress = None
        self.resume = state


def _length(obj: Any) -> int | None:
    """len(obj), or None where it has none (or refuses, as an IterableDataset may)."""
    try:
        return len(obj)
    except TypeError:
        return None


def _dataset_state(dataset: Any) -> Any:
    get = getattr(dataset, "state_dict", None)
    return get() if callable(get) else None
