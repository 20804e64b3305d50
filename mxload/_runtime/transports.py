"""The one module that names the transports: the transport a backend's workers need.

Above the transports (docs/design.md, "Layers"), only this module imports one: the engine,
the epoch and the autotuner see the seam (transport.py) alone, and the backends
(mxload/backends.py) are configuration.  Each transport is imported when first used (Ray's
only when a RayBackend starts its workers)."""
from __future__ import annotations

from ..backends import Backend, BuiltInBackend, LocalProcesses, LocalThreads, RayBackend
from .transport import Transport, TransportSetup

__all__ = ["make_transport"]


def make_transport(backend: Backend, setup: TransportSetup) -> Transport:
    """The transport for one engine's workers as `backend` says, not started yet: mxload's
    own backends' from here, any other's (or a subclass's that makes its own) from its
    make_transport."""
    if type(backend).make_transport is not BuiltInBackend.make_transport:
        transport: Transport = backend.make_transport(setup)
        return transport
    if isinstance(backend, LocalProcesses):
        from .local.transport import ProcessTransport
        return ProcessTransport(setup, backend.start_method)
    if isinstance(backend, LocalThreads):
        from .threads import ThreadTransport
        return ThreadTransport(setup)
    if isinstance(backend, RayBackend):
        from .ray.transport import RayTransport  # imports ray: only here
        return RayTransport(setup, backend)
    raise TypeError(f"{type(backend).__name__} is none of mxload's backends and makes no transport")
