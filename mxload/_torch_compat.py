"""Interop with PyTorch for code written against torch.utils.data, without
ever importing torch: torch objects can only exist if the user's program
already imported torch, so everything here looks torch up in ``sys.modules``
or recognises its types by duck typing and class names.

One job: translate between torch's data-loading conventions (its dataset
kinds, tensors, generators, worker info and seeding, pinned memory) and
mxload's.
"""
from __future__ import annotations

import base64
import importlib
import sys
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "torch_module", "is_torch_iterable_dataset", "is_iter_datapipe", "apply_datapipe_shuffle", "is_tensor",
    "tensor_to_numpy", "seed_from_torch",
    "enter_worker", "stack_rows", "torch_numpy_seed", "pin_batch", "pinning_device", "to_tensors",
    "PIN_MEMORY_NO_ACCELERATOR", "shuffle_generator", "generator_state", "set_generator_state",
    "collatable_tensor", "batch_dtype", "TORCH_DTYPE_PREFIX", "viewing_dtype", "as_torch_dtype",
    "stack_into", "copy_into", "gather_tensor_dataset", "is_datapipe", "datapipe_shards",
    "torch_process_group",
    "draw_datapipe_seed", "seed_datapipe", "shard_datapipe", "datapipe_seed_group",
]

# Word for word what torch 2.x warns (DataLoader iterator start) when
# pin_memory=True finds no accelerator: users grep logs for it.
PIN_MEMORY_NO_ACCELERATOR = ("'pin_memory' argument is set as true but no accelerator is found, "
                             "then device pinned memory won't be used.")


def torch_module() -> Any:
    """The torch module if the program imported it, else None (never imports it)."""
    return sys.modules.get("torch")


def _mro_names(obj: Any) -> set[tuple[str, str]]:
    return {(getattr(c, "__module__", ""), c.__name__) for c in type(obj).__mro__}


def is_torch_iterable_dataset(dataset: Any) -> bool:
    """Whether torch would treat `dataset` as iterable-style: an instance of
    torch.utils.data.IterableDataset (IterDataPipe included).  torch's
    IterableDataset inherits a __getitem__ from its Dataset base, so the
    duck-typed rule (``__iter__`` without ``__getitem__``) misses it."""
    return any(name == "IterableDataset" and module.startswith("torch.utils.data")
               for module, name in _mro_names(dataset))


def is_iter_datapipe(dataset: Any) -> bool:
    """Whether `dataset` is a torch IterDataPipe (its DataLoader takes shuffle= for one)."""
    return any(name == "IterDataPipe" and module.startswith("torch.utils.data")
               for module, name in _mro_names(dataset))


def apply_datapipe_shuffle(datapipe: Any, shuffle: object) -> None:
    """shuffle= for an IterDataPipe, as torch's DataLoader applies it: every shuffler in its graph
    switched on or off (torch's graph_settings).  The graph it returns is not used, as torch's
    DataLoader does not use it: with shuffle=True and no shuffler it is a new shuffler over the
    graph, which torch's loader drops (its batches stay in the graph's order)."""
    settings: Any = importlib.import_module("torch.utils.data.graph_settings")
    settings.apply_shuffle_settings(datapipe, shuffle=bool(shuffle))


def is_datapipe(dataset: Any) -> bool:
    """Whether `dataset` is a torch IterDataPipe or MapDataPipe (torch's DataLoader shards one)."""
    return any(name in ("IterDataPipe", "MapDataPipe") and module.startswith("torch.utils.data")
               for module, name in _mro_names(dataset))


def torch_process_group() -> tuple[int, int] | None:
    """``(world_size, rank)`` of torch's default process group, or None.

    torch is never imported here: a process group can only have been
    initialised by code that already imported ``torch.distributed``, so
    looking it up in ``sys.modules`` is enough and keeps ``import mxload``
    (and samplers in torch-free programs) free of torch.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return None
    try:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        return int(dist.get_world_size()), int(dist.get_rank())
    except Exception:
        # A half-imported or stubbed torch.distributed: the caller's fallback.
        return None


def datapipe_shards() -> tuple[int, int]:
    """(world size, rank) as torch's DataLoader reads them to shard a DataPipe: torch's default
    process group's where it is initialised, else (1, 0)."""
    return torch_process_group() or (1, 0)


