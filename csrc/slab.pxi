# Shared-memory slabs and the buffer owner that recycles them.
#
# A Slab maps a file descriptor (memfd on Linux) MAP_SHARED; workers and the
# main process map the same descriptor, so a worker collates straight into
# memory the main process reads without a copy.  A BatchOwner is what numpy
# arrays of one batch keep alive (their .base); when the last of them dies the
# owner's dealloc hands the slab back to its pool.  A batch the training loop
# keeps among many others may instead be copied out to private memory
# (BatchLender), so that its slab goes back to the pool at once.


cdef class Slab:
    """A read-write MAP_SHARED mapping of `size` bytes of file descriptor `fd`;
    `private`: `size` bytes of this process's heap memory instead (fd unused),
    64-byte aligned as a mapping's fields are.

    The mapping outlives the descriptor (the caller may close fd at once) and
    is unmapped when the Slab and every buffer exported from it are gone."""
    cdef char *_ptr
    cdef bint _heap
    cdef readonly Py_ssize_t size
    cdef readonly object slab_id

    def __cinit__(self, int fd, Py_ssize_t size, slab_id=None, bint populate=False, bint private=False):
        self._ptr = NULL
        self._heap = private
        if size <= 0:
            raise ValueError(f"slab size must be positive, got {size}")
        cdef void *p
        if self._heap:
            if posix_memalign(&p, 64, <size_t>size) != 0:
                raise MemoryError(f"could not allocate {size} bytes")
            self._ptr = <char *>p
            self.size = size
            self.slab_id = slab_id
            return
        cdef int flags = MAP_SHARED | (MXL_MAP_POPULATE if populate else 0)
        with nogil:
            p = mmap(NULL, <size_t>size, PROT_READ | PROT_WRITE, flags, fd, 0)
        if p == MAP_FAILED:
            import os as _os
            err = errno
            raise OSError(err, f"mmap of {size} bytes of shared memory failed ({_os.strerror(err)}); "
                               f"shared memory may be exhausted")
        self._ptr = <char *>p
        self.size = size
        self.slab_id = slab_id

    def __dealloc__(self):
        if self._ptr is not NULL:
            if self._heap:
                free(self._ptr)
            else:
                munmap(self._ptr, <size_t>self.size)
            self._ptr = NULL

    @property
    def shared(self):
        """Whether this is shared memory (a mapping), not a private copy."""
        return not self._heap

    @property
    def address(self):
        """Start address of the mapping in this process (for zero-copy checks)."""
        return <size_t>self._ptr

    def __getbuffer__(self, Py_buffer *buf, int flags):
        PyBuffer_FillInfo(buf, self, self._ptr, self.size, 0, flags)

    def __releasebuffer__(self, Py_buffer *buf):
        pass

    def __repr__(self):
        return f"<Slab id={self.slab_id!r} size={self.size}>"


# Not tracked by the cyclic GC: an owner holds only its slab and the pool's
# release callback, never anything that refers back to it, so it cannot be
# part of a cycle itself; and untracked, its fields are never cleared before
# __dealloc__, so a batch dropped inside some cyclic garbage still recycles.
@cython.no_gc
cdef class BatchOwner:
    """Owns one batch's bytes inside a slab; recycles the slab when freed.

    `on_release(slab)` runs once, when the last numpy view of the batch (and
    so this owner) is garbage-collected."""
    cdef readonly Slab slab
    cdef readonly Py_ssize_t offset
    cdef readonly Py_ssize_t nbytes
    cdef object _on_release

    def __cinit__(self, Slab slab not None, Py_ssize_t offset, Py_ssize_t nbytes, on_release=None):
        if offset < 0 or nbytes < 0 or offset > slab.size or nbytes > slab.size - offset:
            raise ValueError(f"range [{offset}, {offset + nbytes}) is outside slab of {slab.size} bytes")
        self.slab = slab
        self.offset = offset
        self.nbytes = nbytes
        self._on_release = on_release

    def __getbuffer__(self, Py_buffer *buf, int flags):
        PyBuffer_FillInfo(buf, self, self.slab._ptr + self.offset, self.nbytes, 0, flags)

    def __releasebuffer__(self, Py_buffer *buf):
        pass

    def detach(self):
        """Forget the release callback (the slab will not be recycled)."""
        self._on_release = None

    def __dealloc__(self):
        cb = self._on_release
        self._on_release = None
        if cb is not None and self.slab is not None:
            try:
                cb(self.slab)
            except KeyboardInterrupt:
                _rearm(SIGINT)   # Ctrl-C landed in the callback: not ours to swallow
            except BaseException:
                # A finalizer must not raise; a pool that is gone simply
                # lets the slab be unmapped.
                pass


