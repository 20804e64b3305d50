"""LoaderOptions: every DataLoader argument, checked once, as one frozen value.

``DataLoader.__init__`` hands its arguments as given to
:meth:`LoaderOptions.from_arguments`, then builds the batch sampler from the
result; the runtime reads the loader's settings from its LoaderOptions and
from nothing else.  Every argument check lives here.  They run in a fixed
order (argument kinds first, then conflicts between arguments, then ranges)
and the first problem found is the one reported, so a call with several
mistakes always names the same one.

Integers are checked by :func:`mxload._checks.check_int` (one rule and one
message style for every integer argument of the package).
"""
from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from multiprocessing import context as mp_context
from typing import Any, cast

import numpy as np

from ._checks import check_bool, check_int
from ._torch_compat import (
    apply_datapipe_shuffle,
    is_iter_datapipe,
    is_torch_iterable_dataset,
    seed_from_torch,
    torch_module,
)
from .backends import Backend, RayBackend, resolve_backend
from .batchify import (
    _Unbatched,
    default_batchify,
    default_convert,
    torch_default_collate,
    torch_default_convert,
)
from .dataset import IterableDataset

__all__ = ["LoaderOptions", "START_METHODS", "SEEDINGS", "MAX_AUTO_WORKERS", "is_iterable_dataset"]

START_METHODS = ("fork", "spawn", "forkserver")
# num_workers="auto" tunes up to this many workers (never more than the usable cores).
MAX_AUTO_WORKERS = 16

# The seeding= values: how the workers' global RNGs (random, numpy's, torch's) are seeded.
#   "torch": as torch's DataLoader: worker k of an iteration gets base_seed + k (numpy: torch's
#            state from (base_seed, k)); a new base seed at each iter(), persistent workers go on.
#   "per_worker": from (seed, epoch, worker id), reseeded at every epoch (mxload.DataLoader's).
#   "per_sample": every sample's load seeds them from (seed, epoch, sample index): the same
#            batches for any num_workers (in-process, the training process's states are restored).
SEEDINGS = ("torch", "per_worker", "per_sample")

_POSITIONAL_ORDER = ("dataset, batch_size, shuffle, sampler, last_batch, batch_sampler, batchify_fn, "
                     "num_workers, pin_memory, pin_device_id, prefetch, thread_pool, timeout")


@dataclasses.dataclass(frozen=True)
class BatchingOptions:
    """Which samples make each batch, and what collates them: the batching arguments, resolved."""

    batch_size: int | None                        # as given; None: a batch_sampler, or no batching
    shuffle: bool
    sampler: Any                                  # the user's sampler, or None
    batch_sampler: Any                            # the user's batch sampler, or None
    last_batch: str                               # "keep" | "discard" | "rollover"
    batchify_fn: Callable[..., Any]               # what collates (wrapped when auto_batching is False)
    distributed: bool

    @property
    def drop_last(self) -> bool:
        """Whether an incomplete last batch is dropped (torch's name)."""
        return self.last_batch == "discard"


@dataclasses.dataclass(frozen=True)
class WorkerOptions:
    """Who loads the batches, and how: the worker arguments, resolved."""

    num_workers: int                              # with autotune: the most it may use
    prefetch: int                                 # batches in flight across all workers
    thread_pool: bool
    timeout: float | None                         # seconds; None waits forever
    worker_init_fn: Callable[[int], None] | None
    start_method: str | None                      # None: the platform's default
    persistent_workers: bool
    in_order: bool
    max_worker_restarts: int
    backend: Backend | None                       # None: local processes (or threads)
    autotune: bool = False                        # num_workers="auto" (_runtime/autotune/)
    auto_window: bool = False                     # prefetch="auto" (or not given with "auto" workers)


