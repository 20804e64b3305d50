# The fetcher thread's compiled receive path.
#
# FrameReceiver.wait() polls the wake-up pipe and every worker's socket and
# sentinel with the GIL released, reads whatever arrived (mxl_recv.h), and
# stores each batch frame of the current epoch straight into the
# ReorderBuffer (put_raw, a C struct under its mutex): in the steady state a
# batch crosses the main process without one Python object being made until
# the consumer takes it.  wait() returns to Python only for what needs it:
# a frame of another kind (pickled: errors, new slabs, new layouts), a
# batch it could not store (stale epoch, closed buffer), a worker's end, a
# wake-up, or the timeout.  Events are level-triggered: a frame wait()
# reported stays first in its channel until take_frame() removes it.
#
# One thread (the fetcher) calls wait(), take_frame(), attach() and detach().
# Which epoch's batches are stored is the buffer's (ReorderBuffer.start_epoch).

cdef enum:
    _EV_TIMEOUT = 0
    _EV_WAKE = 1
    _EV_FRAME = 2
    _EV_CLOSED = 3     # the channel reached its end (or broke): the worker is gone or going
    _EV_ENDED = 4      # the worker's sentinel is ready: its process ended
    _EV_FD_LIMIT = 5   # a descriptor was lost: this process is at RLIMIT_NOFILE

EV_TIMEOUT = _EV_TIMEOUT
EV_WAKE = _EV_WAKE
EV_FRAME = _EV_FRAME
EV_CLOSED = _EV_CLOSED
EV_ENDED = _EV_ENDED
EV_FD_LIMIT = _EV_FD_LIMIT

BATCH_FRAME_SIZE = MXL_BATCH_SIZE
FRAME_HEADER_SIZE = MXL_FRAME_HEADER


