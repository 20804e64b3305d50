"""Where a loader's workers run: local processes or threads (the default), or
Ray actors anywhere in a Ray cluster (:class:`RayBackend`, the ``mxload[ray]``
extra).  This module never imports ray: only starting Ray workers does."""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RayBackend", "resolve_backend"]


@dataclass(frozen=True)
class RayBackend:
    """Run a loader's workers as Ray actors (``DataLoader(..., backend=RayBackend(...))``;
    ``backend="ray"`` is ``RayBackend()``).

    Each of the loader's ``num_workers`` workers is one actor, placed by Ray
    anywhere in the cluster (also on nodes without the training process).  An
    actor gets the dataset once, loads and collates whole batches with
    mxload's compiled kernels into one buffer, and returns it through Ray's
    object store: on the trainer's node the batch's arrays are views of the
    object store's copy, as they are views of a shared-memory slab with local
    workers.  Everything else (samplers, ``in_order``, ``prefetch``,
    ``sample_rng()``, checkpoints, the profiler, ``max_worker_restarts``,
    ``timeout``) behaves as with local workers.

    Args:
        address (str | None): the cluster to join when this process is not
            connected to Ray yet (``ray.init(address=...)``); ``None`` joins
            the current connection, or starts a local Ray instance (without
            its dashboard) when there is none.
        num_cpus_per_worker (float): CPUs each actor reserves in Ray's
            scheduler. Default ``1``.
        resources (Mapping[str, float] | None): custom Ray resources each
            actor needs (e.g. ``{"preprocess": 1}`` to place the actors on the
            nodes that offer it).
        runtime_env (Mapping | None): the actors' Ray runtime environment
            (e.g. ``{"working_dir": "."}`` or ``{"py_modules": [...]}`` to
            ship the dataset's code to nodes that do not have it).

    Raises:
        ValueError: a negative or non-finite CPU count, or a resource that is
            not a non-negative number.

    Example:
        >>> import mxload
        >>> mxload.RayBackend(num_cpus_per_worker=0.5, resources={"preprocess": 1})
        RayBackend(address=None, num_cpus_per_worker=0.5, resources={'preprocess': 1}, runtime_env=None)
    """

    address: str | None = None
    num_cpus_per_worker: float = 1
    resources: Mapping[str, float] | None = field(default=None)
    runtime_env: Mapping[str, Any] | None = field(default=None)

    def __post_init__(self) -> None:
        if self.address is not None and not isinstance(self.address, str):
            raise ValueError(f"RayBackend address must be a string or None, got {self.address!r}")
        cpus = self.num_cpus_per_worker
        if isinstance(cpus, bool) or not isinstance(cpus, (int, float)) or not math.isfinite(cpus) \
                or cpus < 0:
            raise ValueError(f"RayBackend num_cpus_per_worker must be a non-negative number, got {cpus!r}")
        if self.resources is not None:
            if not isinstance(self.resources, Mapping):
                raise ValueError(f"RayBackend resources must be a mapping of resource name to amount, "
                                 f"got {type(self.resources).__name__}")
            for name, amount in self.resources.items():
                if not isinstance(name, str) or isinstance(amount, bool) \
                        or not isinstance(amount, (int, float)) or not math.isfinite(amount) or amount < 0:
                    raise ValueError(f"RayBackend resources: {name!r}: {amount!r} is not a resource name "
                                     f"with a non-negative amount")
        if self.runtime_env is not None and not isinstance(self.runtime_env, Mapping):
            raise ValueError(f"RayBackend runtime_env must be a mapping (Ray's runtime_env), "
                             f"got {type(self.runtime_env).__name__}")


def resolve_backend(backend: Any) -> RayBackend | None:
    """The DataLoader's `backend` argument: None (local processes or threads),
    or the RayBackend it names."""
    if backend is None or (isinstance(backend, str) and backend == "local"):
        return None
    if isinstance(backend, str) and backend == "ray":
        return RayBackend()
    if isinstance(backend, RayBackend):
        return backend
    raise ValueError(f"backend must be None (local worker processes or threads), 'ray' or a "
                     f"mxload.RayBackend(...), got {backend!r}")