def datapipe_seed_group() -> Any:
    """The process group an IterDataPipe's shared seed is broadcast over where torch.distributed
    is initialised (a gloo group, as torch's DataLoader makes; every rank must make it, as every
    rank's loader starts alike), else None."""
    if torch_process_group() is None:
        return None
    return sys.modules["torch.distributed"].new_group(backend="gloo")


def _draw_int64(torch: Any, generator: Any) -> Any:
    """The 0-d int64 tensor torch's DataLoader draws its seeds as (from `generator`, else torch's
    global RNG)."""
    return torch.empty((), dtype=torch.int64).random_(generator=generator)


def draw_datapipe_seed(generator: Any, group: Any = None) -> int:
    """The shared seed torch's DataLoader draws for an IterDataPipe at each iter() (from the
    loader's generator, else torch's global RNG), before its base seed: the same number; with a
    process `group` (datapipe_seed_group), rank 0's, broadcast as torch broadcasts it, so that
    every rank shuffles alike and the ranks' shards partition the stream."""
    seed = _draw_int64(sys.modules["torch"], generator)
    if group is not None:
        sys.modules["torch.distributed"].broadcast(seed, src=0, group=group)
    return int(seed.item())


def seed_datapipe(datapipe: Any, shared_seed: int) -> Any:
    """An IterDataPipe's random operations (its shufflers) seeded for an epoch from
    `shared_seed`, as torch's DataLoader does in its training process and in every worker, so
    that all workers shuffle alike and their shards partition the stream (torch's
    graph_settings; the graph is returned)."""
    torch = sys.modules["torch"]
    settings: Any = importlib.import_module("torch.utils.data.graph_settings")
    return settings.apply_random_seed(datapipe, torch.Generator().manual_seed(shared_seed))


def shard_datapipe(datapipe: Any, num_workers: int, worker_id: int, world_size: int, rank: int) -> None:
    """A DataPipe's sharding filters set for worker `worker_id` of `num_workers` (0 workers: the
    training process, one of one) on rank `rank` of `world_size`, as torch's DataLoader sets
    them (the ranks sharded first, then each rank's workers)."""
    settings: Any = importlib.import_module("torch.utils.data.graph_settings")
    settings.apply_sharding(datapipe, num_workers * world_size, worker_id * world_size + rank)


def is_tensor(x: Any) -> bool:
    torch = torch_module()
    return torch is not None and isinstance(x, torch.Tensor)


def tensor_to_numpy(x: Any) -> np.ndarray:
    """A torch tensor as a numpy array, sharing memory where torch allows it
    (CPU, no autograd history): detach() and the DLPack/``numpy()`` exchange
    copy nothing.  A tensor on a device is copied to the host first, as
    default_collate's output would have to be before numpy could see it."""
    t = x.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    try:
        return np.asarray(t.numpy())
    except TypeError as e:   # e.g. bfloat16: numpy has no such dtype
        raise TypeError(f"a torch tensor of dtype {t.dtype} has no numpy equivalent ({e}); convert it "
                        f"in the dataset (e.g. tensor.float())") from None


# ---------------------------------------------------------------- tensor fields
#
# A batch field made of tensors is filled by torch itself: one torch.stack
# per field into a tensor over the field's place in the batch buffer (a
# shared-memory slab in a worker), never a per-sample conversion to numpy
# (that cost ~12 us a tensor: detach, the device/conj/neg checks, .numpy()).
# A torch dtype numpy lacks (bfloat16, float8, complex32) is laid out as
# unsigned ints of its size and named in the layout as TORCH_DTYPE_PREFIX +
# its name, so the consumer views those bytes as that torch dtype again.

TORCH_DTYPE_PREFIX = "torch."

# torch dtype -> (numpy dtype of the field's bytes, the torch dtype's name where numpy has none)
_BATCH_DTYPES: dict[Any, tuple[np.dtype[Any], str | None]] = {}


