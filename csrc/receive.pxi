# The compiled receive path of process workers.
#
# Two threads use one FrameReceiver:
# - The consumer (the thread iterating the loader) receives its batches
#   itself: get() looks in the ReorderBuffer, and when the batch it needs is
#   not there, reads what the workers sent and stores each batch frame
#   straight into the buffer (put_raw, a C struct under its mutex), then
#   sleeps in poll() on the workers' sockets, with the GIL released.  In the
#   steady state a batch costs the training process one recvmsg (often
#   shared by several batches) and no thread hand-off: no other thread wakes
#   for it, and no Python object is made until the consumer takes it.
# - The watcher (the fetcher thread) sleeps in watch() on the workers'
#   sentinels and its wake-up pipe: it wakes only when a worker ends (and
#   takes what that worker sent, see drain()), so a death is noticed at once
#   even while the consumer is busy training.
# Either returns to Python only for what needs it: a frame of another kind
# (pickled: errors, new slabs, new layouts), a batch the buffer would not
# store (stale epoch, closed buffer), a worker's end, a wake-up or a timeout.
# A frame reported stays first in its channel until take_frame() removes it.
#
# Lock discipline (NOTE [ Native mutexes touch no Python ], reorder.pxi).  The
# channels (buffers, descriptors, attachments) are
# guarded by a native mutex, _mu, which is only ever held by C code that
# touches no Python object (no allocation, no callback) and never blocks:
# recvmsg is non-blocking, and poll() runs outside it on a snapshot of the
# descriptors.  A thread takes _mu only with the GIL released (a try-lock
# first, which never blocks), and never takes the GIL while holding it; the
# only lock taken under _mu is the ReorderBuffer's (put_raw), which in turn
# never waits for _mu.  So no two of the GIL, _mu and the buffer's mutex can
# deadlock, and a finalizer that reaches the receiver from a collection
# never finds _mu held by its own thread.
#
# A snapshot can outlive its descriptors (a worker detached and its socket
# closed meanwhile, the number perhaps reused): the channel is then looked
# up again under _mu with its tag, which names one worker process for good,
# and nothing is read unless it is still the same worker.

cdef enum:
    _EV_TIMEOUT = 0
    _EV_WAKE = 1
    _EV_FRAME = 2
    _EV_CLOSED = 3     # the channel reached its end (or broke): the worker is gone or going
    _EV_ENDED = 4      # the worker's sentinel is ready: its process ended
    _EV_FD_LIMIT = 5   # a descriptor was lost: this process is at RLIMIT_NOFILE
    _EV_READY = 6      # get(): the awaited batch is here
    _EV_WOULD_WAIT = 7 # get(report_wait=True): it is not here and nothing is to read: get() would sleep
    # Internal results of _scan() and _poll().
    _NOTHING = -1
    _STORED = -2       # batch frames were stored: look in the buffer again
    _POLLED = -3       # poll() saw something (read in, or a wake-up cleared)

cdef enum:
    # What _poll() sleeps on.
    _ON_SOCKETS = 1
    _ON_SENTINELS = 2
    _ON_WAKE_PIPE = 4
    _ON_BUFFER = 8     # the consumer's wake-up (eventfd): the buffer changed, a worker attached

EV_TIMEOUT = _EV_TIMEOUT
EV_WAKE = _EV_WAKE
EV_FRAME = _EV_FRAME
EV_CLOSED = _EV_CLOSED
EV_ENDED = _EV_ENDED
EV_FD_LIMIT = _EV_FD_LIMIT
EV_READY = _EV_READY
EV_WOULD_WAIT = _EV_WOULD_WAIT

BATCH_FRAME_SIZE = MXL_BATCH_SIZE
FRAME_HEADER_SIZE = MXL_FRAME_HEADER