@dataclasses.dataclass(frozen=True)
class SeedOptions:
    """The run's seeds: how its samplers and the workers' global RNGs are seeded."""

    seed: int                                     # the run's seed (given, drawn from torch, or fresh)
    # How workers' global RNGs are seeded (SEEDINGS); "torch": from `base_seed`, the base seed
    # of the iteration whose workers start next (drawn at each iter(), once for persistent workers).
    seeding: str
    base_seed: int
    distributed_seed: int                         # the shuffle seed every rank shares: never a fresh one
    generator: Any                                # torch.Generator or None


@dataclasses.dataclass(frozen=True)
class TorchViews:
    """torch's read-only views: its attributes' values as torch's DataLoader holds them.  The
    runtime reads the resolved values instead (batching.batchify_fn, workers.prefetch,
    workers.start_method)."""

    collate_fn: Callable[..., Any]                # the function, unwrapped
    prefetch_factor: int | None                   # per worker; None without workers
    multiprocessing_context: str | mp_context.BaseContext | None   # as given


@dataclasses.dataclass(frozen=True)
class Derived:
    """What follows from the arguments, given by no one."""

    iterable: bool                                # iterable-style (the dataset decides the order)
    auto_batching: bool                           # False: batch_size=None, each sample is one "batch"
    fetch_batch_size: int                         # samples a stream groups into a batch (0: none)
    # Not given: drawn from torch (`generator`, or torch's global RNG) when torch's DataLoader
    # draws its base seed, at iter() (then the seed is 0 until drawn).
    torch_seeded: bool


