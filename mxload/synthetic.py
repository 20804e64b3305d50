"""Built-in synthetic datasets (deterministic, no downloads) for the demo,
the benchmarks and the tests."""
from __future__ import annotations

from typing import Any, Dict, Tuple

import numpy as np

from .dataset import ArrayDataset, Dataset

__all__ = ["ImageDataset", "TabularDataset", "Dict16Dataset", "AugmentDataset", "WORKLOADS", "make_workload"]


class ImageDataset(Dataset):
    """n × (224, 224, 3) uint8 images + int label, drawn from a pool of 64
    precomputed images (so 10,000 samples do not need 1.5 GB)."""

    def __init__(self, n: int = 10_000, shape: Tuple[int, ...] = (224, 224, 3), pool: int = 64):
        rng = np.random.default_rng(0)
        self.n = n
        self.images = rng.integers(0, 256, size=(pool,) + tuple(shape), dtype=np.uint8)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return self.images[i % len(self.images)], i % 1000


class TabularDataset(Dataset):
    """n × (256,) float32 rows + int label, one row per __getitem__."""

    def __init__(self, n: int = 200_000, width: int = 256):
        rng = np.random.default_rng(1)
        self.x = rng.standard_normal((n, width), dtype=np.float32)
        self.y = rng.integers(0, 10, size=n).astype(np.int64)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> Any:
        return self.x[i], self.y[i]


class Dict16Dataset(Dataset):
    """n samples, each a dict of 16 fields of (64,) float32."""

    def __init__(self, n: int = 20_000, fields: int = 16, width: int = 64):
        rng = np.random.default_rng(2)
        self.n = n
        self.keys = [f"f{k}" for k in range(fields)]
        self.pool = rng.standard_normal((256, fields, width), dtype=np.float32)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Dict[str, np.ndarray]:
        row = self.pool[i % len(self.pool)]
        return {k: row[j] for j, k in enumerate(self.keys)}


class AugmentDataset(ImageDataset):
    """Images with a per-sample random horizontal flip and normalisation to
    float32, done in numpy (CPU-bound)."""

    def __getitem__(self, i: int) -> Any:
        image, label = super().__getitem__(i)
        rng = np.random.default_rng(i)
        if rng.random() < 0.5:
            image = image[:, ::-1]
        out = image.astype(np.float32)
        out -= 127.5
        out *= 1 / 58.0
        return out, label


def _tabular_getitems() -> ArrayDataset:
    base = TabularDataset()
    return ArrayDataset(base.x, base.y)


WORKLOADS = {
    "images": (lambda: ImageDataset(), 64),
    "tabular": (lambda: TabularDataset(), 1024),
    "tabular-getitems": (_tabular_getitems, 1024),
    "dict16": (lambda: Dict16Dataset(), 256),
    "augment": (lambda: AugmentDataset(), 32),
}


def make_workload(name: str) -> Tuple[Dataset, int]:
    """(dataset, batch size) of a named workload."""
    factory, batch_size = WORKLOADS[name]
    return factory(), batch_size
