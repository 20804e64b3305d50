"""Built-in synthetic datasets (deterministic, no downloads) for the demo
(``python -m mxload bench``), the benchmarks in bench/ and the tests.

Every dataset is deterministic (seeded), defined at module level (so it
pickles for spawn/forkserver workers) and usable by both mxload and
``torch.utils.data.DataLoader``: plain ``__getitem__``/``__len__`` returning
numpy arrays and Python ints (torch's default collate turns numpy into
tensors).  Nothing here imports torch or mxload at module level.

Workloads (see ``WORKLOADS``; ``make(name, scale)`` builds one):

==================  =======================================  =====
name                sample                                   batch
==================  =======================================  =====
images              (224, 224, 3) uint8, int label           64
tabular             (256,) float32 row, int label            1024
tabular-getitems    same arrays as mxload.ArrayDataset       1024
                    (vectorised ``__getitems__``)
dict16              dict of 16 fields, each (64,) float32    256
augment             images + random flip + normalise to      32
                    float32 (224, 224, 3), done in numpy
==================  =======================================  =====

``EXTRA_WORKLOADS`` need a package beyond numpy (the benches use them; the
``python -m mxload bench`` demo does not):

==================  =======================================  =====
jpeg                a (256, 320) JPEG decoded with pillow,   32
                    cropped to (224, 224, 3) uint8 + label
==================  =======================================  =====

The images come from a small pool (64 distinct images, sample i is image
i % 64): the pooled array itself is returned, since both loaders copy while
collating.  ``scale`` (0 < scale <= 1) shrinks the number of samples for
quick runs; shapes and batch sizes never change.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from .dataset import ArrayDataset

__all__ = [
    "ImageDataset", "TabularDataset", "Dict16Dataset", "AugmentDataset",
    "JpegDataset", "tabular_getitems", "Workload", "WORKLOADS", "EXTRA_WORKLOADS", "make",
    "make_workload",
]

IMAGE_SHAPE = (224, 224, 3)
IMAGE_POOL = 64
MEAN = np.array([0.485, 0.456, 0.406], np.float32)
STD = np.array([0.229, 0.224, 0.225], np.float32)


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


class ImageDataset:
    """`n` samples of ((224, 224, 3) uint8 image, int label) drawn from a pool
    of `pool` distinct seeded images (sample i is pooled image i % pool)."""

    def __init__(self, n: int = 10_000, pool: int = IMAGE_POOL, seed: int = 0):
        rng = _rng(seed)
        self.n = int(n)
        self.images = rng.integers(0, 256, size=(pool,) + IMAGE_SHAPE, dtype=np.uint8)
        self.labels = rng.integers(0, 1000, size=self.n).tolist()  # Python ints

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return self.images[i % len(self.images)], self.labels[i]


class AugmentDataset(ImageDataset):
    """ImageDataset plus a CPU-bound per-sample augmentation in numpy: a
    horizontal flip for about half the samples (decided by a hash of the
    index, so it is the same in every loader and worker) and normalisation to
    float32 ((x / 255 - mean) / std)."""

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        img, label = super().__getitem__(i)
        if (i * 2654435761 >> 16) & 1:
            img = img[:, ::-1]
        out = img.astype(np.float32)
        out *= np.float32(1.0 / 255.0)
        out -= MEAN
        out /= STD
        return out, label


class TabularDataset:
    """`n` rows of (256,) float32 features plus an int label; one matrix,
    one row view per `__getitem__` (no `__getitems__`)."""

    def __init__(self, n: int = 200_000, dim: int = 256, seed: int = 1):
        rng = _rng(seed)
        self.x = rng.standard_normal((int(n), dim), dtype=np.float32)
        self.y = rng.integers(0, 10, size=int(n)).astype(np.int64)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        return self.x[i], int(self.y[i])


class JpegDataset:
    """`n` samples of ((224, 224, 3) uint8 crop of a decoded JPEG, int label):
    a decode-bound per-sample workload.  Sample i decodes encoded image
    i % `pool` (each about 40 kB, a (256, 320) gradient plus noise, quality
    90) with pillow and crops it at an offset derived from i, so every loader
    and worker does the same work.  Needs pillow (imported when first used)."""

    def __init__(self, n: int = 4_096, pool: int = 16, seed: int = 3):
        import io

        from PIL import Image
        rng = _rng(seed)
        self.n = int(n)
        yy, xx = np.mgrid[0:256, 0:320]
        self.encoded = []
        for k in range(pool):
            base = np.stack([(xx + yy + 7 * k) % 256, (2 * xx + k) % 256, (3 * yy) % 256], -1)
            noisy = np.clip(base + rng.integers(-30, 30, base.shape), 0, 255).astype(np.uint8)
            buf = io.BytesIO()
            Image.fromarray(noisy).save(buf, "JPEG", quality=90)
            self.encoded.append(buf.getvalue())
        self.labels = rng.integers(0, 1000, size=self.n).tolist()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        import io

        from PIL import Image
        if not 0 <= i < self.n:
            raise IndexError(i)
        with Image.open(io.BytesIO(self.encoded[i % len(self.encoded)])) as im:
            pixels = np.asarray(im.convert("RGB"))
        top, left = (i * 7) % (pixels.shape[0] - 223), (i * 13) % (pixels.shape[1] - 223)
        return pixels[top:top + 224, left:left + 224], self.labels[i]


def tabular_getitems(base: TabularDataset) -> ArrayDataset:
    """mxload.ArrayDataset over `base`'s arrays (vectorised ``__getitems__``).

    torch >= 2.0 also calls ``__getitems__`` when a dataset has it, then runs
    its default collate over the returned samples."""
    from .dataset import ArrayDataset
    return ArrayDataset(base.x, base.y)


class Dict16Dataset:
    """`n` samples, each a dict of 16 fields ``f00``..``f15`` of (64,) float32."""

    def __init__(self, n: int = 20_000, fields: int = 16, dim: int = 64, seed: int = 2):
        rng = _rng(seed)
        self.keys = [f"f{k:02d}" for k in range(fields)]
        self.cols = [rng.standard_normal((int(n), dim), dtype=np.float32) for _ in range(fields)]
        self.n = int(n)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return {k: c[i] for k, c in zip(self.keys, self.cols)}


@dataclass(frozen=True)
class Workload:
    """A named synthetic dataset, its batch size, its full number of samples
    and one line saying what a sample is (for the bench's header)."""

    name: str
    batch_size: int
    full_samples: int
    build: Callable[[int], Any]    # number of samples -> dataset
    description: str = ""

    def make(self, scale: float = 1.0) -> Any:
        n = max(self.batch_size * 4, int(self.full_samples * scale))
        return self.build(n)


def _tabular_getitems(n: int) -> ArrayDataset:
    return tabular_getitems(TabularDataset(n))


WORKLOADS: dict[str, Workload] = {w.name: w for w in [
    Workload("images", 64, 10_000, ImageDataset,
             "(224, 224, 3) uint8 image + int label; 64 distinct images, reused"),
    Workload("tabular", 1024, 200_000, TabularDataset,
             "(256,) float32 row of one matrix + int label, one __getitem__ per row"),
    Workload("tabular-getitems", 1024, 200_000, _tabular_getitems,
             "the same matrix as an ArrayDataset: one vectorised __getitems__ per batch"),
    Workload("dict16", 256, 20_000, Dict16Dataset,
             "dict of 16 fields, each a (64,) float32 row of its own matrix"),
    Workload("augment", 32, 10_000, AugmentDataset,
             "an image flipped (half of them) and normalised to float32 in numpy"),
]}


EXTRA_WORKLOADS: dict[str, Workload] = {w.name: w for w in [
    Workload("jpeg", 32, 4_096, JpegDataset,
             "a (256, 320) JPEG decoded with pillow and cropped to (224, 224, 3) uint8 + int label"),
]}


def _workload(name: str) -> Workload:
    return WORKLOADS[name] if name in WORKLOADS else EXTRA_WORKLOADS[name]


def make(name: str, scale: float = 1.0) -> Any:
    """Build workload `name`'s dataset with `scale` of its full size."""
    return _workload(name).make(scale)


def make_workload(name: str, scale: float = 1.0) -> tuple[Any, ...]:
    """(dataset, batch size) of workload `name`."""
    return _workload(name).make(scale), _workload(name).batch_size