@dataclasses.dataclass(frozen=True)
class LoaderOptions:
    """A DataLoader's settings after every check: what the runtime runs on.

    The DataLoader's arguments, grouped (torch's aliases resolved, so ``collate_fn`` is in
    `batching.batchify_fn`, ``drop_last`` in `batching.last_batch`, ``multiprocessing_context``
    in `workers.start_method`, ``prefetch_factor`` in `workers.prefetch`), torch's views of them
    as torch holds them (`torch`), and what follows from them (`derived`).  Build it with
    :meth:`from_arguments`; :meth:`changed` makes a changed copy without checking (what a
    DataLoader attribute set after construction does, as torch allows for all but its frozen
    ones); :meth:`value` reads a DataLoader attribute's value by its name.
    """

    dataset: Any                                  # the user's dataset: any object
    batching: BatchingOptions
    workers: WorkerOptions
    seeds: SeedOptions
    torch: TorchViews
    derived: Derived
    profile: bool
    pin_memory: bool
    pin_device_id: int
    pin_memory_device: str
    auto_reload: bool
    try_nopython: bool | None
    torch_face: bool = False                      # mxload.torch's: arguments taken as torch takes them

    def value(self, name: str) -> Any:
        """The value of the field `name`, in whichever group it is."""
        group = _GROUP_OF.get(name)
        return getattr(self if group is None else getattr(self, group), name)

    def replaced(self, **changes: Any) -> LoaderOptions:
        """dataclasses.replace by field names, in whichever group each is (not checked)."""
        top: dict[str, Any] = {}
        grouped: dict[str, dict[str, Any]] = {}
        for name, value in changes.items():
            group = _GROUP_OF.get(name)
            if group is None:
                top[name] = value
            else:
                grouped.setdefault(group, {})[name] = value
        for group, values in grouped.items():
            top[group] = dataclasses.replace(getattr(self, group), **values)
        return dataclasses.replace(self, **top)

    def changed(self, field: str, value: Any) -> LoaderOptions:
        """A copy with `field` set as a DataLoader attribute after construction (torch allows it for
        all but its frozen attributes), not checked again, as torch does not check it either, but in
        the form the runtime reads: collate_fn is what collates (torch's default collate functions
        are the native ones in mxload.torch), a timeout of 0 waits forever, a multiprocessing
        context decides the start method."""
        changes: dict[str, Any] = {field: value}
        if field in ("collate_fn", "batchify_fn"):
            fn = _native_collate(value, self.torch_face)
            changes = {"collate_fn": fn, "batchify_fn": fn if self.derived.auto_batching else _Unbatched(fn)}
        elif field == "timeout" and value == 0:
            changes[field] = None
        elif field == "multiprocessing_context":
            changes["start_method"] = None if value is None else _start_method_of(value)
        return self.replaced(**changes)

    @property
    def own_sampler(self) -> bool:
        """The loader makes the sampler, over range(len(dataset)): it follows len(dataset) (as
        torch's default samplers read it at every len() and iter()), so a dataset may grow
        between epochs."""
        batching = self.batching
        return (batching.sampler is None and batching.batch_sampler is None and not self.derived.iterable
                and not batching.distributed)

    @classmethod
    def from_arguments(
            cls, dataset: Any, batch_size: int | None = 1, shuffle: bool | None = False, sampler: Any = None,
            last_batch: str | None = None, batch_sampler: Any = None,
            batchify_fn: Callable[..., Any] | None = None, num_workers: int | str = 0,
            pin_memory: bool = False, pin_device_id: int = 0, prefetch: int | str | None = None,
            thread_pool: bool = False,
            timeout: float | None = 120, auto_reload: bool = False, *,
            collate_fn: Callable[..., Any] | None = None, drop_last: bool | None = None,
            worker_init_fn: Callable[[int], None] | None = None, multiprocessing_context: Any = None,
            generator: Any = None, prefetch_factor: int | None = None, persistent_workers: bool = False,
            pin_memory_device: str = "", in_order: bool = True, seed: int | None = None,
            start_method: str | None = None, max_worker_restarts: int = 0, profile: bool = False,
            distributed: bool = False, try_nopython: bool | None = None,
            backend: Any = None, seeding: str | None = None, torch_switches: bool = False,
            default_seeding: str = "per_worker") -> LoaderOptions:
        """Check DataLoader's arguments (its signature and defaults) and resolve them.

        Raises ValueError or TypeError naming the argument, what it allows
        and what it got, as documented on :class:`mxload.DataLoader`.
        `torch_switches`: the arguments are taken as torch takes them (mxload.torch): the switches
        any truthy value, torch's default collate functions as mxload's own.
        `default_seeding`: the face's seeding when `seeding` is None.
        """
        _check_switches(torch_switches, shuffle=shuffle, drop_last=drop_last, pin_memory=pin_memory,
                        thread_pool=thread_pool, auto_reload=auto_reload,
                        persistent_workers=persistent_workers, in_order=in_order, profile=profile,
                        distributed=distributed, try_nopython=try_nopython)
        iterable = is_iterable_dataset(dataset)
        if iterable:   # first, as torch: an order argument means nothing to a stream, whatever its kind
            shuffle = _take_datapipe_settings(dataset, shuffle, thread_pool)
            _check_stream_order(shuffle, sampler, batch_sampler)
        _check_kinds(last_batch, batch_sampler, batchify_fn, collate_fn)
        batchify_fn, last_batch = _resolve_collate(batchify_fn, collate_fn, drop_last, last_batch,
                                                   torch_switches)
        num_workers, prefetch, autotune, auto_window = _resolve_auto(num_workers, prefetch, prefetch_factor,
                                                                     iterable, thread_pool, backend)
        shuffle = bool(shuffle)
        _check_distributed(distributed, iterable, sampler, batch_sampler)
        given_seed, from_torch = _check_seed(seed, generator)
        auto_batching = _check_batching(iterable, batch_size, shuffle, sampler, batch_sampler, last_batch,
                                        drop_last if torch_switches else None)
        batch_size = None if batch_sampler is not None else batch_size
        prefetch, timeout, start_method, max_worker_restarts = _check_worker_arguments(
            prefetch, prefetch_factor, num_workers, timeout, start_method, multiprocessing_context,
            max_worker_restarts, worker_init_fn)
        pin_device_id = _check_pinning(pin_device_id, pin_memory_device)
        ray_backend = _check_backend(backend, thread_pool, multiprocessing_context, start_method)
        seeding = _check_seeding(default_seeding if seeding is None else seeding, thread_pool, iterable)
        if num_workers == 0:
            _check_no_worker_options(persistent_workers, thread_pool, max_worker_restarts,
                                     multiprocessing_context, start_method, ray_backend is not None)
        collate = batchify_fn if batchify_fn is not None else _default_collate(auto_batching, torch_switches)
        return cls(
            dataset=dataset,
            batching=BatchingOptions(
                batch_size=batch_size, shuffle=shuffle, sampler=sampler, batch_sampler=batch_sampler,
                last_batch=last_batch or "keep", distributed=bool(distributed),
                batchify_fn=collate if auto_batching else _Unbatched(collate)),
            workers=WorkerOptions(
                num_workers=num_workers, prefetch=prefetch, thread_pool=bool(thread_pool),
                timeout=timeout, worker_init_fn=worker_init_fn, start_method=start_method,
                persistent_workers=bool(persistent_workers), in_order=bool(in_order),
                max_worker_restarts=max_worker_restarts, backend=ray_backend, autotune=autotune,
                auto_window=auto_window),
            seeds=SeedOptions(
                seed=given_seed if given_seed is not None else (0 if from_torch else _fresh_seed()),
                seeding=seeding, base_seed=0, distributed_seed=given_seed if given_seed is not None else 0,
                generator=generator),
            torch=TorchViews(collate_fn=collate, prefetch_factor=prefetch_factor_of(prefetch, num_workers),
                             multiprocessing_context=multiprocessing_context),
            derived=Derived(
                iterable=iterable, auto_batching=auto_batching, torch_seeded=from_torch,
                # What a stream (and the engine) groups samples by: 0 lets the batch sampler decide.
                fetch_batch_size=int(batch_size) if batch_size is not None else (0 if auto_batching else 1)),
            profile=bool(profile), pin_memory=bool(pin_memory), pin_device_id=pin_device_id,
            pin_memory_device=pin_memory_device, auto_reload=bool(auto_reload),
            try_nopython=None if try_nopython is None else bool(try_nopython), torch_face=torch_switches)


