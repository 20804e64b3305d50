"""The compiled receive path (csrc/receive.pxi, mxl_recv.h): frames read and
batches stored in the ReorderBuffer without the GIL, everything else handed
to Python intact, ends of channels and processes reported."""
from __future__ import annotations

import os
import socket
import struct
import threading
import time

import numpy as np
import pytest
from conftest import once_and_as_race, race_rounds, tries

from mxload import _core
from mxload._runtime import messages as m
from mxload._runtime.local import wire

HEADER = struct.Struct("<2sBBIB")   # messages.py's header
BATCH = struct.Struct("<5q")        # a BatchRef's payload
PICKLED = 0                         # any tag but BatchRef's (Task's)


def batch_frame(epoch: int, idx: int, slab_id: int = 0, nbytes: int = 0, layout_id: int = 0) -> bytes:
    return wire.encode(m.BatchRef(epoch, idx, slab_id, nbytes, layout_id))


def pickled_frame(payload: bytes, nfds: int = 0) -> bytes:
    return HEADER.pack(wire.MAGIC, wire.VERSION, PICKLED, len(payload), nfds) + payload


def receiver(slots: int, wake_fd: int, rb: _core.ReorderBuffer) -> _core.FrameReceiver:
    return _core.FrameReceiver(slots, wake_fd, rb, wire.MAGIC, wire.VERSION, wire.BATCH_REF_TAG)


@pytest.fixture
def chan():
    """(receiver, buffer, worker-side socket, wake write fd) for one slot."""
    main, worker = socket.socketpair()
    wake_r, wake_w = os.pipe()
    rb = _core.ReorderBuffer()
    rcv = receiver(1, wake_r, rb)
    rcv.attach(0, main.fileno(), -1)
    rb.start_epoch(3)
    yield rcv, rb, worker, wake_w
    rcv.close()
    for s in (main, worker):
        s.close()
    os.close(wake_r)
    os.close(wake_w)


def test_formats_agree_with_the_c_side():
    """mxl_recv.h mirrors messages.py's header and BatchRef payload."""
    assert _core.FRAME_HEADER_SIZE == wire.HEADER_SIZE == HEADER.size
    assert _core.BATCH_FRAME_SIZE == BATCH.size == wire.BATCH_REF.size - wire.HEADER_SIZE
    frame = batch_frame(7, 8, 9, 10, 11)
    assert HEADER.unpack(frame[:HEADER.size]) == (wire.MAGIC, wire.VERSION, wire.BATCH_REF_TAG, BATCH.size, 0)
    assert wire.decode(frame[:HEADER.size], frame[HEADER.size:], 0) == m.BatchRef(7, 8, 9, 10, 11)


def test_batch_frames_are_stored_without_waking_python(chan):
    rcv, rb, worker, _ = chan
    worker.sendall(b"".join(batch_frame(3, i, slab_id=10 + i, nbytes=100 * i, layout_id=7)
                            for i in range(50)))
    ev, slot = rcv.wait(0.2)
    assert (ev, slot) == (_core.EV_TIMEOUT, -1)
    assert len(rb) == 50 and 49 in rb and 50 not in rb
    got = rb.get(17, timeout=1)
    assert isinstance(got, _core.RawBatch)
    assert (got.slot, got.epoch, got.idx, got.slab_id, got.nbytes, got.layout_id) == (0, 3, 17, 27, 1700, 7)
    assert [rb.pop_next(timeout=1)[0] for _ in range(49)] == [i for i in range(50) if i != 17]
    assert rcv.stats()["stored"] == 50 and rcv.stats()["passed_up"] == 0


def test_other_frames_go_to_python_in_order(chan):
    rcv, rb, worker, _ = chan
    worker.sendall(batch_frame(3, 0) + pickled_frame(b"hello") + batch_frame(3, 1) + batch_frame(2, 5))
    assert rcv.wait(1) == (_core.EV_FRAME, 0)
    assert 0 in rb and 1 not in rb          # frames after it wait for Python
    assert rcv.wait(1) == (_core.EV_FRAME, 0)   # level-triggered: not taken yet
    assert rcv.take_frame(0) == (pickled_frame(b"hello")[:HEADER.size], b"hello", [])
    assert rcv.wait(1) == (_core.EV_FRAME, 0)   # a batch of another epoch
    header, payload, fds = rcv.take_frame(0)
    assert wire.decode(header, payload, len(fds)) == m.BatchRef(2, 5, 0, 0, 0)
    assert 1 in rb
    with pytest.raises(LookupError):
        rcv.take_frame(0)


