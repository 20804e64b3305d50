"""The descriptors the main process owns, which no forked child may keep
(NOTE [ Zygote process tree ], zygote.py: who holds which end).

A child forked from the main process (the zygote, a user's own ``os.fork()``,
a multiprocessing fork child) inherits every descriptor.  Some must not
survive there: the main process's end of a worker's socket or of the zygote's
control socket is how workers and the zygote learn that the main process died
(their peer closes), so a child holding a copy would keep them alive; slab
descriptors would pin shared memory.  Everything registered here is closed in
every forked child, and its socket object detached, so that object's later
finalization in the child can never close an unrelated descriptor that reused
the number.
"""
from __future__ import annotations

import os
import socket

_owned: dict[int, socket.socket | None] = {}


def own(obj: int | socket.socket) -> None:
    """Register a descriptor (or a socket) of the main process."""
    if isinstance(obj, socket.socket):
        _owned[obj.fileno()] = obj
    else:
        _owned[obj] = None


def disown(obj: int | socket.socket) -> None:
    """Forget a descriptor, before its owner closes it."""
    fd = obj.fileno() if isinstance(obj, socket.socket) else obj
    _owned.pop(fd, None)


def close_socket(sock: socket.socket | None) -> None:
    """Disown and close a registered socket (idempotent)."""
    if sock is None:
        return
    if sock.fileno() >= 0:
        disown(sock)
    try:
        sock.close()
    except OSError:
        pass


def close_fd(fd: int) -> None:
    """Disown and close a registered raw descriptor."""
    if fd < 0:
        return
    disown(fd)
    try:
        os.close(fd)
    except OSError:
        pass


def _close_all_in_child() -> None:
    owned = list(_owned.items())
    _owned.clear()
    for fd, sock in owned:
        if sock is not None:
            try:
                sock.detach()
            except OSError:
                pass
        try:
            os.close(fd)
        except OSError:
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_all_in_child)
