"""The cross-process protocol (mxload/_runtime/messages.py): every message
survives a round trip with its descriptors; a cut-short, foreign or
malformed frame is a clear error, never a tuple decoded by position."""
import os
import pickle
import signal
import socket
import struct
import threading

import numpy as np
import pytest
from conftest import asleep_in, wait_until

from mxload import _core
from mxload._runtime import messages as m
from mxload._runtime.local import wire

ERROR = m.ExceptionInfo.of(ValueError("bad sample 3"))
TIMINGS = m.Timings(1, 2, 3, 4, [("x", "stack", 8, (2,), "<f4")], [5])
LAYOUT = (("f", 0), [(0, (2, 2), "<f4")])

EVERY_MESSAGE = [
    m.Task(3, 7, np.arange(4, dtype=np.int64).tobytes(), 2, 65536, (0, 1), True),
    m.Task(0, 0, None),
    m.Stop(),
    m.Batch(1, 2, 5, 16, LAYOUT, TIMINGS),
    m.Batch(1, 2, None, 0, LAYOUT, None),
    m.NewSlab(1, 3, 65536, 16, LAYOUT, None),
    m.Failed(2, 9, ERROR),
    m.Exhausted(2, 10),
    m.InitFailed(ERROR),
    m.StartWorker(1, 4),
    m.Started(1, 12345),
    m.StartFailed(1, "fork: out of memory"),
    m.Exited(12345, -9),
    m.Handover({"sys_path": ["/x"]}, {"worker_id": 0}),
]


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


@pytest.mark.parametrize("message", EVERY_MESSAGE, ids=lambda msg: type(msg).__name__)
def test_every_message_round_trips(pair, message):
    a, b = pair
    wire.send(a, message)
    got, fds = wire.recv(b)
    assert type(got) is type(message) and got == message and fds == []


def test_only_the_types_that_travel_have_a_tag():
    """Thread workers' Loaded and Ray's RemoteBatch/ActorReady never cross a socket: they have
    no tag, and framing one is refused."""
    assert set(wire._TYPES) >= {type(msg) for msg in EVERY_MESSAGE} | {m.BatchRef}
    assert not {m.Loaded, m.RemoteBatch, m.ActorReady} & set(wire._TYPES)
    with pytest.raises(TypeError, match="Loaded never crosses a socket"):
        wire.encode(m.Loaded(1, 4, {"x": [1, 2]}, TIMINGS))


def test_the_layouts_sizes_are_the_cores():
    assert wire.HEADER_SIZE == _core.FRAME_HEADER_SIZE == wire._HEADER.size
    assert wire._HEADER.size + wire._PACKED_TASK.size == _core.TASK_FRAME_FIXED_SIZE
    assert wire.BATCH_REF.size == _core.FRAME_HEADER_SIZE + _core.BATCH_FRAME_SIZE


def test_a_descriptor_travels_in_the_same_frame_as_its_message(pair):
    a, b = pair
    r, w = os.pipe()
    try:
        wire.send(a, m.NewSlab(0, 1, 65536, 8, LAYOUT, None), [w])
        wire.send(a, m.Stop())
        got, fds = wire.recv(b)
        assert isinstance(got, m.NewSlab) and len(fds) == 1
        os.write(fds[0], b"!")   # the received descriptor is the pipe's write end
        os.close(fds[0])
        assert os.read(r, 1) == b"!"
        assert wire.recv(b) == (m.Stop(), [])
    finally:
        os.close(r)
        os.close(w)


def test_the_index_array_is_the_tasks_indices(pair):
    a, b = pair
    indices = np.array([5, 1, 9], dtype=np.int64)
    wire.send(a, m.Task(0, 0, indices.tobytes()))
    got, _ = wire.recv(b)
    assert isinstance(got, m.Task) and got.index_array().tolist() == [5, 1, 9]
    assert m.Task(0, 0, indices).index_array() is indices   # threads: the array itself


def test_a_worker_exception_keeps_its_type_and_traceback():
    try:
        raise KeyError("missing")
    except KeyError as e:
        info = m.ExceptionInfo.of(e)
    assert (info.module, info.qualname, info.message) == ("builtins", "KeyError", "'missing'")
    assert "raise KeyError" in info.traceback
    assert isinstance(pickle.loads(info.pickled), KeyError)


def test_an_exception_that_cannot_be_rebuilt_is_sent_without_its_pickle():
    class Local(Exception):   # a local class pickles by a name nobody can import
        pass
    info = m.ExceptionInfo.of(Local("x"))
    assert info.pickled is None and info.qualname.endswith("Local")