def _resolve_collate(batchify_fn: Any, collate_fn: Any, drop_last: object, last_batch: str | None,
                     torch_switches: bool) -> tuple[Any, str | None]:
    """(batchify_fn, last_batch) from them and their torch aliases, collate_fn and drop_last."""
    batchify_fn = collate_fn if collate_fn is not None else batchify_fn
    if batchify_fn is not None:
        batchify_fn = _native_collate(batchify_fn, torch_switches)
    if drop_last is not None:
        if last_batch is not None and drop_last and last_batch != "discard":
            raise ValueError(f"drop_last=True conflicts with last_batch={last_batch!r}")
        if drop_last:
            last_batch = "discard"
    return batchify_fn, last_batch


def _check_worker_arguments(prefetch: object, prefetch_factor: object, num_workers: int, timeout: object,
                            start_method: object, multiprocessing_context: object,
                            max_worker_restarts: object, worker_init_fn: object
                            ) -> tuple[int, float | None, str | None, int]:
    """(prefetch, timeout, start_method, max_worker_restarts) checked and resolved, in this order
    (prefetch: batches in flight in all, two per worker where not given)."""
    given_prefetch = _check_prefetch(prefetch, prefetch_factor, num_workers)
    timeout = _check_timeout(timeout)
    start_method = _check_start_method(start_method, multiprocessing_context)
    max_worker_restarts = check_int("max_worker_restarts", max_worker_restarts, 0)
    if worker_init_fn is not None and not callable(worker_init_fn):
        raise TypeError(f"worker_init_fn must be callable, got {type(worker_init_fn).__name__}")
    resolved = given_prefetch if given_prefetch is not None else 2 * max(num_workers, 1)
    return resolved, timeout, start_method, max_worker_restarts


def _check_pinning(pin_device_id: object, pin_memory_device: object) -> int:
    pin_device_id = check_int("pin_device_id", pin_device_id, 0)
    if not isinstance(pin_memory_device, str):
        raise TypeError(f"pin_memory_device must be a string, got {type(pin_memory_device).__name__}")
    return pin_device_id


