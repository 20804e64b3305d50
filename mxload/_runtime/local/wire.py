"""How a message crosses a local worker's socket (the types: ../messages.py).

A frame is a header, the message's fields pickled as a plain tuple (for a BatchRef: five
little-endian int64, see BATCH_REF; for a Task sent by ``send_task``: fixed fields, then the
slabs to drop and the indices as little-endian int64, see _PACKED_TASK), and the frame's
descriptors (SCM_RIGHTS) attached to the same ``sendmsg``: a message and its descriptor
arrive together or not at all, and a frame cut short (the sender died mid-send) reads as the
end of the channel.  The header names the message type, so a frame of another program or
another mxload version is a clear ``ProtocolError`` rather than a tuple decoded by position.
Only the types that travel have a tag.

The main process reads the workers' frames with the compiled receive path
(``_core.FrameReceiver``, csrc/mxl_recv.h): it stores a BatchRef in the ReorderBuffer without
the GIL and hands every other frame to ``decode``.  It is given MAGIC, VERSION and
BATCH_REF_TAG; the header's layout and BatchRef's payload are mirrored there.  It sends each
Task with the compiled send (``_core.send_task``, csrc/mxl_send.h), which packs _PACKED_TASK's
layout itself.  The sizes of the three layouts are read from the core below: a build whose C
and Python layouts differ fails at import (tests/test_messages.py compares them byte for byte).
"""
from __future__ import annotations

import array
import os
import pickle
import select
import socket
import struct
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from ... import _core
from ...errors import SharedMemoryError, WorkerError
from ..messages import (
    Batch,
    BatchRef,
    Exhausted,
    Exited,
    Failed,
    Handover,
    InitFailed,
    Message,
    NewSlab,
    ProtocolError,
    Started,
    StartFailed,
    StartWorker,
    Stop,
    Task,
)
from .slabs import fd_limit_error

__all__ = [
    "MAGIC", "VERSION", "ProtocolError", "BATCH_REF", "BATCH_REF_TAG", "HEADER_SIZE", "TASK_PREFIX",
    "decode", "encode", "finish_send", "recv", "send", "send_encoded", "send_task",
]

MAGIC = b"MX"
VERSION = 2        # 2: only the types that travel have a tag
# magic, protocol version, message type tag, payload bytes, descriptors carried.
_HEADER = struct.Struct("<2sBBIB")
_MAX_FDS = 1       # a frame's descriptors, unless the receiver expects more (recv's max_fds)
# The most descriptors one message can pass (Linux's SCM_MAX_FD; the header's count is a byte).
MAX_FDS_PER_MESSAGE = 253


class PackedTask(NamedTuple):
    """The tag under which send_task sends a Task without pickle (the
    indices as raw int64 straight from their array); decode gives the Task."""


# The tag of each type that travels is its position: append new types, never reorder (or
# change VERSION).
_TYPES: tuple[type[Any], ...] = (Task, Stop, Batch, NewSlab, Failed, Exhausted, InitFailed, StartWorker,
                                 Started, StartFailed, Exited, Handover, BatchRef, PackedTask)
_TAG = {t: i for i, t in enumerate(_TYPES)}
# A PackedTask's fixed fields: epoch, batch index, slab id (-1: none), slab
# size, flags (_PROFILING, _HAS_INDICES), slabs to drop, indices; then the
# dropped slab ids and the indices, int64 each.
_PACKED_TASK = struct.Struct("<qqqqBxxxII")
_PROFILING, _HAS_INDICES = 1, 2
_PACKED_TASK_TAG = _TAG[PackedTask]
# Every send of mxload's: a peer that is gone (a dead worker or zygote, a
# main process that died) is EPIPE, never SIGPIPE, which kills a program
# that restored SIGPIPE's default action (as command-line tools do) with
# status 141 and no traceback.  The compiled sends (mxl_send.h) pass it too.
NO_SIGPIPE = getattr(socket, "MSG_NOSIGNAL", 0)

# What the compiled send puts before a PackedTask's length (mxl_send.h packs the rest).
TASK_PREFIX = MAGIC + bytes([VERSION, _PACKED_TASK_TAG])
HEADER_SIZE = _core.FRAME_HEADER_SIZE
BATCH_REF_TAG = _TAG[BatchRef]
# A whole BatchRef frame: the header, then epoch, batch index, slab id, bytes, layout id.
BATCH_REF = struct.Struct("<2sBBIB5q")
_BATCH_REF_PAYLOAD = struct.Struct("<5q")
if (_HEADER.size, _BATCH_REF_PAYLOAD.size, _HEADER.size + _PACKED_TASK.size) != (
        _core.FRAME_HEADER_SIZE, _core.BATCH_FRAME_SIZE, _core.TASK_FRAME_FIXED_SIZE):
    raise ImportError(
        f"mxload's compiled core frames messages with other layouts than mxload/_runtime/local/wire.py "
        f"(header {_core.FRAME_HEADER_SIZE}, BatchRef {_core.BATCH_FRAME_SIZE}, task "
        f"{_core.TASK_FRAME_FIXED_SIZE} bytes): it was built from other sources; reinstall mxload")