@pytest.mark.parametrize("cut", [0, 3, "header", "payload"])
def test_a_frame_cut_short_is_the_end_of_the_channel(pair, cut):
    a, b = pair
    frame = wire.encode(m.Batch(1, 2, 5, 16, LAYOUT, None))
    keep = {"header": 9, "payload": len(frame) - 1}.get(cut, cut)
    a.sendall(frame[:keep])
    a.close()
    expected = "channel is closed" if keep == 0 else "closed in the middle of a message"
    with pytest.raises(EOFError, match=expected):
        wire.recv(b)


def test_a_foreign_frame_is_a_clear_protocol_error(pair):
    a, b = pair
    a.sendall(b"GET / HTTP/1.1\r\n\r\n")
    with pytest.raises(wire.ProtocolError, match="not an mxload message.*another program, or a worker of "
                                              "another mxload version"):
        wire.recv(b)


def test_a_frame_of_another_protocol_version_is_a_protocol_error(pair):
    a, b = pair
    frame = bytearray(wire.encode(m.Stop()))
    frame[2] = wire.VERSION + 1
    a.sendall(bytes(frame))
    with pytest.raises(wire.ProtocolError, match="protocol version"):
        wire.recv(b)


def test_an_unknown_message_type_is_a_protocol_error(pair):
    a, b = pair
    data = pickle.dumps(())
    a.sendall(struct.pack("<2sBBIB", wire.MAGIC, wire.VERSION, 200, len(data), 0) + data)
    with pytest.raises(wire.ProtocolError, match="type tag"):
        wire.recv(b)


def test_a_payload_that_does_not_fit_its_type_is_a_protocol_error(pair):
    a, b = pair
    frame = wire.encode(m.Exhausted(1, 2))
    data = pickle.dumps((1, 2, 3))   # an Exhausted has two fields
    a.sendall(frame[:4] + struct.pack("<IB", len(data), 0) + data)
    with pytest.raises(wire.ProtocolError,
                       match=r"Exhausted frame carried tuple .*\('epoch', 'batch_index'\)"):
        wire.recv(b)


def test_descriptors_of_a_rejected_frame_are_closed(pair):
    a, b = pair
    r, w = os.pipe()
    try:
        data = pickle.dumps("not a tuple")
        frame = struct.pack("<2sBBIB", wire.MAGIC, wire.VERSION, 3, len(data), 1) + data   # a NewSlab
        before = set(os.listdir("/proc/self/fd"))
        wire.send_encoded(a, frame, [w])
        with pytest.raises(wire.ProtocolError):
            wire.recv(b)
        assert set(os.listdir("/proc/self/fd")) <= before
    finally:
        os.close(r)
        os.close(w)


@pytest.mark.parametrize("task", [
    m.Task(3, 7, np.arange(1024, dtype=np.int64), 2, 65536, (0, 1, 5), True),
    m.Task(3, 7, np.arange(6, dtype=np.int32)[::2], None, 0),       # converted to contiguous int64
    m.Task(1, 2, np.arange(3, dtype=np.int64).tobytes(), 4, 8),
    m.Task(0, 0, None),
])
def test_a_task_sent_without_pickle_arrives_as_the_same_task(task):
    a, b = socket.socketpair()
    r, w = os.pipe()
    try:
        wire.send_task(a, task, [w])
        got, fds = wire.recv(b)
        assert len(fds) == 1
        os.close(fds[0])
        want = None if task.indices is None else np.frombuffer(task.indices, np.int64) \
            if isinstance(task.indices, bytes) else np.asarray(task.indices, np.int64)
        assert isinstance(got, m.Task)
        assert got._replace(indices=None) == task._replace(indices=None, drop_slabs=tuple(task.drop_slabs))
        if want is None:
            assert got.index_array() is None
        else:
            assert got.index_array().tolist() == want.tolist()
    finally:
        for s in (a, b):
            s.close()
        os.close(r)
        os.close(w)


def test_the_compiled_task_frame_is_byte_for_byte_the_documented_layout():
    # Dropped slabs past what the packer keeps on its stack (16) take its heap path.
    indices = np.array([5, -1, 2**40], dtype=np.int64)
    drops = tuple(range(100, 120))
    a, b = socket.socketpair()
    try:
        wire.send_task(a, m.Task(2**33, 9, indices, 7, 1 << 20, drops, True))
        frame = b.recv(65536)
    finally:
        a.close()
        b.close()
    payload = (wire._PACKED_TASK.pack(2**33, 9, 7, 1 << 20, 3, len(drops), len(indices))
               + struct.pack(f"<{len(drops)}q", *drops) + indices.astype("<i8").tobytes())
    header = wire._HEADER.pack(wire.MAGIC, wire.VERSION, wire._PACKED_TASK_TAG, len(payload), 0)
    assert frame == header + payload