def _check_num_workers(num_workers: object) -> int:
    if isinstance(num_workers, int) and num_workers < 0:
        # torch's words (programs match them), in the one style otherwise.
        raise ValueError(f"num_workers option should be non-negative (use num_workers=0 to load in the "
                         f"main process), got {num_workers}")
    return check_int("num_workers", num_workers, 0, hint=" (use num_workers=0 to load in the main process)")


# Each grouped field's group: LoaderOptions.value and replaced find a field by its name alone.
_GROUPS: dict[str, Any] = {"batching": BatchingOptions, "workers": WorkerOptions, "seeds": SeedOptions,
                           "torch": TorchViews, "derived": Derived}
_GROUP_OF = {f.name: group for group, kind in _GROUPS.items() for f in dataclasses.fields(kind)}


def _default_collate(auto_batching: bool, torch_face: bool) -> Any:
    """The collate function of a loader given none: mxload.torch's gives torch's containers."""
    if torch_face:
        return torch_default_collate if auto_batching else torch_default_convert
    return default_batchify if auto_batching else default_convert


def _native_collate(fn: Any, torch_face: bool) -> Any:
    """In mxload.torch, torch's default_collate and default_convert are mxload's (which give the
    same batches, collated natively): passed explicitly, as code that rebuilds a loader from its
    attributes passes them, they keep the native path.  The numpy face takes them as any function."""
    data = sys.modules.get("torch.utils.data") if torch_face else None
    if data is not None:
        if fn is getattr(data, "default_collate", None):
            return torch_default_collate
        if fn is getattr(data, "default_convert", None):
            return torch_default_convert
    return fn


def _take_datapipe_settings(dataset: object, shuffle: bool | None, thread_pool: object) -> bool | None:
    """A stream's `shuffle`, after a torch IterDataPipe took it as torch's DataLoader does (None:
    the order is its graph's): shuffle= switches the graph's shufflers on or off, and the
    shuffler graph_settings adds to a graph without one is dropped, as torch drops it.  Worker
    threads are refused for one: they would share one graph, which allows one iterator at a time
    and is sharded per worker process."""
    if not is_iter_datapipe(dataset):
        return shuffle
    if thread_pool:
        raise ValueError("a torch IterDataPipe cannot be loaded by worker threads (thread_pool=True): "
                         "they would share one graph, which allows one iterator at a time and is "
                         "sharded per worker process; use worker processes (thread_pool=False)")
    if shuffle is not None:
        apply_datapipe_shuffle(dataset, shuffle)
    return None


def _resolve_auto(num_workers: object, prefetch: object, prefetch_factor: object, iterable: bool,
                  thread_pool: object, backend: object) -> tuple[int, Any, bool, bool]:
    """(num_workers, prefetch, autotune, auto_window) with "auto" resolved and num_workers checked
    (an int from 0; torch's words for a negative one): num_workers="auto" is
    the most workers the tuner may use (this process's usable cores, capped), for map-style
    datasets and local workers (processes, or threads with thread_pool); prefetch="auto" (the
    default with it) lets it move the window."""
    auto_window = isinstance(prefetch, str) and prefetch == "auto"
    if auto_window:
        prefetch = None
    if not (isinstance(num_workers, str) and num_workers == "auto"):
        return _check_num_workers(num_workers), prefetch, False, auto_window
    from ._cpus import usable_cores
    if iterable:
        raise ValueError("num_workers='auto' needs a map-style dataset: an IterableDataset's stream is split "
                         "among a fixed number of workers (get_worker_info()), so pass an int")
    if backend is not None:
        raise ValueError("num_workers='auto' tunes local workers (processes, or threads with "
                         "thread_pool=True): pass an int num_workers with backend=...")
    return (min(usable_cores(), MAX_AUTO_WORKERS), prefetch, True,
            prefetch is None and prefetch_factor is None)


