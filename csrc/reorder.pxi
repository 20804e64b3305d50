# ReorderBuffer: batches arrive out of order (from the fetcher thread), the
# consumer takes them in order.  A native mutex + condition variable guard it;
# every wait happens with the GIL released.
#
# Lock discipline (why there is no deadlock with the GIL): a thread only ever
# *blocks* on the mutex inside `with nogil` (a try-lock comes first, which
# never blocks), so a thread blocked on the mutex never holds the GIL.  While holding the mutex a thread may take the GIL back and
# touch the dict, but it never runs arbitrary Python code (no signal handlers,
# no finalizers of stored items) until it has unlocked.

from heapq import heappush, heappop


class BufferClosedError(RuntimeError):
    """Raised by ReorderBuffer operations after close()."""


cdef object _MISSING = object()
# A wait is cut into slices so a blocked consumer wakes to run signal
# handlers (Ctrl-C) even if nothing is ever put.
cdef double _WAIT_SLICE_S = 0.05
cdef double _MAX_TIMEOUT_S = 1e9


cdef inline void _abs_deadline(timespec *ts, double seconds) noexcept nogil:
    clock_gettime(CLOCK_REALTIME, ts)
    cdef long whole = <long>seconds
    cdef long nsec = ts.tv_nsec + <long>((seconds - whole) * 1e9)
    ts.tv_sec += whole + nsec // 1000000000
    ts.tv_nsec = nsec % 1000000000


cdef class ReorderBuffer:
    """Thread-safe map from batch index to item with blocking, GIL-free waits.

    put(idx, item)        store; a duplicate index is an error
    get(idx, timeout)     wait for idx (GIL released), remove and return it
    try_get(idx, default) non-blocking get
    pop_next(timeout)     wait for any index, remove and return (idx, item)
                          with the smallest index available
    close(reason)         wake every waiter with BufferClosedError
    clear()               drop and return everything stored
    """
    cdef pthread_mutex_t _mutex
    cdef pthread_cond_t _cond
    cdef dict _items
    cdef list _order      # min-heap of indices for pop_next (lazily pruned)
    cdef bint _closed
    cdef object _reason

    def __cinit__(self):
        if pthread_mutex_init(&self._mutex, NULL) != 0:
            raise MemoryError("pthread_mutex_init failed")
        if pthread_cond_init(&self._cond, NULL) != 0:
            pthread_mutex_destroy(&self._mutex)
            raise MemoryError("pthread_cond_init failed")
        self._items = {}
        self._order = []
        self._closed = False
        self._reason = None

    def __dealloc__(self):
        pthread_cond_destroy(&self._cond)
        pthread_mutex_destroy(&self._mutex)

    cdef inline void _lock(self):
        # Uncontended (the common case): take it without releasing the GIL,
        # which would hand the GIL to the other thread and cost two context
        # switches per put/get.  Contended: wait with the GIL released.
        if pthread_mutex_trylock(&self._mutex) != 0:
            with nogil:
                pthread_mutex_lock(&self._mutex)

    cdef inline void _unlock(self) noexcept:
        pthread_mutex_unlock(&self._mutex)

    cdef object _closed_error(self):
        msg = "ReorderBuffer is closed"
        if self._reason is not None:
            msg += ": " + str(self._reason)
        return BufferClosedError(msg)

    def put(self, Py_ssize_t idx, item):
        self._lock()
        try:
            if self._closed:
                raise self._closed_error()
            if idx in self._items:
                raise KeyError(f"batch index {idx} is already in the ReorderBuffer")
            self._items[idx] = item
            heappush(self._order, idx)
            if len(self._order) > 2 * len(self._items) + 64:
                # get() leaves stale heap entries; rebuild before they pile up.
                self._order = sorted(self._items)
            pthread_cond_broadcast(&self._cond)
        finally:
            self._unlock()

    def try_get(self, Py_ssize_t idx, default=None):
        self._lock()
        try:
            if self._closed:
                raise self._closed_error()
            return self._items.pop(idx, default)
        finally:
            self._unlock()

    cdef object _wait(self, Py_ssize_t idx, bint any_index, timeout):
        cdef double remaining = -1.0
        cdef double slice_s
        cdef timespec ts
        cdef int64_t deadline_ns = 0
        if timeout is not None:
            if not timeout >= 0:
                raise ValueError(f"timeout must be >= 0 or None, got {timeout!r}")
            if timeout > _MAX_TIMEOUT_S:
                timeout = None  # longer than any run: wait forever (no overflow)
            else:
                deadline_ns = mxl_monotonic_ns() + <int64_t>(timeout * 1e9)
        while True:
            self._lock()
            try:
                if self._closed:
                    raise self._closed_error()
                if any_index:
                    while self._order:
                        key = heappop(self._order)
                        item = self._items.pop(key, _MISSING)
                        if item is not _MISSING:
                            return key, item
                else:
                    item = self._items.pop(idx, _MISSING)
                    if item is not _MISSING:
                        return item
                if timeout is not None:
                    remaining = (deadline_ns - mxl_monotonic_ns()) / 1e9
                    if remaining <= 0:
                        what = "any batch" if any_index else f"batch {idx}"
                        raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
                slice_s = _WAIT_SLICE_S if (remaining < 0 or remaining > _WAIT_SLICE_S) else remaining
                _abs_deadline(&ts, slice_s)
                with nogil:
                    pthread_cond_timedwait(&self._cond, &self._mutex, &ts)
            finally:
                self._unlock()
            # Outside the mutex: let Python run pending signal handlers so
            # Ctrl-C interrupts a consumer blocked here.
            PyErr_CheckSignals()

    def get(self, Py_ssize_t idx, timeout=None):
        """Wait for batch `idx`, remove it and return it."""
        return self._wait(idx, False, timeout)

    def pop_next(self, timeout=None):
        """Wait for any batch; return (idx, item) with the smallest idx stored."""
        return self._wait(0, True, timeout)

    def close(self, reason=None):
        self._lock()
        try:
            if not self._closed:
                self._closed = True
                self._reason = reason
            pthread_cond_broadcast(&self._cond)
        finally:
            self._unlock()

    @property
    def closed(self):
        return self._closed

    def clear(self):
        """Remove everything; return the removed items as a dict.

        The items are released by the caller after the mutex is dropped, so
        their finalizers (slab recycling) never run under the lock."""
        self._lock()
        try:
            items, self._items = self._items, {}
            self._order = []
        finally:
            self._unlock()
        return items

    def __len__(self):
        self._lock()
        try:
            return len(self._items)
        finally:
            self._unlock()

    def __contains__(self, Py_ssize_t idx):
        self._lock()
        try:
            return idx in self._items
        finally:
            self._unlock()
