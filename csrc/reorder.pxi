# ReorderBuffer: batches arrive out of order (from the fetcher thread), the
# consumer takes them in order.  Every wait happens with the GIL released.
#
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

from heapq import heappush, heappop


class BufferClosedError(RuntimeError):
    """Raised by ReorderBuffer operations after close()."""


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
    clear()               drop and return everything stored
    """
    cdef pthread_mutex_t _mutex
    cdef pthread_cond_t _cond
    cdef uint64_t _generation  # bumped by put() and close(); under _mutex
    cdef dict _items
    cdef list _order      # min-heap of indices for pop_next (lazily pruned)
    cdef bint _closed
    cdef object _reason

    def __cinit__(self):
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
        pthread_cond_broadcast(&self._cond)
        pthread_mutex_unlock(&self._mutex)

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
        return self._items.pop(idx, default)

    cdef object _pop_smallest(self):
        """(idx, item) with the smallest idx stored, or _MISSING."""
        while self._order:
            key = heappop(self._order)
            item = self._items.pop(key, _MISSING)
            if item is not _MISSING:
                return key, item
        if self._items:
            # A put interleaved by a finalizer between its two updates left
            # a key off the heap: rebuild rather than ever miss an item.
            self._order = sorted(self._items)
            return self._pop_smallest()
        return _MISSING

    cdef object _wait(self, Py_ssize_t idx, bint any_index, timeout):
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
        while True:
            if self._closed:
                raise self._closed_error()
            if any_index:
                found = self._pop_smallest()
            else:
                found = self._items.pop(idx, _MISSING)
            if found is not _MISSING:
                return found
            if not armed:
                # Read the generation, then look once more: an item put
                # between the first look and this read is found by the
                # second look; one put after it wakes the wait below.
                seen = self._generation_now()
                armed = True
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

    def get(self, Py_ssize_t idx, timeout=None):
        """Wait for batch `idx`, remove it and return it."""
        return self._wait(idx, False, timeout)

    def pop_next(self, timeout=None):
        """Wait for any batch; return (idx, item) with the smallest idx stored."""
        return self._wait(0, True, timeout)

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
        items = self._items
        self._items = {}
        self._order = []
        return items

    def __len__(self):
        return len(self._items)

    def __contains__(self, Py_ssize_t idx):
        return idx in self._items