def collatable_tensor(x: Any) -> bool:
    """Whether `x` is a tensor torch.stack can write into a CPU batch: a
    strided tensor on the CPU (others keep the conversion to numpy, which
    copies a device tensor to the host first).  A nested tensor is strided
    but has no one shape: never."""
    torch = torch_module()
    return (torch is not None and isinstance(x, torch.Tensor) and x.layout is torch.strided
            and not x.is_nested and x.device.type == "cpu")


def batch_dtype(dtype: Any) -> tuple[np.dtype[Any], str | None]:
    """(numpy dtype, torch-only name) of a batch field of torch dtype
    `dtype`: its numpy twin and None, or for a dtype numpy lacks, unsigned
    ints of its size and its name (``"torch.bfloat16"``)."""
    got = _BATCH_DTYPES.get(dtype)
    if got is None:
        torch = sys.modules["torch"]
        if not _BATCH_DTYPES:   # torch's twin of every numpy dtype torch.from_numpy takes
            for code in "?bBhHiIlLefdFD":
                try:
                    _BATCH_DTYPES[torch.from_numpy(np.empty(0, code)).dtype] = (np.dtype(code), None)
                except TypeError:   # one this torch lacks (uint32 before torch 2.3)
                    pass
        got = _BATCH_DTYPES.get(dtype)
        if got is None:   # no numpy dtype (bfloat16, float8, complex32): its bytes
            got = _BATCH_DTYPES[dtype] = (np.dtype(f"u{dtype.itemsize}"), str(dtype))
    return got


def viewing_dtype(name: str) -> np.dtype[Any]:
    """The numpy dtype that holds the bytes of torch-only dtype `name`."""
    return batch_dtype(_torch_dtype(name))[0]


def _torch_dtype(name: str) -> Any:
    # A worker made the field, so torch is installed; this process may not
    # have imported it yet (a dataset that imports torch in its workers only).
    torch = importlib.import_module("torch")
    dtype = getattr(torch, name[len(TORCH_DTYPE_PREFIX):], None)
    if not name.startswith(TORCH_DTYPE_PREFIX) or not isinstance(dtype, torch.dtype):
        raise TypeError(f"a batch names torch dtype {name!r}, which this torch (torch "
                        f"{torch.__version__}) does not have")
    return dtype


def as_torch_dtype(array: np.ndarray, name: str) -> Any:
    """A field of torch-only dtype `name` (its bytes in `array`, from
    viewing_dtype) as a tensor of that dtype over the same memory."""
    dtype = _torch_dtype(name)
    return sys.modules["torch"].from_numpy(array).view(dtype)


def _over(out: np.ndarray, dtype: Any) -> Any:
    """A tensor of torch dtype `dtype` over the field's place `out`."""
    target = sys.modules["torch"].from_numpy(out)
    return target if target.dtype == dtype else target.view(dtype)


class _NotStacked(Exception):
    """stack_rows cannot make this batch by itself: the planned path does (or names the error)."""


def stack_rows(samples: list[Any]) -> Any:
    """The batch torch's default_collate makes of `samples` in the process that
    keeps it, where every leaf is a plain CPU tensor or a Python int or float
    under plain tuples, lists and dicts: one ``torch.stack`` per tensor field
    (``torch.tensor`` for the numbers), tuples made lists.  No buffer, no plan:
    the values the planned path writes, and the tensors it would hand out
    (``to_tensors``), for none of its per-field work (the layout walk, the
    buffer's views, the tensors made over them: ~100 us a batch of two fields,
    as much as torch's whole collation of them).  None where a sample differs
    from sample 0 in structure, a field is anything else, or torch refuses or
    promotes a stack: the planned path then collates it (casting to sample 0's
    dtype) or raises the error that names the batch and the field."""
    torch = sys.modules.get("torch")
    if torch is None or not samples:
        return None
    try:
        return _stack_column(samples, torch, torch.Tensor)
    except (_NotStacked, KeyError, RuntimeError, TypeError, ValueError, OverflowError):
        return None