@cython.final
@cython.auto_pickle(False)
cdef class FreeSlabs:
    """The free slabs of the main process's pool (mxload._runtime.local.slabs.SlabPool),
    compiled: the task send takes one per task (acquire) and each batch's last view gives
    its slab back (release, from BatchOwner's finalizer, on any thread), so both run once
    per batch.  Each is one C call with the GIL held: atomic without a lock, so a finalizer
    can never deadlock against the dispatch.  Only a slab still pooled (`pooled`, the
    pool's dict by slab id) is handed out; a retired one is dropped."""
    cdef list _free               # first in, first out (at most the pool's size)
    cdef dict _pooled
    cdef dict _counts             # the pool's counters: "slabs_reused"
    cdef bint _closed
    cdef Py_ssize_t _fewest       # the fewest free since the last trim: slabs nothing needed

    def __cinit__(self, dict pooled not None, dict counts not None):
        self._free = []
        self._pooled = pooled
        self._counts = counts
        self._closed = False
        self._fewest = 0

    def acquire(self, known=None):
        """A free slab, or None (the worker then makes a new one): the oldest free one
        whose id is in `known` (the slabs the worker it goes to has mapped: no descriptor
        to send, no page to fault in there again), else the oldest free one."""
        cdef Slab slab
        cdef Py_ssize_t i = 0, pick = -1
        while i < len(self._free):
            slab = <Slab>self._free[i]
            if slab.slab_id not in self._pooled:
                del self._free[i]     # retired meanwhile
                continue
            if pick < 0:
                pick = i
            if known is None or slab.slab_id in known:
                pick = i
                break
            i += 1
        if pick < 0:
            self._fewest = 0
            return None
        slab = <Slab>self._free.pop(pick)
        self._counts["slabs_reused"] += 1
        if len(self._free) < self._fewest:
            self._fewest = len(self._free)
        return slab

    def release(self, Slab slab not None):
        """`slab` is free again (a batch's last view died)."""
        if not self._closed and slab.slab_id in self._pooled:
            self._free.append(slab)

    def close(self):
        """Hand out nothing from now on."""
        self._closed = True
        del self._free[:]

    def trim(self, Py_ssize_t keep):
        """Take the free slabs that stayed free since the last trim (none
        was needed meanwhile), beyond the first `keep` still pooled, out of
        the free list (the last freed first) and return them.  A slab a loop
        needs every epoch (it keeps its batches until the next) is kept."""
        cdef list out = []
        cdef Py_ssize_t unused = self._fewest
        self._free = [slab for slab in self._free if (<Slab>slab).slab_id in self._pooled]
        while len(self._free) > keep and unused > 0:
            out.append(self._free.pop())
            unused -= 1
        self._fewest = len(self._free)
        return out

    def __len__(self):
        return len(self._free)


@cython.final
@cython.auto_pickle(False)
cdef class BatchLender:
    """Makes the owner of each batch the main process hands to the training
    loop, and counts the slabs such batches hold (`lent`: handed out, some
    view still alive).  A loop that keeps many batches (a list of them, a
    cache) would pin a slab each: a mapping (vm.max_map_count, 65530 by
    default, caps them) and at least a 64 KiB slab for a batch of a few
    bytes, and with the pool's slabs all pinned every next batch needs a new
    slab, made by the worker and passed to this process.  So once
    `copy_from_lent` slabs are lent, a batch of at most `copy_max_bytes` is
    copied to private memory (an allocation of its own size, not a
    mapping) and its slab freed at once.  Below that, and for larger
    batches, the loop gets views of the slab itself (no copy).  One C call
    with the GIL held, as FreeSlabs's."""
    cdef FreeSlabs _free
    cdef dict _counts                   # the pool's counters: "batches_copied"
    cdef object _returned               # bound once: the callback every lent batch's owner gets
    cdef readonly Py_ssize_t lent
    cdef public Py_ssize_t copy_from_lent
    cdef public Py_ssize_t copy_max_bytes

    def __cinit__(self, FreeSlabs free not None, dict counts not None, Py_ssize_t copy_from_lent,
                  Py_ssize_t copy_max_bytes):
        self._free = free
        self._counts = counts
        self._returned = self.returned
        self.lent = 0
        self.copy_from_lent = copy_from_lent
        self.copy_max_bytes = copy_max_bytes

    cpdef BatchOwner owner(self, Slab slab, Py_ssize_t nbytes):
        """The owner of a batch of `nbytes` at the start of `slab`, from which
        its views are made: the slab's, or a private copy's."""
        cdef Slab copy
        if self.lent < self.copy_from_lent or nbytes > self.copy_max_bytes or nbytes <= 0:
            owner = BatchOwner(slab, 0, nbytes, self._returned)
            self.lent += 1
            return owner
        copy = Slab(-1, nbytes, private=True)
        # With the GIL: a few µs at most, where giving it up could cost the loop a switch interval.
        memcpy(copy._ptr, slab._ptr, <size_t>nbytes)
        self._counts["batches_copied"] += 1
        self._free.release(slab)
        return BatchOwner(copy, 0, nbytes)

    def returned(self, Slab slab not None):
        """A lent batch's last view died: its slab is free again."""
        self.lent -= 1
        self._free.release(slab)