def encode(message: Message, nfds: int = 0) -> bytes:
    """The frame of `message` (header and payload) for `nfds` descriptors."""
    if type(message) is BatchRef:
        return BATCH_REF.pack(MAGIC, VERSION, BATCH_REF_TAG, _BATCH_REF_PAYLOAD.size, 0, *message)
    tag = _TAG.get(type(message))
    if tag is None:
        raise TypeError(f"a {type(message).__name__} never crosses a socket (it has no tag in wire._TYPES)")
    data = pickle.dumps(tuple(message), protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(MAGIC, VERSION, tag, len(data), nfds) + data


def send_task(sock: socket.socket, task: Task, fds: list[int] | tuple[int, ...] = (),
              timeout: float | None = None, give_up: Callable[[], bool] | None = None) -> bool:
    """Send a Task without pickling it: its frame is packed and sent by the
    compiled core, its indices (an int64 array, or None for a stream) straight
    from their memory; `fds`: at most one, the descriptor of the task's slab.
    A full socket (a worker that stopped reading) is finished by finish_send.
    (The engine's per-batch send is _core.send_tasks: the same frames.)"""
    if len(fds) > 1:
        raise ValueError(f"a task passes at most one slab descriptor, got {len(fds)}")
    slab_fd = fds[0] if fds else -1
    unsent = _core.send_task(sock.fileno(), TASK_PREFIX, task.epoch, task.batch_index, task.indices,
                             task.profiling, -1 if task.slab_id is None else task.slab_id, task.slab_size,
                             task.drop_slabs, slab_fd)
    if unsent is None:
        return True
    rest, fd_left = unsent
    return finish_send(sock, memoryview(rest), fd_left, timeout, give_up)


# How often a send waiting for a worker to read checks whether to give up.
SEND_POLL_S = 0.05


def finish_send(sock: socket.socket, rest: memoryview, slab_fd: int, timeout: float | None,
                give_up: Callable[[], bool] | None) -> bool:
    """The rest of a task's frame the compiled send left (the socket was
    full), sent as the worker reads it, `slab_fd` (-1: none) with its first
    byte, GIL released while it waits; never blocked for longer than
    SEND_POLL_S at a time, so that whoever holds the engine lock meanwhile
    lets a shutdown through.

    False if `give_up()` said so first (the frame is then cut short, so
    nothing more may follow on `sock`).  TimeoutError if the worker read
    none of the rest for `timeout` s."""
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLOUT)
    waited_since = time.monotonic()
    while rest:
        if give_up is not None and give_up():
            return False
        if not poller.poll(SEND_POLL_S * 1000):
            if timeout is not None and time.monotonic() - waited_since > timeout:
                raise TimeoutError(f"the worker read none of its task for {timeout} s")
            continue
        try:
            if slab_fd >= 0:
                ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [slab_fd]))]
                sent = sock.sendmsg([rest], ancillary, socket.MSG_DONTWAIT | NO_SIGPIPE)
                slab_fd = -1
            else:
                sent = sock.send(rest, socket.MSG_DONTWAIT | NO_SIGPIPE)
        except BlockingIOError:
            continue
        rest = rest[sent:]
        waited_since = time.monotonic()
    return True


def _unpack_task(data: bytes) -> Task:
    if len(data) < _PACKED_TASK.size:
        raise ProtocolError(f"a packed Task of {len(data)} bytes, less than its {_PACKED_TASK.size} fixed")
    epoch, idx, slab_id, slab_size, flags, ndrops, n = _PACKED_TASK.unpack_from(data)
    at = _PACKED_TASK.size
    if len(data) != at + 8 * (ndrops + n):
        raise ProtocolError(f"a packed Task of {len(data)} bytes announced {ndrops} dropped slabs and "
                            f"{n} indices")
    drops = struct.unpack_from(f"<{ndrops}q", data, at) if ndrops else ()
    at += 8 * ndrops
    return Task(epoch, idx, data[at:] if flags & _HAS_INDICES else None, None if slab_id < 0 else slab_id,
                slab_size, tuple(drops), bool(flags & _PROFILING))


