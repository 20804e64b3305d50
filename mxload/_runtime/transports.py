"""The one module that names the transports: the transport a backend's workers need.

Above the transports (docs/design.md, "Layers"), only this module imports one: the engine,
the epoch and the autotuner see the seam (transport.py) alone, and the backends
(mxload/backends.py) are configuration.  Each transport is imported when first used (Ray's
only when a RayBackend starts its workers)."""
from __future__ import annotations

from ..backends import Backend, LocalProcesses, LocalThreads, RayBackend
from .transport import Transport, TransportSetup

__all__ = ["make_transport"]


def make_transport(backend: Backend, setup: TransportSetup) -> Transport:
    """The transport for one engine's workers as `backend` says, not started yet."""
    if isinstance(backend, LocalProcesses):
        from .local.transport import ProcessTransport
        return ProcessTransport(setup, backend.start_method)
    if isinstance(backend, LocalThreads):
        from .threads import ThreadTransport
        return ThreadTransport(setup)
    if isinstance(backend, RayBackend):
        from .ray.transport import RayTransport  # imports ray: only here
        return RayTransport(setup, backend)
    transport = backend.make_transport(setup)
    if not isinstance(transport, Transport):
        raise TypeError(f"{type(backend).__name__}.make_transport returned {type(transport).__name__}, "
                        f"not a mxload._runtime.transport.Transport")
    return transport