def is_iterable_dataset(dataset: object) -> bool:
    """Decided as torch does (an instance of its IterableDataset, whose
    inherited __getitem__ fools duck typing), or mxload's, or any object
    with __iter__ and no __getitem__."""
    if isinstance(dataset, IterableDataset) or is_torch_iterable_dataset(dataset):
        return True
    return hasattr(dataset, "__iter__") and not hasattr(dataset, "__getitem__")


# Switches whose default is None ("not given"), which they may also be.
_MAY_BE_NONE = ("shuffle", "drop_last", "try_nopython")


def _check_switches(torch_switches: bool, **switches: object) -> None:
    """True or False (numpy's bools too), a TypeError naming the first that is not: in_order="no"
    would mean True.  torch takes any truthy value, and so does its face (`torch_switches`),
    but for drop_last, which its BatchSampler checks (see from_arguments)."""
    if torch_switches:
        return
    for name, value in switches.items():
        if value is not None or name not in _MAY_BE_NONE:
            check_bool(name, value)


def _check_stream_order(shuffle: object, sampler: object, batch_sampler: object) -> None:
    """An IterableDataset decides its own order: no shuffle, sampler or
    batch_sampler (torch's errors, with its wording)."""
    for name, value, given in (("shuffle", shuffle, shuffle not in (False, None)),
                               ("sampler", sampler, sampler is not None),
                               ("batch_sampler", batch_sampler, batch_sampler is not None)):
        if given:
            raise ValueError(f"DataLoader with IterableDataset: expected unspecified {name} option, but got "
                             f"{name}={value!r} (an IterableDataset decides its own order and batches by "
                             f"batch_size: shuffle or sample inside its __iter__)")


def _check_kinds(last_batch: object, batch_sampler: object, batchify_fn: object, collate_fn: object) -> None:
    """The arguments whose kind betrays torch's positional order passed to
    Gluon's, and the collation function."""
    if last_batch is not None and not isinstance(last_batch, str):
        hint = (" torch's DataLoader takes batch_sampler fifth; pass it as batch_sampler=..."
                if hasattr(last_batch, "__iter__") else "")
        raise TypeError(f"the fifth positional argument is last_batch (Gluon's order: dataset, batch_size, "
                        f"shuffle, sampler, last_batch, batch_sampler, batchify_fn, num_workers, ...), a "
                        f"string, got a {type(last_batch).__name__}.{hint}")
    if batch_sampler is not None and not hasattr(batch_sampler, "__iter__"):
        raise TypeError(f"batch_sampler must be an iterable of index lists, got {batch_sampler!r}; "
                        f"positional arguments follow Gluon's order ({_POSITIONAL_ORDER}): pass torch's "
                        f"by keyword")
    if collate_fn is not None and batchify_fn is not None:
        raise ValueError("pass either batchify_fn or collate_fn (its alias), not both")
    fn = collate_fn if collate_fn is not None else batchify_fn
    if fn is not None and not callable(fn):
        raise TypeError(f"batchify_fn must be callable, got {type(fn).__name__}")


def _check_seed(seed: object, generator: object) -> tuple[int | None, bool]:
    """(the seed given, whether the run's seed comes from torch: see _seeded_by_torch)."""
    given_seed = None if seed is None else check_int("seed", seed, 0, or_none=True)
    return given_seed, _seeded_by_torch(given_seed, generator)


def _check_distributed(distributed: object, iterable: bool, sampler: object, batch_sampler: object) -> None:
    if not distributed:
        return
    clash = [name for name, bad in (("sampler", sampler is not None),
                                    ("batch_sampler", batch_sampler is not None)) if bad]
    if clash:
        raise ValueError(f"distributed=True is mutually exclusive with {', '.join(clash)} "
                         f"(pass a DistributedSampler as sampler= instead)")
    if iterable:
        raise ValueError("distributed=True cannot be used with an IterableDataset "
                         "(shard the stream by rank in the dataset instead)")