def _stack_column(column: Sequence[Any], torch: Any, tensor: type) -> Any:
    first = column[0]
    kind = type(first)
    if kind is tensor:
        if first.layout is not torch.strided or first.is_nested or first.device.type != "cpu":
            raise _NotStacked
        stacked = torch.stack(column)
        if type(stacked) is not tensor or stacked.dtype != first.dtype:
            raise _NotStacked   # a subclass, or samples of other dtypes: planned (cast to sample 0's)
        return stacked
    # The checks run in C (set, map, zip's strict): a Python loop over the rows cost 20-40 us a batch.
    if kind is tuple or kind is list:
        if len(set(map(type, column))) != 1:
            raise _NotStacked
        # (rows of other lengths: zip's ValueError)
        return [_stack_column(field, torch, tensor) for field in zip(*column, strict=True)]
    if kind is dict:
        if len(set(map(type, column))) != 1 or len(set(map(len, column))) != 1:
            raise _NotStacked
        return {key: _stack_column([sample[key] for sample in column], torch, tensor) for key in first}
    if kind is int or kind is float:
        if len(set(map(type, column))) != 1:
            raise _NotStacked
        return torch.tensor(column, dtype=torch.float64 if kind is float else torch.int64)
    raise _NotStacked


# torch's TensorDataset.__getitem__: ``tuple(tensor[index] for tensor in self.tensors)``.
_TENSOR_DATASET_GETITEM = ("torch.utils.data.dataset", "TensorDataset.__getitem__")


def gather_tensor_dataset(dataset: Any, indices: np.ndarray) -> tuple[Any, ...] | None:
    """Each tensor of a torch ``TensorDataset`` at `indices`, gathered in one go: the tensors
    ``torch.stack`` makes of the rows ``dataset[i]`` gives, value for value, dtype, shape and
    strides alike.  None (the caller fetches per index, as torch does) unless the dataset's
    ``__getitem__`` is torch's own (not a subclass's) and every tensor is a plain contiguous
    CPU tensor without autograd history, conjugate or negative bit, or where torch refuses an
    index (its IndexError then comes from ``dataset[i]`` itself)."""
    torch = sys.modules.get("torch")
    getitem = getattr(type(dataset), "__getitem__", None)
    if torch is None or (getattr(getitem, "__module__", None),
                         getattr(getitem, "__qualname__", None)) != _TENSOR_DATASET_GETITEM:
        return None
    tensors = getattr(dataset, "tensors", None)
    if type(tensors) is not tuple or not tensors:
        return None
    tensor = torch.Tensor
    for t in tensors:
        if (type(t) is not tensor or t.layout is not torch.strided or t.is_nested or t.device.type != "cpu"
                or t.ndim == 0 or t.requires_grad or t.is_quantized or t.is_conj() or t.is_neg()
                or not t.is_contiguous()):
            return None
    kind, size = indices.dtype.kind, indices.dtype.itemsize
    if kind not in "iu" or (kind == "u" and size == 8):
        return None   # (not exactly int64: a byte tensor would index as a mask, a uint64 wrap)
    if indices.dtype != np.int64 or not indices.flags.c_contiguous or not indices.flags.writeable:
        # native int64, contiguous, writable: what torch.from_numpy takes (not negative strides)
        indices = np.array(indices, dtype=np.int64)
    index = torch.from_numpy(indices)
    try:
        # index_select, not t[index]: the same rows (a negative index, which it refuses, goes the
        # per-index way), and no intra-op threads for a batch's rows: advanced indexing spread
        # 256 rows of 64 floats over torch's threads, 9 us alone and 100-250 us on a busy
        # 2-core machine (against 3-4.5 us), and whole epochs 40x slower while other work ran.
        return tuple(torch.index_select(t, 0, index) for t in tensors)
    except (IndexError, RuntimeError):
        return None


