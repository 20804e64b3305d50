"""pin_memory=True with an accelerator: batches arrive in page-locked memory.

Runs wherever torch sees CUDA (skipped elsewhere); runnable alone on a GPU
machine: ``python -m pytest -q tests/test_pin_memory.py``.  Without an
accelerator the warning path is tested in test_torch_dropin.py."""
from __future__ import annotations

import collections

import numpy as np
import pytest
from extras import deferred

import mxload

torch = deferred("torch")
pytestmark = [pytest.mark.torch, pytest.mark.timeout(180)]


@pytest.fixture(autouse=True)
def _needs_an_accelerator():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (pinned memory needs an accelerator)")

Pair = collections.namedtuple("Pair", "image label")


class Images(mxload.Dataset):
    def __len__(self):
        return 24

    def __getitem__(self, i):
        return {"pair": Pair(np.full((3, 8, 8), i, np.uint8), i), "name": f"img{i}",
                "t": torch.full((4,), float(i))}


def _assert_pinned(batch):
    pair = batch["pair"]
    for arr in (pair.image, pair.label, batch["t"]):
        assert isinstance(arr, np.ndarray)
        assert torch.from_numpy(arr).is_pinned(), "batch array is not in pinned memory"
    assert batch["name"][0].startswith("img")


@pytest.mark.parametrize("mode", ["in-process", "processes", "threads"])
def test_batches_arrive_pinned(mode):
    kw = {"in-process": {}, "processes": {"num_workers": 2},
          "threads": {"num_workers": 2, "thread_pool": True}}
    loader = mxload.DataLoader(Images(), batch_size=4, pin_memory=True, **kw[mode])
    seen = 0
    for i, batch in enumerate(loader):
        _assert_pinned(batch)
        assert batch["pair"].label.tolist() == list(range(4 * i, 4 * i + 4))
        gpu = torch.from_numpy(batch["pair"].image).to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert int(gpu[0, 0, 0, 0]) == 4 * i
        seen += 1
    assert seen == 6


def test_pinned_batches_equal_unpinned():
    plain = [b["pair"].image.copy() for b in mxload.DataLoader(Images(), batch_size=5, num_workers=2)]
    loader = mxload.DataLoader(Images(), batch_size=5, num_workers=2, pin_memory=True)
    pinned = [b["pair"].image for b in loader]
    for a, b in zip(plain, pinned):
        np.testing.assert_array_equal(a, b)


def test_gluon_pin_device_id():
    loader = mxload.DataLoader(Images(), 4, pin_memory=True, pin_device_id=0)
    _assert_pinned(next(iter(loader)))