@cython.final
cdef class FrameReceiver:
    """Receives every worker's frames for one ReorderBuffer, GIL-free.

    FrameReceiver(slots, wake_fd, buffer, magic, version, batch_tag)
    attach(slot, sock_fd, sentinel_fd, tag)   watch a worker (the caller keeps both fds
                                         open); its stored batches carry `tag`
    detach(slot)                         stop watching; close descriptors still held
    wait(timeout) -> (event, slot)       EV_* (slot -1 for EV_TIMEOUT / EV_WAKE)
    take_frame(slot) -> (header, payload, fds)   the frame EV_FRAME reported
    stats() -> {"gil_ns", "stored", "passed_up"}
    """
    cdef mxl_channel *_ch
    cdef pollfd *_pfds
    cdef int *_pslot       # for each pollfd: its slot (-1: the wake-up pipe)
    cdef int _slots
    cdef int _wake_fd
    cdef ReorderBuffer _rb
    cdef int64_t _gil_ns
    cdef int64_t _t_out
    cdef int64_t _stored
    cdef int64_t _passed_up
    cdef char _magic[2]
    cdef int _version
    cdef int _batch_tag

    def __cinit__(self, int slots, int wake_fd, ReorderBuffer buffer not None, bytes magic,
                  int version, int batch_tag):
        cdef int i
        if slots < 0:
            raise ValueError(f"slots must be >= 0, got {slots}")
        if len(magic) != 2 or not 0 <= version < 256 or not 0 <= batch_tag < 256:
            raise ValueError(f"a frame header has 2 magic bytes and byte-sized version and tag, "
                             f"got {magic!r}, {version}, {batch_tag}")
        self._magic[0] = magic[0]
        self._magic[1] = magic[1]
        self._version = version
        self._batch_tag = batch_tag
        self._ch = <mxl_channel *>PyMem_Malloc(max(slots, 1) * sizeof(mxl_channel))
        self._pfds = <pollfd *>PyMem_Malloc((2 * slots + 1) * sizeof(pollfd))
        self._pslot = <int *>PyMem_Malloc((2 * slots + 1) * sizeof(int))
        if self._ch == NULL or self._pfds == NULL or self._pslot == NULL:
            raise MemoryError()
        for i in range(slots):
            mxl_channel_init(&self._ch[i])
        self._slots = slots
        self._wake_fd = wake_fd
        self._rb = buffer

    def __dealloc__(self):
        cdef int i
        if self._ch != NULL:
            for i in range(self._slots):
                mxl_channel_reset(&self._ch[i])
        PyMem_Free(self._ch)
        PyMem_Free(self._pfds)
        PyMem_Free(self._pslot)

    cdef int _check_slot(self, int slot) except -1:
        if not 0 <= slot < self._slots:
            raise IndexError(f"slot {slot} is not in 0..{self._slots - 1}")
        return 0

    def attach(self, int slot, int sock, int sentinel=-1, int64_t tag=0):
        self._check_slot(slot)
        mxl_channel_reset(&self._ch[slot])
        self._ch[slot].sock = sock
        self._ch[slot].sentinel = sentinel
        self._ch[slot].tag = tag

    def detach(self, int slot):
        self._check_slot(slot)
        mxl_channel_reset(&self._ch[slot])

    cdef int _store_frames(self, int slot) noexcept nogil:
        """Store the slot's complete batch frames; EV_FRAME when the first
        remaining frame needs Python, else -1."""
        cdef mxl_channel *ch = &self._ch[slot]
        cdef int nfds
        cdef const char *header
        cdef const char *payload
        cdef uint32_t plen
        cdef mxl_raw_entry e
        while mxl_channel_next(ch, &header, &payload, &plen, &nfds):
            if (header[0] != self._magic[0] or header[1] != self._magic[1]
                    or <unsigned char>header[MXL_HEADER_VERSION_AT] != self._version
                    or <unsigned char>header[MXL_HEADER_TAG_AT] != self._batch_tag
                    or plen != MXL_BATCH_SIZE or nfds != 0):
                return _EV_FRAME
            mxl_batch_decode(payload, &e.frame)
            e.slot = slot
            e.tag = ch.tag
            if self._rb.put_raw(&e) != 0:
                return _EV_FRAME
            mxl_channel_pop(ch, plen)
            self._stored += 1
        return -1

    cdef int _wait(self, int64_t deadline_ns, int *slot_out) noexcept nogil:
        cdef int i, k, n, ev, timeout_ms
        cdef int64_t left
        cdef mxl_channel *ch
        while True:
            for i in range(self._slots):
                ch = &self._ch[i]
                if ch.sock < 0:
                    continue
                ev = self._store_frames(i)
                if ev < 0 and ch.fd_overflow:
                    ev = _EV_FD_LIMIT
                if ev < 0 and ch.eof:
                    ev = _EV_CLOSED
                if ev >= 0:
                    slot_out[0] = i
                    return ev
            n = 0
            if self._wake_fd >= 0:
                self._pfds[n].fd = self._wake_fd
                self._pfds[n].events = POLLIN
                self._pslot[n] = -1
                n += 1
            for i in range(self._slots):
                if self._ch[i].sock < 0:
                    continue
                self._pfds[n].fd = self._ch[i].sock
                self._pfds[n].events = POLLIN
                self._pslot[n] = i
                n += 1
                if self._ch[i].sentinel >= 0:
                    self._pfds[n].fd = self._ch[i].sentinel
                    self._pfds[n].events = POLLIN
                    self._pslot[n] = -2 - i
                    n += 1
            left = deadline_ns - mxl_monotonic_ns()
            if left <= 0:
                timeout_ms = 0
            else:
                timeout_ms = <int>((left + 999999) // 1000000)
            k = poll(self._pfds, n, timeout_ms)
            if k < 0:
                if errno == EINTR:
                    continue
                slot_out[0] = -1
                return _EV_TIMEOUT   # cannot poll: let Python look at its state
            if k == 0:
                if mxl_monotonic_ns() >= deadline_ns:
                    slot_out[0] = -1
                    return _EV_TIMEOUT
                continue
            for i in range(n):
                if self._pfds[i].revents == 0:
                    continue
                if self._pslot[i] == -1:
                    slot_out[0] = -1
                    return _EV_WAKE
                if self._pslot[i] >= 0:
                    ch = &self._ch[self._pslot[i]]
                    if mxl_channel_fill(ch) < 0 and errno != EAGAIN:
                        ch.eof = 1   # broken channel: the worker is gone
                else:
                    # The process ended: take everything it sent first.
                    ch = &self._ch[-2 - self._pslot[i]]
                    while not ch.eof and mxl_channel_fill(ch) > 0:
                        pass
                    ev = self._store_frames(-2 - self._pslot[i])
                    slot_out[0] = -2 - self._pslot[i]
                    return _EV_FRAME if ev >= 0 else _EV_ENDED

    def wait(self, double timeout):
        """Block (GIL released) until something needs Python; (event, slot)."""
        cdef int slot = -1, ev
        cdef int64_t now = mxl_monotonic_ns()
        cdef int64_t deadline = now + <int64_t>(max(timeout, 0.0) * 1e9)
        if self._t_out != 0:
            self._gil_ns += now - self._t_out
        with nogil:
            ev = self._wait(deadline, &slot)
        self._t_out = mxl_monotonic_ns()
        if ev == _EV_FRAME:
            self._passed_up += 1
        return ev, slot

    def end_gil_span(self):
        """The calling thread stops using this receiver for now: the time
        until its next wait() is not the fetcher's."""
        self._t_out = 0

    def take_frame(self, int slot):
        """(header bytes, payload bytes, descriptors) of the slot's first
        complete frame, removed from the channel; EOFError if it announced
        more descriptors than arrived (closed here), LookupError if none is
        complete."""
        cdef int nfds, got
        cdef const char *header
        cdef const char *payload
        cdef uint32_t plen
        cdef int fds[MXL_FDQ]
        self._check_slot(slot)
        cdef mxl_channel *ch = &self._ch[slot]
        if ch.sock < 0 or not mxl_channel_next(ch, &header, &payload, &plen, &nfds):
            raise LookupError(f"no complete frame waiting in slot {slot}")
        head = PyBytes_FromStringAndSize(header, MXL_FRAME_HEADER)
        data = PyBytes_FromStringAndSize(payload, plen)
        got = mxl_channel_take_fds(ch, min(nfds, MXL_FDQ), fds)
        mxl_channel_pop(ch, plen)
        out = [fds[i] for i in range(got)]
        if got != nfds:
            import os as _os
            for fd in out:
                _os.close(fd)
            raise EOFError(f"a frame announced {nfds} descriptors and carried {got}")
        return head, data, out

    def stats(self):
        """GIL-held ns of the thread calling wait() (between its waits),
        batches stored without Python, frames passed up to Python."""
        return {"gil_ns": self._gil_ns, "stored": self._stored, "passed_up": self._passed_up}


def build_views(BatchOwner owner not None, list specs):
    """Numpy arrays over `owner`'s bytes, one per (offset, shape, dtype) of
    `specs` (dtype a numpy dtype), each with `owner` as its base (no copy)."""
    cdef list out = []
    cdef Py_ssize_t off, nbytes
    cdef int nd, d
    cdef cnp.npy_intp dims[32]
    cdef cnp.dtype dtype
    cdef tuple shape
    cdef cnp.ndarray arr
    cdef char *base = owner.slab._ptr + owner.offset
    for off, shape, dtype in specs:
        nd = len(shape)
        if nd > 32:
            raise ValueError(f"{nd} dimensions: at most 32")
        nbytes = dtype.itemsize
        for d in range(nd):
            dims[d] = shape[d]
            nbytes *= dims[d]
        if off < 0 or nbytes < 0 or off + nbytes > owner.nbytes:
            raise ValueError(f"field at offset {off} of {nbytes} bytes is outside the batch's "
                             f"{owner.nbytes} bytes")
        Py_INCREF(dtype)   # PyArray_NewFromDescr steals it
        arr = mxl_array_new(<PyTypeObject *>cnp.ndarray, <cnp.PyArray_Descr *>dtype, nd, dims, NULL,
                            base + off, cnp.NPY_ARRAY_CARRAY, NULL)
        cnp.set_array_base(arr, owner)
        out.append(arr)
    return out
