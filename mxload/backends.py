"""Where a loader's workers run: local processes or threads (the default), or
Ray actors anywhere in a Ray cluster (:class:`RayBackend`, the ``mxload[ray]``
extra).  This module never imports ray: only starting Ray workers does.

A backend is configuration: it says where workers run, and names no transport.
The one runtime module that names the transports (``mxload/_runtime/transports.py``)
makes the built-in backends' transports; a backend of your own makes its transport
itself (``Backend.make_transport``): a new kind of worker is one transport module
and its backend class (tests/test_backends.py plugs in one of its own)."""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Backend", "LocalProcesses", "LocalThreads", "RayBackend", "resolve_backend", "workers_backend"]


class Backend(ABC):
    """Where a loader's workers run.  ``backend=`` takes an instance of a subclass
    (or ``"ray"``); the engine asks it for the transport that serves one engine's
    workers (the contract: ``mxload._runtime.transport.Transport``)."""

    @abstractmethod
    def make_transport(self, setup: Any) -> Any:
        """The transport for one engine's workers, not started yet: a
        ``mxload._runtime.transport.Transport`` made from the
        ``TransportSetup`` `setup` (typed loosely here: this module is
        configuration and imports nothing of the runtime; the engine checks
        what it gets)."""


class BuiltInBackend(Backend):
    """mxload's own backends: the runtime makes their transports (_runtime/transports.py)."""

    def make_transport(self, setup: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__}'s transport is made by mxload's runtime "
                                  f"(mxload._runtime.transports.make_transport)")


@dataclass(frozen=True)
class LocalProcesses(BuiltInBackend):
    """Worker processes on this machine (the default), started with `start_method`
    (None: the platform's default)."""
    start_method: str | None = None


@dataclass(frozen=True)
class LocalThreads(BuiltInBackend):
    """Worker threads in the training process (``thread_pool=True``)."""


@dataclass(frozen=True)
class RayBackend(BuiltInBackend):
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

    def actor_options(self) -> dict[str, Any]:
        """Ray's options for each worker actor: what it reserves, its runtime_env; no restart or
        retry by Ray (the loader restarts workers itself, and sends their tasks again)."""
        options: dict[str, Any] = {"num_cpus": self.num_cpus_per_worker, "max_restarts": 0,
                                   "max_task_retries": 0, "max_concurrency": 1}
        if self.resources:
            options["resources"] = dict(self.resources)
        if self.runtime_env:
            options["runtime_env"] = dict(self.runtime_env)
        return options


def resolve_backend(backend: Any) -> Backend | None:
    """The DataLoader's `backend` argument: None (local processes or threads,
    chosen by `thread_pool` and `start_method`), or the Backend it names."""
    if backend is None or (isinstance(backend, str) and backend == "local"):
        return None
    if isinstance(backend, str) and backend == "ray":
        return RayBackend()
    if isinstance(backend, Backend):
        return backend
    raise ValueError(f"backend must be None (local worker processes or threads), 'ray' or a "
                     f"mxload.RayBackend(...) (any mxload.backends.Backend), got {backend!r}")


def workers_backend(backend: Backend | None, thread_pool: bool, start_method: str | None) -> Backend:
    """The backend that runs a loader's workers: the one passed, else local threads
    (`thread_pool`) or processes."""
    if backend is not None:
        return backend
    return LocalThreads() if thread_pool else LocalProcesses(start_method)