@pytest.mark.parametrize("full", [True, False], ids=["nothing_fits", "part_fits"])
def test_a_task_to_a_full_socket_is_finished_blocking_with_its_descriptor(full):
    # A worker that stopped reading: the compiled send gets nothing (or part)
    # out without blocking; the rest, and the slab's descriptor with the
    # frame's first byte, go once the worker reads again.
    a, b = socket.socketpair()
    r, w = os.pipe()
    got = []
    try:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        a.setblocking(False)
        filler = b"\0" * 4096
        try:
            while full:
                a.send(filler)
        except BlockingIOError:
            pass
        a.setblocking(True)
        backlog = 0
        b.setblocking(False)
        try:
            while True:
                backlog += len(b.recv(1 << 20, socket.MSG_PEEK))
                break
        except BlockingIOError:
            pass
        b.setblocking(True)
        sender = threading.get_native_id()
        reader = threading.Thread(target=lambda: got.append(_read_after(b, backlog, sender)))
        reader.start()
        task = m.Task(1, 3, np.arange(100_000, dtype=np.int64), 2, 65536, (4,), False)
        wire.send_task(a, task, [w])
        reader.join(30)
        assert not reader.is_alive()
        (message, fds), = got
        assert len(fds) == 1 and os.path.samestat(os.fstat(fds[0]), os.fstat(w))
        os.close(fds[0])
        assert message._replace(indices=None) == task._replace(indices=None)
        assert message.index_array().tolist() == list(range(100_000))
    finally:
        a.close()
        b.close()
        os.close(r)
        os.close(w)


def _read_after(sock, backlog, sender):
    """Skip the filler queued before the task once thread `sender` waits for room (it found
    the socket full: wire.finish_send's poll()), then take the task."""
    wait_until(lambda: "poll" in asleep_in(os.getpid(), sender), what="the sender waiting for room in poll()")
    skipped = 0
    while skipped < backlog:
        skipped += len(sock.recv(min(65536, backlog - skipped)))
    return wire.recv(sock)


def test_a_task_to_a_worker_that_is_gone_is_an_oserror_not_sigpipe():
    a, b = socket.socketpair()
    b.close()
    previous = signal.signal(signal.SIGPIPE, signal.SIG_DFL)   # as a program that restored it
    try:
        with pytest.raises(BrokenPipeError):
            wire.send_task(a, m.Task(0, 1, np.arange(4, dtype=np.int64)))
    finally:
        signal.signal(signal.SIGPIPE, previous)
        a.close()


class _ManyDrops:
    def __len__(self):
        return 600_000_000


@pytest.mark.parametrize("call,match", [
    (lambda s: _core.send_task(s.fileno(), b"MX", 0, 0, None, False, -1, 0, (), -1),
     "prefix is 4 bytes, got 2"),
    (lambda s: _core.send_task(s.fileno(), b"MX\x01\x10", 0, 0, b"1234567", False, -1, 0, (), -1),
     "7 bytes, not a whole number of int64"),
    (lambda s: wire.send_task(s, m.Task(0, 0, None), [1, 2]), "at most one slab descriptor, got 2"),
    # A frame's length is a uint32: past it, an error rather than a length that wraps.
    (lambda s: _core.send_task(s.fileno(), wire.TASK_PREFIX, 0, 0, None, False, -1, 0, _ManyDrops(), -1),
     "does not fit in one frame"),
])
def test_a_malformed_task_send_is_refused_before_anything_is_sent(call, match):
    a, b = socket.socketpair()
    try:
        with pytest.raises(ValueError, match=match):
            call(a)
        b.setblocking(False)
        with pytest.raises(BlockingIOError):
            b.recv(1)
    finally:
        a.close()
        b.close()


def test_a_packed_task_of_the_wrong_size_is_a_protocol_error():
    a, b = socket.socketpair()
    try:
        wire.send_task(a, m.Task(0, 1, np.arange(4, dtype=np.int64)))
        frame = b.recv(4096)
        header, payload = frame[:wire.HEADER_SIZE], frame[wire.HEADER_SIZE:]
        with pytest.raises(wire.ProtocolError, match="announced 0 dropped slabs and 4 indices"):
            wire.decode(header[:4] + struct.pack("<I", len(payload) - 8) + header[8:], payload[:-8], 0)
    finally:
        a.close()
        b.close()