def test_descriptors_arrive_with_their_frame(chan):
    rcv, _, worker, _ = chan
    r, w = os.pipe()
    try:
        data = pickled_frame(b"x" * 100, nfds=1)
        socket.socket.sendmsg(worker, [data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", w))])
        assert rcv.wait(1) == (_core.EV_FRAME, 0)
        _, payload, fds = rcv.take_frame(0)
        assert payload == b"x" * 100 and len(fds) == 1
        os.write(fds[0], b"!")
        os.close(fds[0])
        assert os.read(r, 1) == b"!"
    finally:
        os.close(r)
        os.close(w)


def test_a_frame_missing_its_descriptor_is_an_error(chan):
    rcv, _, worker, _ = chan
    worker.sendall(pickled_frame(b"abc", nfds=1))
    assert rcv.wait(1) == (_core.EV_FRAME, 0)
    with pytest.raises(EOFError, match="announced 1 descriptors and carried 0"):
        rcv.take_frame(0)


def test_a_large_frame_sent_in_pieces(chan):
    rcv, _, worker, _ = chan
    payload = os.urandom(3_000_000)
    data = pickled_frame(payload)

    def send():
        for i in range(0, len(data), 100_000):
            worker.sendall(data[i:i + 100_000])
            time.sleep(0.001)
    t = threading.Thread(target=send)
    t.start()
    try:
        assert rcv.wait(10) == (_core.EV_FRAME, 0)
        assert rcv.take_frame(0)[1:] == (payload, [])
    finally:
        t.join()


def test_closed_buffer_and_duplicates_go_to_python(chan):
    rcv, rb, worker, _ = chan
    worker.sendall(batch_frame(3, 4) + batch_frame(3, 4))
    assert rcv.wait(1) == (_core.EV_FRAME, 0)   # the same index twice
    assert rcv.take_frame(0)[0][3] == wire.BATCH_REF_TAG
    rb.close("done")
    worker.sendall(batch_frame(3, 5))
    assert rcv.wait(1) == (_core.EV_FRAME, 0)
    assert BATCH.unpack(rcv.take_frame(0)[1])[1] == 5


def test_end_of_channel(chan):
    rcv, _, worker, _ = chan
    worker.sendall(batch_frame(3, 0)[:10])   # cut short: the worker died mid-send
    worker.shutdown(socket.SHUT_WR)
    assert rcv.wait(1) == (_core.EV_CLOSED, 0)


def test_wake_and_timeout(chan):
    rcv, _, _, wake_w = chan
    t0 = time.monotonic()
    assert rcv.wait(0.05) == (_core.EV_TIMEOUT, -1)
    assert 0.04 < time.monotonic() - t0 < 5
    os.write(wake_w, b"x")
    assert rcv.wait(5) == (_core.EV_WAKE, -1)
    assert rcv.wait(0) == (_core.EV_WAKE, -1)    # until the caller reads the pipe
    wake_r = os.open(f"/proc/self/fd/{wake_w}", os.O_RDONLY | os.O_NONBLOCK)
    try:
        os.read(wake_r, 64)
    finally:
        os.close(wake_r)
    timer = threading.Timer(0.05, os.write, (wake_w, b"x"))
    t0 = time.monotonic()   # before the timer starts: a test preempted meanwhile cannot shorten the wait
    timer.start()
    assert rcv.wait(5) == (_core.EV_WAKE, -1)
    assert time.monotonic() - t0 >= 0.05
    timer.join()


@pytest.fixture
def ended_worker():
    """(receiver, buffer, worker-side socket, end) for a worker in slot 1
    tagged 9, whose sentinel is a pipe: end() makes it ready, as the
    worker's process ending would."""
    main, worker = socket.socketpair()
    sentinel_r, sentinel_w = os.pipe()
    rb = _core.ReorderBuffer()
    rcv = receiver(2, -1, rb)
    rcv.attach(1, main.fileno(), sentinel_r, tag=9)
    rb.start_epoch(0)
    ended = []

    def end():
        os.close(sentinel_w)
        ended.append(True)
    yield rcv, rb, worker, end
    rcv.close()
    main.close()
    worker.close()
    os.close(sentinel_r)
    if not ended:
        os.close(sentinel_w)


def test_an_ended_process_has_its_frames_taken_first(ended_worker):
    rcv, rb, worker, end = ended_worker
    worker.sendall(batch_frame(0, 0) + batch_frame(0, 1))
    end()   # the process "ended"; its socket end is still open (e.g. a grandchild)
    assert rcv.wait(1) == (_core.EV_ENDED, 1)
    assert 0 in rb and 1 in rb


def test_slots_are_checked():
    rcv = receiver(2, -1, _core.ReorderBuffer())
    with pytest.raises(IndexError, match="slot 2"):
        rcv.attach(2, 0, -1)
    with pytest.raises(ValueError):
        receiver(-1, -1, _core.ReorderBuffer())
    with pytest.raises(ValueError, match="2 magic bytes"):
        _core.FrameReceiver(1, -1, _core.ReorderBuffer(), b"MXL", 1, 13)


def test_raw_and_python_items_mix(chan):
    rcv, rb, worker, _ = chan
    rb.put(2, "two")
    rb.put(5, "five")
    worker.sendall(batch_frame(3, 1) + batch_frame(3, 3) + batch_frame(3, 9))
    rcv.wait(0.1)
    assert len(rb) == 5
    order = [rb.pop_next(timeout=1) for _ in range(3)]
    assert [i for i, _ in order] == [1, 2, 3]
    assert isinstance(order[0][1], _core.RawBatch) and order[1][1] == "two"
    left = rb.clear()
    assert sorted(left) == [5, 9] and left[9].idx == 9 and len(rb) == 0
    assert rb.try_get(9, "none") == "none"


def test_gil_time_is_counted_between_waits(chan):
    rcv, _, _, _ = chan
    rcv.wait(0)
    t0 = time.perf_counter_ns()
    while time.perf_counter_ns() - t0 < 20_000_000:
        pass
    rcv.wait(0)
    assert rcv.stats()["gil_ns"] >= 15_000_000
    rcv.end_gil_span()
    time.sleep(0.05)
    before = rcv.stats()["gil_ns"]
    rcv.wait(0)
    assert rcv.stats()["gil_ns"] == before


@pytest.mark.parametrize("rounds", once_and_as_race(50))
@pytest.mark.parametrize("senders", [1, 2])
def test_concurrent_batches_reach_a_waiting_consumer(senders, rounds):
    """A receiver thread storing while the consumer waits in get(): every
    batch arrives once, none is lost between a look and a sleep (50 rounds in the races tier)."""
    for _ in range(tries(rounds)):
        _concurrent_round(senders, 200, lambda rcv: rcv.wait(0.01), lambda rcv, rb, i: rb.get(i, timeout=10))


def _concurrent_round(senders: int, n: int, background, take) -> None:
    """`senders` threads send batch frames 0..n-1 (frame i from sender i %
    senders, tagged so) while a thread calls background(rcv) in a loop;
    take(rcv, rb, i) must return batch i, exactly once each."""
    socks = [socket.socketpair() for _ in range(senders)]
    rb = _core.ReorderBuffer()
    rcv = receiver(senders, -1, rb)
    rb.start_epoch(1)
    for k, (main, _) in enumerate(socks):
        rcv.attach(k, main.fileno(), -1, tag=k)
    stop = threading.Event()

    def run_background():
        while not stop.is_set():
            background(rcv)

    def send(k):
        for i in range(k, n, senders):
            socks[k][1].sendall(batch_frame(1, i))
    threads = [threading.Thread(target=run_background)] + [threading.Thread(target=send, args=(k,))
                                                           for k in range(senders)]
    for t in threads:
        t.start()
    try:
        got = [take(rcv, rb, i) for i in range(n)]
        assert [(b.idx, b.tag) for b in got] == [(i, i % senders) for i in range(n)]
        assert len(rb) == 0
    finally:
        stop.set()
        for t in threads:
            t.join()
        rcv.close()
        for main, worker in socks:
            main.close()
            worker.close()


def test_build_views_over_a_batch_owner():
    fd = os.memfd_create("mxload-slab-test")
    try:
        os.ftruncate(fd, 4096)
        slab = _core.Slab(fd, 4096, 0)
    finally:
        os.close(fd)
    released = []
    owner = _core.BatchOwner(slab, 64, 1024, released.append)
    np.frombuffer(owner, np.uint8)[:] = np.arange(1024) % 251
    specs = [(0, (4, 8), np.dtype(np.float32)), (128, (3,), np.dtype("<i8")), (512, (), np.dtype(np.uint8))]
    a, b, c = _core.build_views(owner, specs)
    assert a.shape == (4, 8) and a.dtype == np.float32 and a.base is owner and a.flags.writeable
    whole = np.frombuffer(owner, np.uint8)
    assert a.view(np.uint8).ravel().tolist() == whole[:128].tolist()
    assert b.view(np.uint8).tolist() == whole[128:152].tolist()
    assert c.shape == () and int(c) == whole[512]
    with pytest.raises(ValueError, match="outside the batch's 1024 bytes"):
        _core.build_views(owner, [(1000, (8,), np.dtype(np.float32))])
    del a, b, c, whole, owner
    assert released == [slab]


def test_raw_batches_of_another_epoch_or_worker():
    main, worker = socket.socketpair()
    rb = _core.ReorderBuffer()
    rcv = receiver(2, -1, rb)
    try:
        rcv.attach(0, main.fileno(), -1, tag=41)
        rb.start_epoch(1)
        worker.sendall(batch_frame(1, 0) + batch_frame(1, 1))
        rcv.wait(0.05)
        assert len(rb) == 2 and rb.get(0, timeout=1).tag == 41
        left = rb.start_epoch(2)             # one step: cleared, and epoch 1 refused from now on
        assert list(left) == [1] and len(rb) == 0
        worker.sendall(batch_frame(1, 2) + batch_frame(2, 3) + batch_frame(2, 4))
        assert rcv.wait(1) == (_core.EV_FRAME, 0)
        assert BATCH.unpack(rcv.take_frame(0)[1])[:2] == (1, 2)
        rcv.wait(0.05)
        assert sorted(rb.take_raw(41)) == [3, 4] and len(rb) == 0
        assert rb.take_raw(41) == {}
    finally:
        rcv.close()
        main.close()
        worker.close()


def test_foreign_frames_go_to_python(chan):
    """Another magic or protocol version is never stored: Python rejects it."""
    rcv, rb, worker, _ = chan
    good = batch_frame(3, 1)
    worker.sendall(b"ZZ" + good[2:])
    assert rcv.wait(1) == (_core.EV_FRAME, 0)
    header, payload, fds = rcv.take_frame(0)
    with pytest.raises(wire.ProtocolError, match="not an mxload message"):
        wire.decode(header, payload, len(fds))
    worker.sendall(good[:2] + bytes([wire.VERSION + 1]) + good[3:])
    assert rcv.wait(1) == (_core.EV_FRAME, 0)
    assert 1 not in rb


# ------------------------------------------------ the consumer's get() and the watcher's watch()

def test_the_consumer_receives_its_batch_itself(chan):
    """No other thread reads: get() reads the socket while it waits and
    returns the stored batch."""
    rcv, rb, worker, _ = chan
    sender = threading.Timer(0.05, lambda: worker.sendall(batch_frame(3, 1) + batch_frame(3, 0)))
    sender.start()
    try:
        event, slot, tag, item = rcv.get(0, False, 5)
    finally:
        sender.join()
    assert (event, slot, tag) == (_core.EV_READY, -1, 0)
    assert (item.idx, item.slot) == (0, 0)
    assert rcv.get(1, False, 0)[3].idx == 1        # read by the same recvmsg: no wait
    with pytest.raises(TimeoutError, match="batch 2"):
        rcv.get(2, False, 0.05)
    worker.sendall(batch_frame(3, 8) + batch_frame(3, 6))
    assert [rcv.get(0, True, 5)[3][0] for _ in range(2)] == [6, 8]   # any index: smallest first


def test_get_hands_up_frames_for_python_and_ends_once(chan):
    rcv, rb, worker, _ = chan
    worker.sendall(batch_frame(3, 4) + pickled_frame(b"hello") + batch_frame(3, 5))
    assert rcv.get(4, False, 5)[3].idx == 4
    assert rcv.get(5, False, 5)[:3] == (_core.EV_FRAME, 0, 0)   # in order: the pickled frame first
    assert rcv.take_frame(0)[1] == b"hello"
    assert rcv.get(5, False, 5)[3].idx == 5
    worker.close()
    assert rcv.get(6, False, 5)[:3] == (_core.EV_CLOSED, 0, 0)
    with pytest.raises(TimeoutError):                           # reported once per attachment
        rcv.get(6, False, 0.1)


def test_get_finds_items_other_threads_put_and_wakes_on_close(chan):
    rcv, rb, _, _ = chan
    for k in range(20):
        putter = threading.Timer(0.01, rb.put, (100 + k, k))
        putter.start()
        assert rcv.get(100 + k, False, 5) == (_core.EV_READY, -1, 0, k)
        putter.join()
    closer = threading.Timer(0.05, rb.close, ("stopped",))
    closer.start()
    with pytest.raises(_core.BufferClosedError, match="stopped"):
        rcv.get(0, False, 10)
    closer.join()


def test_watch_reports_an_ended_worker_once_with_its_frames_read(ended_worker):
    rcv, rb, worker, end = ended_worker
    worker.sendall(batch_frame(0, 0) + pickled_frame(b"last words") + batch_frame(0, 1))
    assert rcv.watch(0.05) == (_core.EV_TIMEOUT, -1, 0)    # sockets are the consumer's
    assert len(rb) == 0
    end()
    assert rcv.watch(5) == (_core.EV_ENDED, 1, 9)
    assert rcv.watch(0.05) == (_core.EV_TIMEOUT, -1, 0)    # once per attachment
    assert rcv.drain(1, 8) is False                        # another worker's tag: not read
    assert rcv.drain(1, 9) is True                         # batch 0 stored, then a frame for Python
    assert 0 in rb and 1 not in rb
    assert rcv.take_frame(1)[1] == b"last words"
    assert rcv.drain(1, 9) is False and 1 in rb


@pytest.mark.parametrize("rounds", once_and_as_race(50))
@pytest.mark.parametrize("senders", [1, 3])
def test_a_consumer_receiving_beside_a_watcher_loses_nothing(senders, rounds):
    """The consumer reads in get() while the watcher sleeps in watch() and
    senders write at once: every batch arrives exactly once (50 rounds in the races tier)."""
    for _ in range(tries(rounds)):
        _concurrent_round(senders, 200, lambda rcv: rcv.watch(0.01), _consumer_take)


def _consumer_take(rcv, rb, i):
    event, _, _, item = rcv.get(i, False, 10)
    assert event == _core.EV_READY
    return item


def test_one_receiver_per_buffer():
    rb = _core.ReorderBuffer()
    rcv = receiver(1, -1, rb)
    with pytest.raises(ValueError, match="already has a FrameReceiver"):
        receiver(1, -1, rb)
    rcv.close()
    receiver(1, -1, rb).close()   # a closed receiver lets the buffer go


@pytest.mark.races
def test_the_watcher_keeps_watching_while_the_consumer_polls():
    """The consumer (get) and the watcher (watch) sleep in poll() at the same
    time, each on its own descriptors: a socket that becomes readable for the
    consumer is never taken for the watcher's sentinel, so the worker's later
    end is still reported (10 trials of 0.5 s; shared poll arrays lost 6 of 8)."""
    for _ in range(race_rounds(10)):
        _watch_beside_consumer_round(0.5)


def _watch_beside_consumer_round(seconds: float) -> None:
    rb = _core.ReorderBuffer()
    rb.start_epoch(0)
    wake_r, wake_w = os.pipe()
    rcv = receiver(1, wake_r, rb)   # with a wake-up pipe, as the loader's: the arrays' layouts differ
    main, worker = socket.socketpair()
    sentinel_r, sentinel_w = os.pipe()
    rcv.attach(0, main.fileno(), sentinel_r, tag=7)
    # A frame announcing 1 MB, then a trickle of its bytes: the consumer's
    # poll() keeps waking for a frame that never completes.
    worker.sendall(pickled_frame(b"")[:HEADER.size - 5] + struct.pack("<IB", 1 << 20, 0))
    stop = threading.Event()

    def trickle():
        while not stop.wait(0.0005):
            worker.send(b"\0", socket.MSG_DONTWAIT)

    def consume():
        with pytest.raises(TimeoutError):
            rcv.get(10**6, False, seconds)
    threads = [threading.Thread(target=trickle), threading.Thread(target=consume)]
    try:
        for t in threads:
            t.start()
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            assert rcv.watch(0.02)[0] == _core.EV_TIMEOUT
        threads[1].join()
        stop.set()
        threads[0].join()
        os.close(sentinel_w)
        sentinel_w = -1
        assert rcv.watch(2) == (_core.EV_ENDED, 0, 7)
    finally:
        stop.set()
        for t in threads:
            t.join()
        rcv.close()
        main.close()
        worker.close()
        for fd in (sentinel_r, sentinel_w, wake_r, wake_w):
            if fd >= 0:
                os.close(fd)