def stack_into(tensors: list[Any], out: np.ndarray, dtype: Any) -> tuple[Any, bool]:
    """torch.stack(tensors) written into `out` (the field's place, of
    batch_dtype(dtype)): (the tensor over `out`, whether the samples carry
    autograd history).  torch stacks non-contiguous, conjugate and negative
    views and casts a sample of another dtype into sample 0's, as torch's
    worker processes do (default_collate stacks into sample 0's storage
    there); a cast it refuses is its RuntimeError.  Samples with autograd
    history (grad mode on) are stacked detached: the caller decides whether
    the batch needs torch.stack's graph (see TensorField)."""
    torch = sys.modules["torch"]
    target = _over(out, dtype)
    try:
        torch.stack(tensors, out=target)
    except RuntimeError:
        # stack(out=) refuses inputs that need a graph; find out if that was it
        # only now, so the common case costs no per-sample look.
        if not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors):
            raise
        with torch.no_grad():
            torch.stack(tensors, out=target)
        return target, True
    return target, False


def copy_into(tensor: Any, out: np.ndarray, dtype: Any) -> tuple[Any, bool]:
    """`tensor` copied into `out` (its place, of batch_dtype(dtype)); as stack_into."""
    torch = sys.modules["torch"]
    target = _over(out, dtype)
    with torch.no_grad():
        target.copy_(tensor)
    return target, tensor.requires_grad and torch.is_grad_enabled()


def seed_from_torch(generator: Any) -> int:
    """A 63-bit seed drawn from a torch.Generator (or, for None, from torch's
    global RNG) the way torch's DataLoader draws its base seed: so
    ``torch.manual_seed(s)`` or ``generator.manual_seed(s)`` fixes the run."""
    torch = torch_module()
    if torch is None:
        raise TypeError(f"generator must be a torch.Generator (torch is not imported), got "
                        f"{type(generator).__name__}; use seed=<int> instead")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}; "
                        f"use seed=<int> for an integer seed")
    return int(_draw_int64(torch, generator).item()) % (2 ** 63)


def torch_numpy_seed(base_seed: int, worker_id: int) -> Any:
    """What torch's worker loop seeds numpy's global RNG with in worker `worker_id` of an
    iteration whose base seed is `base_seed` (four 32-bit words, torch's own function, so the
    numbers drawn are torch's bit for bit)."""
    worker_mod: Any = importlib.import_module("torch.utils.data._utils.worker")
    return worker_mod._generate_state(base_seed, worker_id)


def shuffle_generator(sampler: Any) -> Any:
    """The torch.Generator a torch RandomSampler draws its order from (its own, else torch's
    global one, from which it draws a seed); None for any other sampler."""
    torch = torch_module()
    data = sys.modules.get("torch.utils.data")
    if torch is None or data is None or not isinstance(sampler, data.RandomSampler):
        return None
    return sampler.generator if sampler.generator is not None else torch.default_generator


def generator_state(generator: Any) -> str:
    """A torch.Generator's state as text (base64: a JSON-serialisable checkpoint entry)."""
    return base64.b64encode(generator.get_state().numpy().tobytes()).decode("ascii")


def set_generator_state(generator: Any, text: str) -> None:
    torch = sys.modules["torch"]
    generator.set_state(torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8))


def enter_worker(worker_id: int, num_workers: int, seed: int, dataset: Any, process: bool) -> None:
    """Make torch's view of this worker match mxload's, when the program uses
    torch: ``torch.utils.data.get_worker_info()`` returns this worker's id,
    count, seed and dataset (sharding code written for torch then splits the
    stream instead of duplicating it), and, in a worker process, torch's RNG
    is seeded with the worker seed (``torch.initial_seed()`` is it) and torch
    uses one intra-op thread, as in torch's own workers.  Thread workers share
    the process, whose torch RNG and thread count are the training loop's:
    those stay untouched, and torch's get_worker_info() (a process global)
    stays None in them."""
    torch = torch_module()
    if torch is None or not process:
        return
    try:
        # torch is loaded; its data package may not be yet.
        worker_mod: Any = importlib.import_module("torch.utils.data._utils.worker")
        worker_mod._worker_info = worker_mod.WorkerInfo(id=worker_id, num_workers=num_workers,
                                                        seed=seed, dataset=dataset)
        torch.manual_seed(seed)
        torch.set_num_threads(1)
    except Exception as e:  # a torch without these internals: mxload's own info still works
        warnings.warn(f"mxload could not set torch.utils.data.get_worker_info() in worker {worker_id}: "
                      f"{type(e).__name__}: {e}; use mxload.get_worker_info()", RuntimeWarning, stacklevel=1)