@cython.final
cdef class FrameReceiver:
    """Receives every worker's frames for one ReorderBuffer.

    FrameReceiver(slots, wake_fd, buffer, magic, version, batch_tag)
    attach(slot, sock_fd, sentinel_fd, tag)   watch a worker (the caller keeps both fds
                                         open); its stored batches carry `tag`
    detach(slot)                         stop watching; close descriptors still held
    get(idx, any_index, timeout) -> (event, slot, tag, item)
                                         the consumer: EV_READY and the buffer's item for
                                         batch idx (any_index: (idx, item), smallest
                                         first), receiving meanwhile; or what needs Python
    watch(timeout) -> (event, slot, tag) the watcher: EV_ENDED, EV_WAKE or EV_TIMEOUT
    wait(timeout) -> (event, slot)       one thread doing both: receive and watch
    drain(slot, tag) -> bool             read an ended worker's channel to its end and
                                         store its batches; True if a frame for Python is first
    take_frame(slot) -> (header, payload, fds)   the frame an event reported
    close()                              detach everything; release the consumer's wake-up
    stats() -> {"gil_ns", "stored", "passed_up"}
    """
    cdef mxl_channel *_ch
    cdef int _slots
    cdef int _wake_fd
    cdef int _event_fd     # the consumer's wake-up (owned); -1 once closed
    cdef pthread_mutex_t _mu
    cdef bint _mu_ready
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
        self._event_fd = -1
        if slots < 0:
            raise ValueError(f"slots must be >= 0, got {slots}")
        if len(magic) != 2 or not 0 <= version < 256 or not 0 <= batch_tag < 256:
            raise ValueError(f"a frame header has 2 magic bytes and byte-sized version and tag, "
                             f"got {magic!r}, {version}, {batch_tag}")
        if buffer._wake_fd >= 0:
            raise ValueError("this ReorderBuffer already has a FrameReceiver")
        self._magic[0] = magic[0]
        self._magic[1] = magic[1]
        self._version = version
        self._batch_tag = batch_tag
        self._ch = <mxl_channel *>PyMem_Malloc(max(slots, 1) * sizeof(mxl_channel))
        if self._ch == NULL:
            raise MemoryError()
        for i in range(slots):
            mxl_channel_init(&self._ch[i])
        self._slots = slots
        if pthread_mutex_init(&self._mu, NULL) != 0:
            raise MemoryError("pthread_mutex_init failed")
        self._mu_ready = True
        self._event_fd = mxl_event_open()
        if self._event_fd < 0:
            raise OSError(errno, "eventfd() failed: the consumer's wake-up")
        self._wake_fd = wake_fd
        self._rb = buffer
        buffer._wake_fd = self._event_fd

    def __dealloc__(self):
        cdef int i
        if self._ch != NULL:
            for i in range(self._slots):
                mxl_channel_reset(&self._ch[i])
        self._release_event()
        if self._mu_ready:
            pthread_mutex_destroy(&self._mu)
        PyMem_Free(self._ch)

    cdef void _release_event(self) noexcept:
        # With the GIL held: the buffer signals the eventfd under the GIL too,
        # so it never writes to a closed (or reused) descriptor.
        if self._event_fd >= 0:
            if self._rb is not None and self._rb._wake_fd == self._event_fd:
                self._rb._wake_fd = -1
            mxl_event_close(self._event_fd)
            self._event_fd = -1

    cdef inline void _lock(self) noexcept:
        if pthread_mutex_trylock(&self._mu) != 0:
            with nogil:
                pthread_mutex_lock(&self._mu)

    cdef int _check_slot(self, int slot) except -1:
        if not 0 <= slot < self._slots:
            raise IndexError(f"slot {slot} is not in 0..{self._slots - 1}")
        return 0

    def attach(self, int slot, int sock, int sentinel=-1, int64_t tag=0):
        self._check_slot(slot)
        self._lock()
        mxl_channel_reset(&self._ch[slot])
        self._ch[slot].sock = sock
        self._ch[slot].sentinel = sentinel
        self._ch[slot].tag = tag
        pthread_mutex_unlock(&self._mu)
        if self._event_fd >= 0:
            mxl_event_signal(self._event_fd)   # a consumer in poll() adds the new socket

    def detach(self, int slot):
        self._check_slot(slot)
        self._lock()
        mxl_channel_reset(&self._ch[slot])
        pthread_mutex_unlock(&self._mu)

    def close(self):
        """Detach every worker (closing descriptors still held) and release
        the consumer's wake-up; a consumer still in get() finds nothing to
        read and returns within one wait slice."""
        cdef int i
        self._lock()
        for i in range(self._slots):
            mxl_channel_reset(&self._ch[i])
        pthread_mutex_unlock(&self._mu)
        self._release_event()

    cdef int _store_frames(self, int slot) noexcept nogil:
        """Store the slot's complete batch frames (_mu held) up to the first
        that needs Python: _STORED if any was stored (the buffer is looked
        at before that frame is reported), else EV_FRAME if one is first,
        else _NOTHING."""
        cdef mxl_channel *ch = &self._ch[slot]
        cdef int nfds, result = _NOTHING
        cdef const char *header
        cdef const char *payload
        cdef uint32_t plen
        cdef mxl_raw_entry e
        while mxl_channel_next(ch, &header, &payload, &plen, &nfds):
            if (header[0] != self._magic[0] or header[1] != self._magic[1]
                    or <unsigned char>header[MXL_HEADER_VERSION_AT] != self._version
                    or <unsigned char>header[MXL_HEADER_TAG_AT] != self._batch_tag
                    or plen != MXL_BATCH_SIZE or nfds != 0):
                return _EV_FRAME if result == _NOTHING else result
            mxl_batch_decode(payload, &e.frame)
            e.slot = slot
            e.tag = ch.tag
            if self._rb.put_raw(&e) != 0:
                return _EV_FRAME if result == _NOTHING else result
            mxl_channel_pop(ch, plen)
            self._stored += 1
            result = _STORED
        return result

    cdef int _store_all(self, int slot) noexcept nogil:
        """_store_frames until a frame that needs Python is first (EV_FRAME)
        or none is complete (_NOTHING); _mu held."""
        cdef int ev = _STORED
        while ev == _STORED:
            ev = self._store_frames(slot)
        return ev

    cdef int _scan(self, bint report_ends_once, int *slot_out, int64_t *tag_out) noexcept nogil:
        """Store every channel's complete batch frames; the first event that
        needs Python (a frame, a channel's end), else _STORED or _NOTHING."""
        cdef int i, ev, result = _NOTHING
        cdef mxl_channel *ch
        pthread_mutex_lock(&self._mu)
        for i in range(self._slots):
            ch = &self._ch[i]
            if ch.sock < 0 or (report_ends_once and ch.end_reported):
                continue
            ev = self._store_frames(i)
            if ev == _STORED:
                result = _STORED
                continue
            if ch.fd_overflow:
                # A descriptor did not fit here (RLIMIT_NOFILE): the frame it
                # came with lacks it, and is no sign of a dead worker.
                ev = _EV_FD_LIMIT
            if ev < 0 and ch.eof:
                ev = _EV_CLOSED
            if ev >= 0:
                if ev != _EV_FRAME and report_ends_once:
                    ch.end_reported = 1
                slot_out[0] = i
                tag_out[0] = ch.tag
                result = ev
                break
        pthread_mutex_unlock(&self._mu)
        return result

    cdef int _poll(self, int what, int timeout_ms, int *slot_out, int64_t *tag_out) noexcept nogil:
        # Each call polls its own arrays: the consumer and the watcher poll at
        # the same time, and the kernel writes revents back into them.
        cdef int m = 2 * self._slots + 2, r
        cdef char *block = <char *>malloc(m * (sizeof(pollfd) + sizeof(int) + sizeof(int64_t)))
        if block == NULL:
            slot_out[0] = -1
            return _EV_TIMEOUT
        r = self._poll_in(what, timeout_ms, slot_out, tag_out, <pollfd *>block,
                          <int *>(block + m * sizeof(pollfd)),
                          <int64_t *>(block + m * (sizeof(pollfd) + sizeof(int))))
        free(block)
        return r

    cdef int _poll_in(self, int what, int timeout_ms, int *slot_out, int64_t *tag_out, pollfd *pfds,
                      int *pslot, int64_t *ptag) noexcept nogil:
        """Sleep in poll() on `what` (_ON_*) for up to timeout_ms, then read
        the sockets that became readable.  For each pollfd, pslot says what
        it is: a slot's socket (>= 0), the wake-up pipe (-1), the eventfd
        (-2) or a slot's sentinel (-3 - slot); ptag, whose channel it was
        when polled.  Returns _POLLED, _EV_WAKE (the
        pipe, left for the caller to read), _EV_ENDED (that worker's channel
        read to its end), or _EV_TIMEOUT (also for EINTR: a signal handler
        must run)."""
        cdef int i, k, n = 0, slot
        cdef mxl_channel *ch
        pthread_mutex_lock(&self._mu)
        if (what & _ON_WAKE_PIPE) and self._wake_fd >= 0:
            pfds[n].fd = self._wake_fd
            pslot[n] = -1
            n += 1
        if (what & _ON_BUFFER) and self._event_fd >= 0:
            pfds[n].fd = self._event_fd
            pslot[n] = -2
            n += 1
        for i in range(self._slots):
            ch = &self._ch[i]
            if ch.sock < 0:
                continue
            if (what & _ON_SOCKETS) and not ch.eof and not ch.end_reported:
                pfds[n].fd = ch.sock
                pslot[n] = i
                ptag[n] = ch.tag
                n += 1
            if (what & _ON_SENTINELS) and ch.sentinel >= 0 and not ch.death_reported:
                pfds[n].fd = ch.sentinel
                pslot[n] = -3 - i
                ptag[n] = ch.tag
                n += 1
        for i in range(n):
            pfds[i].events = POLLIN
            pfds[i].revents = 0
        pthread_mutex_unlock(&self._mu)
        slot_out[0] = -1
        k = poll(pfds, n, timeout_ms)
        if k <= 0:
            return _EV_TIMEOUT   # nothing, or EINTR (or poll failed): let Python look at its state
        for i in range(n):
            if pfds[i].revents == 0:
                continue
            if pslot[i] == -1:
                return _EV_WAKE
            if pslot[i] == -2:
                mxl_event_clear(pfds[i].fd)
                continue
            slot = pslot[i] if pslot[i] >= 0 else -3 - pslot[i]
            pthread_mutex_lock(&self._mu)
            ch = &self._ch[slot]
            if ch.sock < 0 or ch.tag != ptag[i]:
                pthread_mutex_unlock(&self._mu)   # detached meanwhile: not ours to read
                continue
            if pslot[i] >= 0:
                if not ch.eof and mxl_channel_fill(ch) < 0 and errno != EAGAIN:
                    ch.eof = 1   # broken channel: the worker is gone
                pthread_mutex_unlock(&self._mu)
                continue
            # Its process ended: everything it sent is read before its end is reported.
            while not ch.eof and mxl_channel_fill(ch) > 0:
                pass
            ch.death_reported = 1
            pthread_mutex_unlock(&self._mu)
            slot_out[0] = slot
            tag_out[0] = ptag[i]
            return _EV_ENDED
        return _POLLED

    cdef inline void _gil_back(self) noexcept:
        self._t_out = mxl_monotonic_ns()

    cdef inline void _gil_away(self, int64_t now) noexcept:
        if self._t_out != 0:
            self._gil_ns += now - self._t_out

    @staticmethod
    cdef int64_t _deadline(timeout) except? -2:
        """Monotonic ns deadline of `timeout` seconds; -1 for None (no deadline)."""
        if timeout is None:
            return -1
        if not timeout >= 0:
            raise ValueError(f"timeout must be >= 0 or None, got {timeout!r}")
        if timeout > _MAX_TIMEOUT_S:
            return -1   # longer than any run: wait forever (no overflow)
        return mxl_monotonic_ns() + <int64_t>(timeout * 1e9)

    @staticmethod
    cdef int _slice_ms(int64_t deadline, int64_t slice_ns) noexcept nogil:
        """Milliseconds to sleep: up to the deadline, at most slice_ns (if > 0)."""
        cdef int64_t left = slice_ns
        if deadline >= 0:
            left = deadline - mxl_monotonic_ns()
            if slice_ns > 0 and left > slice_ns:
                left = slice_ns
        if left <= 0:
            return 0
        return <int>((left + 999999) // 1000000)

    cpdef tuple get(self, Py_ssize_t idx, bint any_index=False, timeout=None, bint report_wait=False,
                    Py_ssize_t epochs=-1):
        """The consumer's wait: (EV_READY, -1, 0, item) once the buffer holds
        batch `idx` (any_index: any batch, item = (idx, item) with the
        smallest index), receiving what the workers send meanwhile;
        (event, slot, tag, None) for what needs Python (EV_FRAME, EV_CLOSED,
        EV_FD_LIMIT; an end is reported once per attachment; with
        `report_wait`, EV_WOULD_WAIT before it first sleeps).  Raises
        BufferClosedError once the buffer is closed, TimeoutError after
        `timeout` seconds (None: no limit), EpochOverError once the buffer's
        epoch `epochs` (if given) is over.  Sleeps with
        the GIL released, in slices that let signal handlers (Ctrl-C) run."""
        cdef int64_t deadline = FrameReceiver._deadline(timeout)
        cdef int64_t tag = 0
        cdef int slot = -1, ev
        cdef int slice_ms
        cdef ReorderBuffer rb = self._rb
        while True:
            rb._check_wait(epochs)
            found = rb._pop_smallest() if any_index else rb._pop(idx)
            if found is not _MISSING:
                if rb.keep_handover:
                    rb.handover = found if any_index else (idx, found)   # NOTE [ Signal-safe hand-over ]
                return _EV_READY, -1, 0, found
            with nogil:
                ev = self._scan(True, &slot, &tag)
            if ev == _STORED:
                continue
            if ev >= 0:
                self._passed_up += 1
                return ev, slot, tag, None
            if report_wait:
                # Would it sleep?  Only if nothing is ready in the kernel either.
                with nogil:
                    ev = self._poll(_ON_SOCKETS | _ON_BUFFER, 0, &slot, &tag)
                if ev == _EV_TIMEOUT:
                    return _EV_WOULD_WAIT, -1, 0, None
                continue
            if deadline >= 0 and mxl_monotonic_ns() >= deadline:
                what = "any batch" if any_index else f"batch {idx}"
                raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
            slice_ms = FrameReceiver._slice_ms(deadline, <int64_t>(_WAIT_SLICE_S * 1e9))
            with nogil:
                ev = self._poll(_ON_SOCKETS | _ON_BUFFER, slice_ms, &slot, &tag)
            if ev == _EV_TIMEOUT:
                PyErr_CheckSignals()   # Ctrl-C reaches a consumer waiting here

    def next_result(self, Py_ssize_t idx, bint any_index, timeout, bint filling, set holding not None,
                    before_wait, on_event, Py_ssize_t epochs=-1):
        """The consumer's whole wait (the process transport's next_result):
        get() until the buffer holds batch `idx` (any_index: any batch) and
        return its item, handing each event that needs Python to
        `on_event(event, slot, tag)`.  While tasks are held back for a pair
        (`holding`, the transport's set of workers holding some), the first
        time it would sleep it calls `before_wait(filling)` first (the
        transport sends them; `filling`: the epoch's first window).  Raises
        as get() does; `timeout` bounds the whole wait, `epochs` ends it as
        get()'s does."""
        return self._next_result(idx, any_index, timeout, filling, holding, before_wait, on_event, epochs)

    cdef object _next_result(self, Py_ssize_t idx, bint any_index, timeout, bint filling, set holding,
                             before_wait, on_event, Py_ssize_t epochs):
        cdef int64_t start = mxl_monotonic_ns()
        cdef bint report = len(holding) > 0
        left = timeout
        while True:
            event, slot, tag, item = self.get(idx, any_index, left, report, epochs)
            if event == _EV_READY:
                return item
            if timeout is not None:   # (not on the way of a batch that is there)
                left = max(0.0, timeout - (mxl_monotonic_ns() - start) / 1e9)
            if event == _EV_WOULD_WAIT:
                report = False
                before_wait(filling)
                continue
            on_event(event, slot, tag)

    def watch(self, double timeout):
        """The watcher's wait (GIL released): (EV_ENDED, slot, tag) when a
        worker's process ended (its channel read to its end; Python takes
        the rest with drain()), (EV_WAKE, -1, 0) when the wake-up pipe is
        readable (until the caller reads it), or (EV_TIMEOUT, -1, 0)."""
        cdef int slot = -1, ev
        cdef int64_t tag = 0
        cdef int64_t now = mxl_monotonic_ns()
        cdef int64_t deadline = now + <int64_t>(max(timeout, 0.0) * 1e9)
        self._gil_away(now)
        with nogil:
            while True:
                ev = self._poll(_ON_SENTINELS | _ON_WAKE_PIPE, FrameReceiver._slice_ms(deadline, 0),
                                &slot, &tag)
                if (ev != _POLLED and ev != _EV_TIMEOUT) or mxl_monotonic_ns() >= deadline:
                    break
        self._gil_back()
        if ev != _EV_ENDED and ev != _EV_WAKE:
            return _EV_TIMEOUT, -1, 0
        return ev, slot, tag

    def wait(self, double timeout):
        """Receive and watch in one thread (GIL released) until something
        needs Python: (event, slot), slot -1 for EV_TIMEOUT / EV_WAKE.  Ends
        are reported until the slot is detached."""
        cdef int slot = -1, ev
        cdef int64_t tag = 0
        cdef int64_t now = mxl_monotonic_ns()
        cdef int64_t deadline = now + <int64_t>(max(timeout, 0.0) * 1e9)
        self._gil_away(now)
        with nogil:
            while True:
                ev = self._scan(False, &slot, &tag)
                if ev >= 0:
                    break
                if ev == _STORED:
                    continue
                ev = self._poll(_ON_SOCKETS | _ON_SENTINELS | _ON_WAKE_PIPE,
                                FrameReceiver._slice_ms(deadline, 0), &slot, &tag)
                if ev == _EV_ENDED:
                    # Its frames are read: one that needs Python comes first.
                    pthread_mutex_lock(&self._mu)
                    if self._store_all(slot) == _EV_FRAME:
                        ev = _EV_FRAME
                    pthread_mutex_unlock(&self._mu)
                    break
                if ev == _EV_WAKE or mxl_monotonic_ns() >= deadline:
                    if ev != _EV_WAKE:
                        ev = _EV_TIMEOUT
                    slot = -1
                    break
        self._gil_back()
        if ev == _EV_FRAME:
            self._passed_up += 1
        return ev, slot

    def end_gil_span(self):
        """The calling thread stops using this receiver for now: the time
        until its next wait() is not the fetcher's."""
        self._t_out = 0

    def drain(self, int slot, int64_t tag):
        """Read a worker's channel to its end (or until nothing is waiting)
        and store its batch frames; True if a frame that needs Python is
        first, False if none is left (or the slot now holds another worker)."""
        cdef int ev
        cdef mxl_channel *ch
        self._check_slot(slot)
        with nogil:
            pthread_mutex_lock(&self._mu)
            ch = &self._ch[slot]
            if ch.sock < 0 or ch.tag != tag:
                ev = _NOTHING
            else:
                while not ch.eof and mxl_channel_fill(ch) > 0:
                    pass
                ev = self._store_all(slot)
            pthread_mutex_unlock(&self._mu)
        return ev == _EV_FRAME

    def take_frame(self, int slot):
        """(header bytes, payload bytes, descriptors) of the slot's first
        complete frame, removed from the channel; EOFError if it announced
        more descriptors than arrived (closed here), LookupError if none is
        complete (another thread took it)."""
        cdef int nfds = 0, got = 0, found = 0
        cdef const char *header
        cdef const char *payload
        cdef uint32_t plen = 0
        cdef int fds[MXL_FDQ]
        cdef char *copy = NULL
        self._check_slot(slot)
        cdef mxl_channel *ch = &self._ch[slot]
        with nogil:
            pthread_mutex_lock(&self._mu)
            if ch.sock >= 0 and mxl_channel_next(ch, &header, &payload, &plen, &nfds):
                # Copied out under the mutex, made into Python objects after it.
                copy = <char *>malloc(MXL_FRAME_HEADER + <size_t>plen)
                if copy != NULL:
                    found = 1
                    memcpy(copy, header, MXL_FRAME_HEADER + <size_t>plen)
                    got = mxl_channel_take_fds(ch, nfds if nfds < MXL_FDQ else MXL_FDQ, fds)
                    mxl_channel_pop(ch, plen)
            pthread_mutex_unlock(&self._mu)
        if not found:
            if plen != 0 or nfds != 0:
                raise MemoryError(f"no memory to copy a frame of {plen} bytes")
            raise LookupError(f"no complete frame waiting in slot {slot}")
        try:
            head = PyBytes_FromStringAndSize(copy, MXL_FRAME_HEADER)
            data = PyBytes_FromStringAndSize(copy + MXL_FRAME_HEADER, plen)
        finally:
            free(copy)
        out = [fds[i] for i in range(got)]
        if got != nfds:
            import os as _os
            for fd in out:
                _os.close(fd)
            raise EOFError(f"a frame announced {nfds} descriptors and carried {got}")
        return head, data, out

    def stats(self):
        """GIL-held ns of the watcher thread (between its waits), batches
        stored without Python, frames passed up to Python."""
        return {"gil_ns": self._gil_ns, "stored": self._stored, "passed_up": self._passed_up}


@cython.final
@cython.auto_pickle(False)
cdef class ConsumerWait:
    """A transport's `receive` (its consumer's whole wait), compiled: `receiver`'s
    next_result with the transport's `holding`, `before_wait` and `on_event` bound once.
    The engine's window calls wait() (C); Python calls the object itself."""
    cdef FrameReceiver receiver
    cdef set holding
    cdef object before_wait, on_event

    def __cinit__(self, FrameReceiver receiver not None, set holding not None, before_wait, on_event):
        self.receiver = receiver
        self.holding = holding
        self.before_wait = before_wait
        self.on_event = on_event

    def __call__(self, Py_ssize_t idx, bint any_index, timeout, bint filling, Py_ssize_t epochs=-1):
        return self.wait(idx, any_index, timeout, filling, epochs)

    cdef object wait(self, Py_ssize_t idx, bint any_index, timeout, bint filling, Py_ssize_t epochs):
        return self.receiver._next_result(idx, any_index, timeout, filling, self.holding, self.before_wait,
                                          self.on_event, epochs)


def build_views(BatchOwner owner not None, list specs):
    """Numpy arrays over `owner`'s bytes, one per (offset, shape, dtype) of
    `specs` (dtype a numpy dtype), each with `owner` as its base (no copy)."""
    return _build_views(owner, specs)


cdef list _build_views(BatchOwner owner, list specs):
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