def _seeded_by_torch(seed: int | None, generator: object) -> bool:
    """Whether the run's seed comes from torch: without seed=, from
    generator= (or, when the program uses torch, torch's global RNG), drawn
    when torch's DataLoader draws its base seed, so torch.manual_seed(s)
    fixes the run as it does with torch; False: seed= (or a fresh seed)."""
    if seed is not None:
        if generator is not None:
            raise ValueError("pass seed or generator, not both (generator seeds the run as seed does)")
        return False
    if generator is not None:
        if torch_module() is None or not isinstance(generator, torch_module().Generator):
            seed_from_torch(generator)   # raises its TypeError, naming what generator must be
        return True
    return torch_module() is not None


def _check_seeding(seeding: object, thread_pool: object, iterable: bool) -> str:
    if seeding not in SEEDINGS:
        raise ValueError(f"seeding must be one of {', '.join(map(repr, SEEDINGS))}, got {seeding!r}")
    if seeding == "torch" and torch_module() is None:
        raise ValueError("seeding='torch' seeds the workers as torch's DataLoader does, and this program "
                         "has not imported torch: import torch first, or use seeding='per_worker'")
    if seeding == "per_sample" and thread_pool:
        raise ValueError("seeding='per_sample' reseeds the process's global RNGs before each sample, and "
                         "worker threads (thread_pool=True) share them: use worker processes, or draw "
                         "from mxload.sample_rng() in the dataset")
    if seeding == "per_sample" and iterable:
        raise ValueError("seeding='per_sample' seeds each sample from its index, and an IterableDataset's "
                         "samples have none: use a map-style dataset, or seed in the stream itself")
    return seeding


def _fresh_seed() -> int:
    return int(cast(int, np.random.SeedSequence().entropy) % 2 ** 63)


def _check_batching(iterable: bool, batch_size: object, shuffle: bool, sampler: object, batch_sampler: object,
                    last_batch: str | None, torch_drop_last: object = None) -> bool:
    """The batching arguments together; returns whether batches are made
    automatically (False: batch_size=None, each sample is its own batch).  `torch_drop_last`:
    drop_last as mxload.torch takes it (torch checks it is a bool, making its BatchSampler)."""
    if not iterable and sampler is not None and shuffle:
        raise ValueError("sampler option is mutually exclusive with shuffle: shuffle=True with a sampler "
                         "(shuffle with a RandomSampler instead)")
    if batch_sampler is not None:
        conflicts = [name for name, bad in (("batch_size", batch_size not in (None, 1)),
                                            ("shuffle", shuffle),
                                            ("sampler", sampler is not None),
                                            ("drop_last/last_batch", last_batch is not None)) if bad]
        if conflicts:
            raise ValueError(f"batch_sampler option is mutually exclusive with batch_size, shuffle, sampler "
                             f"and drop_last/last_batch (its batches decide them); got "
                             f"{', '.join(conflicts)}")
        return True
    auto_batching = batch_size is not None
    if batch_size is None:
        # torch: no automatic batching; each sample is one "batch".
        if last_batch is not None:
            raise ValueError("batch_size=None option disables auto-batching and is mutually exclusive with "
                             "drop_last/last_batch")
    else:
        check_int("batch_size", batch_size, 1, or_none=True)
    if iterable and last_batch not in (None, "keep", "discard"):
        raise ValueError(f"last_batch={last_batch!r} is not supported for an IterableDataset; use 'keep' "
                         f"or 'discard'")
    if torch_drop_last is not None and batch_size is not None and not isinstance(torch_drop_last, bool):
        # Where torch checks it: making its BatchSampler, after the conflicts between arguments.
        raise ValueError(f"drop_last should be a boolean value, but got drop_last={torch_drop_last}")
    return auto_batching