# ---------------------------------------------------------------- pinned memory


def pinning_device() -> str | None:
    """The accelerator torch pins for ('cuda', ...), or None if there is none
    (or torch is not imported: then nothing can use pinned memory anyway)."""
    torch = torch_module()
    if torch is None:
        return None
    accelerator = getattr(torch, "accelerator", None)
    try:
        if accelerator is not None:
            if not accelerator.is_available():
                return None
            current = accelerator.current_accelerator()
            return None if current is None or current.type == "mps" else str(current.type)
        return "cuda" if torch.cuda.is_available() else None
    except Exception:
        return None


def pinning_for_loader(pin_memory_device: str, stacklevel: int) -> str | None:
    """pin_memory=True at a loader's first iter(): the device to pin for, with
    torch's warnings (a deprecated pin_memory_device; no accelerator: nothing is pinned)."""
    device = pinning_device()
    if pin_memory_device:
        warnings.warn("pin_memory_device is deprecated, the current accelerator will be used as the "
                      f"device,ignore pin_memory_device='{pin_memory_device}'.", stacklevel=stacklevel + 1)
    if device is None:
        warnings.warn(PIN_MEMORY_NO_ACCELERATOR, stacklevel=stacklevel + 1)
    return device


def pin_batch(batch: Any) -> Any:
    """`batch` with every numpy array moved into page-locked (pinned) host
    memory, still as numpy arrays: each is copied into a tensor from torch's
    caching pinned-memory allocator and viewed through ``.numpy()``, so
    ``torch.from_numpy(x)`` is pinned and ``.to('cuda', non_blocking=True)``
    is a true asynchronous copy.  The pinned block goes back to torch's cache
    when the array dies, so steady-state batches reuse blocks."""
    torch = sys.modules["torch"]
    return _pin(batch, torch)


def to_tensors(batch: Any) -> Any:
    """`batch` with every numpy array it holds as a torch tensor sharing its
    memory (``torch.from_numpy``: no copy; the tensor keeps the batch's slab
    alive).  Arrays torch has no dtype for (strings, non-native byte order)
    stay numpy arrays; containers keep their types."""
    torch = sys.modules["torch"]
    return _tensors(batch, torch)


def _tensors(x: Any, torch: Any) -> Any:
    if isinstance(x, np.ndarray):
        if x.dtype.hasobject or x.dtype.kind in "SUVMm" or not x.dtype.isnative:
            return x
        try:
            return torch.from_numpy(x)
        except TypeError:   # a dtype this torch lacks
            return x
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*(_tensors(v, torch) for v in x))
    if type(x) in (tuple, list):
        return type(x)(_tensors(v, torch) for v in x)
    if isinstance(x, dict):
        out = x.copy()
        for k, v in x.items():
            out[k] = _tensors(v, torch)
        return out
    return x


def _pin(x: Any, torch: Any) -> Any:
    if isinstance(x, np.ndarray):
        if x.dtype.hasobject or x.dtype.kind in "SUV" or not x.dtype.isnative:
            return x   # no torch dtype for it: leave it in pageable memory
        pinned = torch.empty(x.shape, dtype=torch.from_numpy(np.empty(0, x.dtype)).dtype, pin_memory=True)
        out = pinned.numpy()
        np.copyto(out, x)
        return out
    if isinstance(x, torch.Tensor):
        return x.pin_memory()
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*(_pin(v, torch) for v in x))
    if isinstance(x, tuple):
        return tuple(_pin(v, torch) for v in x)
    if isinstance(x, list):
        return [_pin(v, torch) for v in x]
    if isinstance(x, dict):
        out_d = x.copy()
        for k, v in x.items():
            out_d[k] = _pin(v, torch)
        return out_d
    return x
