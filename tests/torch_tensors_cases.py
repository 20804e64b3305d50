"""The torch dataset of test_torch_tensors.py, in a module of its own: the test module imports
torch only when a test first uses it (NOTE [ torch last ] in conftest.py)."""
from __future__ import annotations

import collections

import torch
from torch.utils.data import Dataset

N = 12


Pair = collections.namedtuple("Pair", "a b")


class EveryDtype(Dataset):
    """Samples as torch users write them: nested dicts, tuples and a
    namedtuple of tensors of every kind, some of them views that are not
    contiguous (a transposed slice, a conjugate, a negative view), numbers
    and strings beside them."""

    def __init__(self, grad: bool = False):
        g = torch.Generator().manual_seed(5)
        self.base = torch.randn(N, 4, 3, generator=g)
        self.weight = torch.full((3,), 2.0, requires_grad=grad)

    def __len__(self):
        return N

    def __getitem__(self, i):
        x = self.base[i]
        c = torch.complex(x, -x)
        return {
            "bf16": x.to(torch.bfloat16),
            "f16": x.to(torch.float16),
            "mask": x > 0,
            "c64": c,
            "c128": c.to(torch.complex128).conj(),      # a lazy conjugate view
            "neg": torch.complex(x, x)._neg_view(),     # a lazy negative view
            "t": x.t(),                                  # not contiguous
            "strided": self.base[:, i % 4, ::2],         # not contiguous, offset
            "u8": (x * 10).to(torch.uint8),
            "grad": x[0] * self.weight,                  # autograd history when grad=True
            "nested": (x[1].to(torch.int16), Pair(x[2].to(torch.bfloat16), torch.tensor(i))),
            "label": i,
            "name": f"s{i}",
        }