def _check_prefetch(prefetch: object, prefetch_factor: object, num_workers: int) -> int | None:
    """Batches in flight in all, from prefetch or torch's per-worker
    prefetch_factor; None: the default (two per worker)."""
    if prefetch is not None:
        prefetch = check_int("prefetch", prefetch, 1, or_none=True)
    if prefetch_factor is None:
        return prefetch
    if num_workers == 0:
        raise ValueError("prefetch_factor option could only be specified in multiprocessing (batches in "
                         "flight per worker, num_workers > 0); leave it None for num_workers=0")
    if prefetch is not None:
        if prefetch_factor == prefetch_factor_of(prefetch, num_workers):
            return prefetch   # what loader.prefetch_factor reads for it: a rebuild from a loader's attributes
        raise ValueError("pass prefetch (batches in flight in all) or prefetch_factor (per worker, "
                         "torch's), not both")
    if isinstance(prefetch_factor, int) and prefetch_factor < 0:
        raise ValueError(f"prefetch_factor option should be non-negative (batches in flight per worker, at "
                         f"least 1), got {prefetch_factor}")
    return check_int("prefetch_factor", prefetch_factor, 1) * num_workers


def prefetch_factor_of(prefetch: int, num_workers: int) -> int | None:
    """torch's per-worker view of `prefetch` batches in flight in all (None without workers)."""
    return None if num_workers == 0 else max(1, prefetch // num_workers)


def _check_timeout(timeout: object) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float, np.integer, np.floating)) \
            or timeout < 0 or timeout != timeout:
        raise ValueError(f"timeout option should be non-negative: a number of seconds (0 or None: wait "
                         f"forever), got {timeout!r}")
    return None if timeout == 0 else cast(float, timeout)   # 0 is torch's "no timeout"


def _check_start_method(start_method: object, multiprocessing_context: object) -> str | None:
    if multiprocessing_context is not None:
        context_method = _start_method_of(multiprocessing_context)
        if start_method is not None and start_method != context_method:
            raise ValueError(f"start_method={start_method!r} conflicts with multiprocessing_context "
                             f"{context_method!r}; pass one of them")
        return context_method
    if start_method is not None and start_method not in START_METHODS:
        raise ValueError(f"start_method must be one of {START_METHODS} or None, got {start_method!r}")
    return start_method


def _start_method_of(context: object) -> str:
    """multiprocessing_context (a start method name or a context object, as
    torch takes it) as a start method name."""
    if isinstance(context, str):
        name = context
    elif isinstance(context, mp_context.BaseContext):
        name = context.get_start_method()
    else:
        raise TypeError(f"multiprocessing_context option should be a valid context object or a start "
                        f"method name, got {type(context).__name__}")
    if name not in START_METHODS:
        raise ValueError(f"multiprocessing_context option should specify a valid start method in "
                         f"{list(START_METHODS)} (or be its context object), but got {name!r}")
    return name


def _check_backend(backend: object, thread_pool: bool, multiprocessing_context: object,
                   start_method: str | None) -> Backend | None:
    chosen = resolve_backend(backend)
    if chosen is not None:
        clash = [name for name, used in (
            ("thread_pool=True", thread_pool),
            ("multiprocessing_context" if multiprocessing_context is not None else "start_method",
             start_method is not None)) if used]
        if clash:
            where = "as Ray actors" if isinstance(chosen, RayBackend) else "itself"
            raise ValueError(f"backend={backend!r} runs the workers {where}: it cannot be combined "
                             f"with {', '.join(clash)}")
    return chosen


def _check_no_worker_options(persistent_workers: bool, thread_pool: bool, max_worker_restarts: int,
                             multiprocessing_context: object, start_method: str | None, ray: bool) -> None:
    unsupported = [name for name, used in (
        ("backend", ray),
        ("persistent_workers", persistent_workers), ("thread_pool", thread_pool),
        ("max_worker_restarts", max_worker_restarts > 0),
        ("multiprocessing_context" if multiprocessing_context is not None else "start_method",
         start_method is not None)) if used]
    if unsupported:
        one = len(unsupported) == 1
        raise ValueError(f"{', '.join(unsupported)} option{'' if one else 's'} need{'s' if one else ''} "
                         f"num_workers > 0: {'it' if one else 'they'} can only be used with multi-process "
                         f"loading (num_workers > 0), but got num_workers=0")
