"""The benches' workloads and how a bench walks a batch: shared by bench/loader.py,
bench/autotune.py and bench/peers.py (one definition of each workload's batch counts,
dataset building and batch touching).  Imports no optional package: a batch's torch
tensors are recognised only where torch is already imported."""
from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np

from mxload import synthetic as D

__all__ = ["ALL", "BATCHES", "QUICK_SCALE", "build_datasets", "touch", "close_iter", "own_cpu_s"]

# Batches per repeat (full run, quick run); capped by the loader's length.  jpeg and augment take
# 1.5-2 s at 2 workers: with 40 and 60 (0.5 s) the workers' first batches (their heaps warming)
# weighed on the rate, 69 b/s for augment against 91-112 in steady windows.
BATCHES = {
    "images": (150, 60),
    "tabular": (190, 60),
    "tabular-getitems": (190, 60),
    "dict16": (75, 35),
    "augment": (150, 16),
    "jpeg": (120, 12),
}
QUICK_SCALE = 0.5


def _available_workloads() -> dict[str, Any]:
    """Every workload this environment can build (jpeg needs pillow)."""
    out = dict(D.WORKLOADS)
    try:
        import PIL  # noqa: F401
        out.update(D.EXTRA_WORKLOADS)
    except ImportError:
        pass
    return out


ALL = _available_workloads()


def build_datasets(names: list[str], scale: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    tab = None
    for name in names:
        if name in ("tabular", "tabular-getitems"):
            if tab is None:   # one 200 MB matrix shared by both rows
                tab = D.make("tabular", scale)
            out[name] = tab if name == "tabular" else D.tabular_getitems(tab)
        else:
            out[name] = ALL[name].make(scale)
    return out


# ---------------------------------------------------------------- batch walking

def _leaves(batch: Any):
    if isinstance(batch, (tuple, list)):
        for x in batch:
            yield from _leaves(x)
    elif isinstance(batch, dict):
        for x in batch.values():
            yield from _leaves(x)
    else:
        yield batch


def _as_numpy(x: Any) -> np.ndarray | None:
    if isinstance(x, np.ndarray):
        return x
    torch = sys.modules.get("torch")    # a tensor exists only where torch was imported
    if torch is not None and isinstance(x, torch.Tensor):
        return x.numpy()
    return None


def touch(batch: Any, pages: bool) -> int:
    """Read one element (or one byte per page) of every array; return the
    batch's bytes."""
    total = 0
    for leaf in _leaves(batch):
        a = _as_numpy(leaf)
        if a is None or a.size == 0:
            continue
        total += a.nbytes
        if pages and a.flags.c_contiguous:
            a.reshape(-1).view(np.uint8)[::4096].sum()
        else:
            a.reshape(-1)[0]
    return total


def close_iter(it: Any) -> None:
    for name in ("close", "_shutdown_workers"):
        fn = getattr(it, name, None)
        if fn is not None:
            fn()
            return


def own_cpu_s() -> float:
    """CPU seconds this process and its reaped children have used."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system
