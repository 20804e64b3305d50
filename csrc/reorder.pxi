# ReorderBuffer: batches arrive out of order (from the fetcher thread), the
# consumer takes them in order.  Every wait happens with the GIL released.
#
# NOTE [ Native mutexes touch no Python ]
# Lock discipline.  The Python state (_items, _order, _closed, _reason) is
# guarded by the GIL alone: each method reads and updates it in Cython code
# that runs no Python code in between (int keys; nothing that calls back).
# (This module does not declare free-threading support, so a free-threaded
# CPython keeps the GIL enabled while it is loaded.)
# The native mutex guards only C state: the _generation counter that every
# put() and close() bumps, and the condition variable a waiter sleeps on.
# Nothing runs under the mutex but C: no allocation (which on CPython <= 3.11
# may start a collection, whose finalizers may call close() on this very
# buffer), no Py_DECREF (which may run a finalizer), no Python call.  So code
# that re-enters the buffer from a collection never finds the mutex held by
# its own thread.  A thread blocks on the mutex only with the GIL released
# (a try-lock comes first, which never blocks), and never takes the GIL back
# while holding it, so the two locks cannot deadlock either.
#
# A waiter reads the generation *before* looking for its item and sleeps only
# while the generation is unchanged: an item put after the look bumps it, so
# no wake-up is lost.
#
# Raw entries.  The fetcher's compiled receive path (receive.pxi) stores a
# batch without the GIL: put_raw() copies a C struct (batch index, worker
# slot, slab id, byte count, layout id) into a C array under the mutex.  The
# consumer finds it under the same mutex and turns it into a RawBatch (a
# Python object) only after unlocking; the engine builds the views.  So the
# raw array and _c_closed are guarded by the mutex, not by the GIL.

from heapq import heappush, heappop
from libc.stdlib cimport free, realloc


@cython.final
@cython.auto_pickle(False)   # a main-process record: it never crosses processes
cdef class RawBatch:
    """A batch the compiled receive path stored: which worker slot sent it,
    for which epoch and batch index, in which slab (id), how many bytes, and
    which of that worker's cached layouts describes it."""
    cdef readonly int slot
    cdef readonly int64_t tag
    cdef readonly int64_t epoch
    cdef readonly int64_t idx
    cdef readonly int64_t slab_id
    cdef readonly int64_t nbytes
    cdef readonly int64_t layout_id
    # Set by claim_batch once it took the task's slab: the batch's owner and
    # layout, so that a claim cut short (a signal handler raising in the
    # layout's Python code) is finished by the next claim of this RawBatch.
    cdef object _owner
    cdef object _template
    # Set by claim_batch when the frame contradicted its task (the slab went back to the pool):
    # a claim again gives the same ClaimMismatch, never None ("its task is gone"), so an
    # exception that cut the error's path short cannot turn the failure into a wait for a
    # batch no worker will send.
    cdef object _mismatch

    def __repr__(self):
        return (f"RawBatch(slot={self.slot}, tag={self.tag}, epoch={self.epoch}, idx={self.idx}, slab_id={self.slab_id}, "
                f"nbytes={self.nbytes}, layout_id={self.layout_id})")


cdef RawBatch _raw_batch(const mxl_raw_entry *e):
    cdef RawBatch b = RawBatch.__new__(RawBatch)
    b.slot = e.slot
    b.tag = e.tag
    b.epoch = e.frame.epoch
    b.idx = e.frame.idx
    b.slab_id = e.frame.slab_id
    b.nbytes = e.frame.nbytes
    b.layout_id = e.frame.layout_id
    return b


class BufferClosedError(RuntimeError):
    """Raised by ReorderBuffer operations after close()."""


class EpochOverError(RuntimeError):
    """Raised by a wait given the buffer's `epochs` count once that epoch is
    over (end_epoch, or start_epoch of the next): what it waited for is no
    longer its to take."""


cdef object _MISSING = object()
# A wait is cut into slices so a blocked consumer wakes to run signal
# handlers (Ctrl-C) even if nothing is ever put.
cdef double _WAIT_SLICE_S = 0.05
cdef double _MAX_TIMEOUT_S = 1e9


