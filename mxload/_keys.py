"""A sampler's key as a task carries it (batch_size=None, torch's no-auto-batching mode): the
sampler encodes it where it yields it (sampler.py), a worker decodes it (_runtime/source.py).
A leaf: both sides import it, neither imports the other."""
from __future__ import annotations

import pickle
from typing import Any

import numpy as np

__all__ = ["encode_key", "decode_key"]

# batch_size=None ("bulk loading", torch's no-auto-batching mode) passes each
# key the sampler yields to dataset[...] as it is: a list of indices, a slice,
# any picklable object.  A key travels as a task's int64 indices like any
# batch: an integer key is the one-index batch [key], any other is pickled
# behind this tag and its byte count (so never one word long).
_KEY_TAG = 0x6B6579   # "key"


def encode_key(key: Any) -> np.ndarray:
    """A sampler's non-integer key as the int64 words a task carries."""
    data = pickle.dumps(key, protocol=pickle.HIGHEST_PROTOCOL)
    words = np.zeros(2 + -(-len(data) // 8), np.int64)
    words[0], words[1] = _KEY_TAG, len(data)
    words[2:].view(np.uint8)[:len(data)] = np.frombuffer(data, np.uint8)
    return words


def decode_key(words: np.ndarray) -> Any:
    """The key a bulk-loading task's indices stand for (see encode_key)."""
    if len(words) == 1:
        return int(words[0])
    if len(words) < 2 or int(words[0]) != _KEY_TAG:
        raise ValueError(f"a batch_size=None task holds {len(words)} indices, not one key")
    n = int(words[1])
    return pickle.loads(np.ascontiguousarray(words[2:]).view(np.uint8)[:n].tobytes())