def send(sock: socket.socket, message: Message, fds: list[int] | tuple[int, ...] = ()) -> None:
    """Send one message with its descriptors, in one sendmsg."""
    send_encoded(sock, encode(message, len(fds)), fds)


def send_encoded(sock: socket.socket, frame: bytes, fds: list[int] | tuple[int, ...] = ()) -> None:
    """send() of a frame already encoded (a worker encodes inside its
    batch's try: an unpicklable object is that batch's error)."""
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sent = sock.sendmsg([frame], ancillary, NO_SIGPIPE)
    if sent < len(frame):   # a signal interrupted a large send: the descriptors went with the first part
        sock.sendall(memoryview(frame)[sent:], NO_SIGPIPE)


def recv(sock: socket.socket, carrying: str = "a shared-memory slab's descriptor",
         error_type: type[WorkerError] = SharedMemoryError,
         max_fds: int = _MAX_FDS) -> tuple[Message, list[int]]:
    """One message and the descriptors that came with it (at most
    `max_fds`).  EOFError if the channel is closed or the frame is cut
    short; ProtocolError for a frame that is not this protocol's;
    `error_type` (naming what the descriptors are: `carrying`) if this
    process had no room for them (RLIMIT_NOFILE).
    Anything unpickling the payload raises (a class the receiver cannot
    import) propagates."""
    fds: list[int] = []
    truncated: list[bool] = []
    try:
        header = _recv_exact(sock, _HEADER.size, fds, False, truncated, max_fds)
        _, _, _, length, nfds = _check_header(header)
        data = _recv_exact(sock, length, fds, True, truncated, max_fds)
        if truncated:
            # The whole frame was read (the channel stays in step); the
            # descriptors did not fit.  The message goes with the error, for
            # a receiver that answers it (the zygote: which worker failed).
            error = fd_limit_error(f"receiving {carrying}", error_type)
            error.frame_message = decode(header, data, nfds)   # type: ignore[attr-defined]
            raise error
        return decode(header, data, len(fds)), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _check_header(header: bytes) -> tuple[bytes, int, int, int, int]:
    magic, version, tag, length, nfds = _HEADER.unpack(header)
    if magic != MAGIC or version != VERSION or tag >= len(_TYPES):
        raise ProtocolError(
            f"received a frame that is not an mxload message (header {header!r}; expected magic "
            f"{MAGIC!r}, protocol version {VERSION}, a type tag below {len(_TYPES)}): the peer is "
            f"another program, or a worker of another mxload version")
    return magic, version, tag, length, nfds


def decode(header: bytes, data: bytes, fds_carried: int) -> Message:
    """The message of one whole frame (its header, its payload, and how many
    descriptors came with it).  Raises as recv() does."""
    _, _, tag, length, nfds = _check_header(header)
    if len(data) != length:
        raise EOFError(f"a frame announced {length} bytes and carried {len(data)}")
    if fds_carried != nfds:
        raise EOFError(f"a frame announced {nfds} descriptors and carried {fds_carried}")
    kind = _TYPES[tag]
    if kind is PackedTask:
        return _unpack_task(data)
    if kind is BatchRef:
        if length != _BATCH_REF_PAYLOAD.size:
            raise ProtocolError(f"a BatchRef frame of {length} bytes, not {_BATCH_REF_PAYLOAD.size}")
        return BatchRef._make(_BATCH_REF_PAYLOAD.unpack(data))
    fields = pickle.loads(data)
    if not isinstance(fields, tuple) or len(fields) != len(kind._fields):
        raise ProtocolError(f"a {kind.__name__} frame carried {type(fields).__name__} "
                            f"{fields!r:.200}, not the {len(kind._fields)} fields {kind._fields}")
    message: Message = kind._make(fields)
    return message


def _recv_exact(sock: socket.socket, n: int, fds: list[int], frame_started: bool,
                truncated: list[bool], max_fds: int) -> bytes:
    """`n` bytes of a frame, the descriptors that come with them added to
    `fds`; True appended to `truncated` if some did not fit here."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        nbytes, ancillary, flags, _ = sock.recvmsg_into([view[got:]], socket.CMSG_SPACE(4 * max_fds),
                                                        socket.MSG_CMSG_CLOEXEC)
        for level, kind, cdata in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.extend(array.array("i", cdata[:len(cdata) - len(cdata) % 4]))
        if flags & socket.MSG_CTRUNC:
            truncated.append(True)
        if nbytes == 0:
            if got or frame_started:
                raise EOFError("the channel closed in the middle of a message")
            raise EOFError("the channel is closed")
        got += nbytes
    return bytes(buf)