cdef class ReorderBuffer:
    """Thread-safe map from batch index to item with blocking, GIL-free waits.

    put(idx, item)        store; a duplicate index is an error
    get(idx, timeout)     wait for idx (GIL released), remove and return it
    try_get(idx, default) non-blocking get
    pop_next(timeout)     wait for any index, remove and return (idx, item)
                          with the smallest index available
    close(reason)         wake every waiter with BufferClosedError
    start_epoch(epoch)    clear(); wake every waiter given the `epochs`
                          count before it with EpochOverError
    end_epoch()           wake those waiters only (persistent workers stay)
    clear()               drop and return everything stored
    """
    cdef pthread_mutex_t _mutex
    cdef pthread_cond_t _cond
    cdef uint64_t _generation  # bumped by put() and close(); under _mutex
    cdef dict _items
    cdef list _order      # min-heap of indices for pop_next (lazily pruned)
    cdef bint _closed
    cdef object _reason
    cdef mxl_raw_entry *_raw   # under _mutex: batches put_raw() stored
    cdef Py_ssize_t _nraw
    cdef Py_ssize_t _rawcap
    cdef bint _c_closed        # under _mutex: close() as put_raw() sees it
    cdef int64_t _raw_epoch    # under _mutex: put_raw() stores batches of this epoch only
    # Epoch changes so far, start_epoch() and end_epoch() calls (changed and read with the GIL
    # held).  A wait given it ends with EpochOverError once it moves: a consumer of an epoch
    # that is over (another thread's superseded iterator) must not take the next epoch's
    # batches nor wait for one that will never be sent.
    cdef readonly Py_ssize_t epochs
    # A FrameReceiver's consumer wake-up (eventfd) while one receives for this
    # buffer, else -1: put() and close() signal it, so a consumer waiting in
    # the receiver's poll() sees them (see receive.pxi).  Set and read with
    # the GIL held.
    cdef int _wake_fd
    # Threads in get()/pop_next() that found nothing and are committed to waiting
    # (changed and read with the GIL held): what a test or a debugger can poll
    # instead of sleeping and hoping the other thread got there.
    cdef Py_ssize_t _waiting
    # With keep_handover set (the engine's buffer): the (idx, item) a
    # consumer's wait (get, pop_next, FrameReceiver.get) took last, until the
    # consumer sets it back to None.  An exception that cuts the hand-over
    # short (a signal handler's, raised in the Python code between this wait
    # and the training loop) leaves the batch here for the next call instead
    # of losing it: the first slot of NOTE [ Signal-safe hand-over ] (handoff.pxi).
    cdef public object handover
    cdef public bint keep_handover

    def __cinit__(self):
        self._waiting = 0
        self.handover = None
        self.keep_handover = False
        self._raw = NULL
        self._nraw = self._rawcap = 0
        self._c_closed = False
        self._raw_epoch = -1
        self._wake_fd = -1
        if pthread_mutex_init(&self._mutex, NULL) != 0:
            raise MemoryError("pthread_mutex_init failed")
        if mxl_cond_init(&self._cond) != 0:
            pthread_mutex_destroy(&self._mutex)
            raise MemoryError("pthread_cond_init failed")
        self._generation = 0
        self._items = {}
        self._order = []
        self._closed = False
        self._reason = None

    def __dealloc__(self):
        free(self._raw)
        pthread_cond_destroy(&self._cond)
        pthread_mutex_destroy(&self._mutex)

    cdef inline void _lock(self) noexcept:
        # Uncontended (the common case): take it without releasing the GIL,
        # which would hand the GIL to the other thread and cost two context
        # switches per put/get.  Contended: wait with the GIL released.
        if pthread_mutex_trylock(&self._mutex) != 0:
            with nogil:
                pthread_mutex_lock(&self._mutex)

    cdef inline uint64_t _generation_now(self) noexcept:
        cdef uint64_t g
        self._lock()
        g = self._generation
        pthread_mutex_unlock(&self._mutex)
        return g

    cdef inline void _notify(self) noexcept:
        """Wake every waiter: something was put, or the buffer closed."""
        self._lock()
        self._generation += 1
        if self._closed:
            self._c_closed = True
        pthread_cond_broadcast(&self._cond)
        pthread_mutex_unlock(&self._mutex)
        if self._wake_fd >= 0:
            mxl_event_signal(self._wake_fd)

    cdef int put_raw(self, const mxl_raw_entry *e) noexcept nogil:
        """Store a batch without the GIL: 0 stored, 1 the buffer is closed,
        2 its index is already stored raw, 3 out of memory, 4 it is of
        another epoch than start_epoch() set."""
        cdef Py_ssize_t i
        cdef mxl_raw_entry *grown
        pthread_mutex_lock(&self._mutex)
        if self._c_closed:
            pthread_mutex_unlock(&self._mutex)
            return 1
        if e.frame.epoch != self._raw_epoch:
            pthread_mutex_unlock(&self._mutex)
            return 4
        for i in range(self._nraw):
            if self._raw[i].frame.idx == e.frame.idx:
                pthread_mutex_unlock(&self._mutex)
                return 2
        if self._nraw == self._rawcap:
            grown = <mxl_raw_entry *>realloc(self._raw, (2 * self._rawcap + 8) * sizeof(mxl_raw_entry))
            if grown == NULL:
                pthread_mutex_unlock(&self._mutex)
                return 3
            self._raw = grown
            self._rawcap = 2 * self._rawcap + 8
        self._raw[self._nraw] = e[0]
        self._nraw += 1
        self._generation += 1
        pthread_cond_broadcast(&self._cond)
        pthread_mutex_unlock(&self._mutex)
        return 0

    cdef bint _take_raw(self, Py_ssize_t idx, bint below, mxl_raw_entry *out) noexcept:
        """Remove the raw entry for batch `idx` into `out` (below=True: the
        one with the smallest index, if smaller than `idx`)."""
        cdef Py_ssize_t i, k = -1
        self._lock()
        for i in range(self._nraw):
            if below:
                if self._raw[i].frame.idx < idx and (k < 0 or self._raw[i].frame.idx < self._raw[k].frame.idx):
                    k = i
            elif self._raw[i].frame.idx == idx:
                k = i
                break
        if k >= 0:
            out[0] = self._raw[k]
            self._nraw -= 1
            self._raw[k] = self._raw[self._nraw]
        pthread_mutex_unlock(&self._mutex)
        return k >= 0

    cdef Py_ssize_t _raw_count(self, Py_ssize_t idx, bint only_idx) noexcept:
        cdef Py_ssize_t i, n = 0
        self._lock()
        for i in range(self._nraw):
            if not only_idx or self._raw[i].frame.idx == idx:
                n += 1
        pthread_mutex_unlock(&self._mutex)
        return n

    cdef uint64_t _wait_for_change(self, uint64_t seen, double seconds) noexcept nogil:
        """Sleep until the generation differs from `seen` or `seconds` pass;
        return the generation at wake-up."""
        cdef timespec ts
        mxl_cond_deadline(&ts, seconds)
        pthread_mutex_lock(&self._mutex)
        while self._generation == seen:
            if pthread_cond_timedwait(&self._cond, &self._mutex, &ts) != 0:
                break  # timed out: the caller checks its deadline and signals
        seen = self._generation
        pthread_mutex_unlock(&self._mutex)
        return seen

    cdef object _closed_error(self):
        msg = "ReorderBuffer is closed"
        if self._reason is not None:
            msg += ": " + str(self._reason)
        return BufferClosedError(msg)

    cdef int _check_wait(self, Py_ssize_t epochs) except -1:
        """What ends a wait before it looks again (GIL held): the buffer closed, or the epoch
        the waiter was given (`epochs`, this buffer's count then; -1: none) over."""
        if self._closed:
            raise self._closed_error()
        if epochs >= 0 and epochs != self.epochs:
            raise EpochOverError(f"epoch {epochs} of this buffer is over (now {self.epochs})")
        return 0

    def put(self, Py_ssize_t idx, item):
        if self._closed:
            raise self._closed_error()
        if idx in self._items:
            raise KeyError(f"batch index {idx} is already in the ReorderBuffer")
        self._items[idx] = item
        heappush(self._order, idx)
        if len(self._order) > 2 * len(self._items) + 64:
            # get() leaves stale heap entries; rebuild before they pile up.
            self._order = sorted(self._items)
        self._notify()

    def try_get(self, Py_ssize_t idx, default=None):
        if self._closed:
            raise self._closed_error()
        found = self._pop(idx)
        return default if found is _MISSING else found

    cdef object _pop(self, Py_ssize_t idx):
        """The item stored for `idx` (a RawBatch if stored raw), or _MISSING."""
        cdef mxl_raw_entry e
        found = self._items.pop(idx, _MISSING)
        if found is _MISSING and self._nraw_hint() and self._take_raw(idx, False, &e):
            return _raw_batch(&e)
        return found

    cdef inline bint _nraw_hint(self) noexcept:
        # A racy read is enough: a raw entry stored after it bumps the
        # generation, and the waiter looks again before sleeping.
        return (<volatile Py_ssize_t *>&self._nraw)[0] != 0

    cdef object _pop_smallest(self):
        """(idx, item) with the smallest idx stored, or _MISSING."""
        cdef mxl_raw_entry e
        cdef Py_ssize_t limit = PY_SSIZE_T_MAX
        while self._order and self._order[0] not in self._items:
            heappop(self._order)   # taken by get(): a stale heap entry
        if not self._order and self._items:
            # A put interleaved by a finalizer between its two updates left
            # a key off the heap: rebuild rather than ever miss an item.
            self._order = sorted(self._items)
        if self._order:
            limit = self._order[0]
        if self._nraw_hint() and self._take_raw(limit, True, &e):
            return e.frame.idx, _raw_batch(&e)
        if self._order:
            key = heappop(self._order)
            return key, self._items.pop(key)
        return _MISSING

    cdef object _wait(self, Py_ssize_t idx, bint any_index, timeout, Py_ssize_t epochs):
        cdef double remaining = -1.0
        cdef double slice_s
        cdef int64_t deadline_ns = 0
        cdef uint64_t seen = 0
        cdef bint armed = False
        if timeout is not None:
            if not timeout >= 0:
                raise ValueError(f"timeout must be >= 0 or None, got {timeout!r}")
            if timeout > _MAX_TIMEOUT_S:
                timeout = None  # longer than any run: wait forever (no overflow)
            else:
                deadline_ns = mxl_monotonic_ns() + <int64_t>(timeout * 1e9)
        try:
            while True:
                self._check_wait(epochs)
                if any_index:
                    found = self._pop_smallest()
                else:
                    found = self._pop(idx)
                if found is not _MISSING:
                    if self.keep_handover:
                        self.handover = found if any_index else (idx, found)
                    return found
                if not armed:
                    # Read the generation, then look once more: an item put
                    # between the first look and this read is found by the
                    # second look; one put after it wakes the wait below.
                    seen = self._generation_now()
                    armed = True
                    self._waiting += 1
                    continue
                if timeout is not None:
                    remaining = (deadline_ns - mxl_monotonic_ns()) / 1e9
                    if remaining <= 0:
                        what = "any batch" if any_index else f"batch {idx}"
                        raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
                slice_s = _WAIT_SLICE_S if (remaining < 0 or remaining > _WAIT_SLICE_S) else remaining
                with nogil:
                    seen = self._wait_for_change(seen, slice_s)
                # Let Python run pending signal handlers so Ctrl-C interrupts a
                # consumer blocked here.
                PyErr_CheckSignals()
        finally:
            if armed:
                self._waiting -= 1

    @property
    def waiting(self):
        """How many threads wait in get()/pop_next() now (found nothing, committed to waiting)."""
        return self._waiting

    def get(self, Py_ssize_t idx, timeout=None, Py_ssize_t epochs=-1):
        """Wait for batch `idx`, remove it and return it.  With `epochs` (the
        buffer's count when the caller's epoch began): EpochOverError once
        that epoch is over."""
        return self._wait(idx, False, timeout, epochs)

    def pop_next(self, timeout=None, Py_ssize_t epochs=-1):
        """Wait for any batch; return (idx, item) with the smallest idx stored
        (`epochs` as for get())."""
        return self._wait(0, True, timeout, epochs)

    def close(self, reason=None):
        if not self._closed:
            self._closed = True
            self._reason = reason
        self._notify()

    @property
    def closed(self):
        return self._closed

    def clear(self):
        """Remove everything; return the removed items as a dict.

        The caller releases the items, so their finalizers (slab recycling)
        run outside this call."""
        return self._clear(False, 0)

    def start_epoch(self, int64_t epoch):
        """clear(), and from now on store raw batches of `epoch` only (in
        one step: a batch of the previous epoch is either removed here or
        refused).  A wait given the count of epochs before ends."""
        items = self._clear(True, epoch)
        self.end_epoch()
        return items

    def end_epoch(self):
        """The epoch being served is over: a wait given its count ends with
        EpochOverError.  What the buffer holds stays (start_epoch clears it)."""
        self.epochs += 1
        self._notify()

    def take_raw(self, int64_t tag):
        """Remove and return (as RawBatch objects, by index) the raw batches
        stored with `tag` (those of a worker that died)."""
        cdef Py_ssize_t i = 0
        cdef mxl_raw_entry e
        cdef dict out = {}
        while True:
            self._lock()
            while i < self._nraw and self._raw[i].tag != tag:
                i += 1
            if i >= self._nraw:
                pthread_mutex_unlock(&self._mutex)
                return out
            e = self._raw[i]
            self._nraw -= 1
            self._raw[i] = self._raw[self._nraw]
            pthread_mutex_unlock(&self._mutex)
            out[e.frame.idx] = _raw_batch(&e)

    cdef dict _clear(self, bint set_epoch, int64_t epoch):
        cdef mxl_raw_entry *raw
        cdef Py_ssize_t i, n
        items = self._items
        self._items = {}
        self._order = []
        handover, self.handover = self.handover, None
        if handover is not None and handover[0] not in items:
            items[handover[0]] = handover[1]
        self._lock()
        raw, n = self._raw, self._nraw
        self._raw = NULL
        self._nraw = self._rawcap = 0
        if set_epoch:
            self._raw_epoch = epoch
        pthread_mutex_unlock(&self._mutex)
        try:
            for i in range(n):
                items[raw[i].frame.idx] = _raw_batch(&raw[i])
        finally:
            free(raw)
        return items

    def __len__(self):
        return len(self._items) + self._raw_count(0, False)

    def __contains__(self, Py_ssize_t idx):
        return idx in self._items or self._raw_count(idx, True) > 0
