# The main process's per-batch claim, compiled: a batch the receive path
# stored becomes numpy views of its slab, made from its worker's cached
# layout (task.pxi's send_tasks is the other half of the hand-off).  It works
# on the runtime's own objects (the worker's ProcessHandle), so that the
# Python fallbacks and the restart and shutdown paths see one state; what it
# cannot finish goes back to Python as a return value.

# How a ViewTemplate's field arrays make the batch.
VIEWS_ASSEMBLE = 0    # assemble(root, arrays) rebuilds any structure
VIEWS_ONE_ARRAY = 1   # the batch is its only field array
VIEWS_TUPLE = 2       # a plain tuple of the field arrays, in order

cdef object _NO_TASK = object()


cdef class ViewTemplate:
    """A batch layout made ready for every batch of that shape
    (layout.compile_template): each field's (offset, shape, dtype) for
    build_views, and how the field arrays make the batch (a VIEWS_ value;
    VIEWS_ASSEMBLE calls `assemble(root, arrays)`)."""
    cdef readonly object root
    cdef readonly list specs
    cdef readonly int shortcut
    cdef object _assemble

    def __cinit__(self, root, list specs not None, int shortcut, assemble):
        if shortcut not in (VIEWS_ASSEMBLE, VIEWS_ONE_ARRAY, VIEWS_TUPLE):
            raise ValueError(f"unknown views shortcut {shortcut}")
        if shortcut == VIEWS_ONE_ARRAY and len(specs) != 1:
            raise ValueError(f"a one-array template with {len(specs)} fields")
        self.root = root
        self.specs = specs
        self.shortcut = shortcut
        self._assemble = assemble

    cpdef object views(self, BatchOwner owner):
        """The batch, as numpy views over `owner`'s bytes (no copy)."""
        cdef list arrays = _build_views(owner, self.specs)
        if self.shortcut == VIEWS_TUPLE:
            return tuple(arrays)
        if self.shortcut == VIEWS_ONE_ARRAY:
            return arrays[0]
        return self._assemble(self.root, arrays)


cdef class ClaimMismatch:
    """claim_batch's answer for a batch whose frame names another slab than
    its task's, or a layout its worker never named: a protocol error, which
    the caller raises.  The task's slab went back to the pool."""
    cdef readonly object task_slab_id

    def __cinit__(self, task_slab_id):
        self.task_slab_id = task_slab_id


def claim_batch(RawBatch raw not None, list handles not None, release, BatchLender lender=None):
    """The batch the receive path stored for the worker in slot `raw.slot`
    (its ProcessHandle in `handles`): views of its task's slab, taken off
    the handle, from the layout the worker named before; `release(slab)`
    returns the slab to the pool when the batch's last view dies (or, with
    `lender`, its owner(): the slab's views, or a copy's).

    None if the task is no longer that handle's (its worker was replaced:
    the restart released the slab and sends the task again); a
    ClaimMismatch if the frame contradicts the task.  Claiming the same
    RawBatch again gives the same batch (a claim an exception cut short
    is finished, never lost), or the same ClaimMismatch."""
    if raw._mismatch is not None:
        return raw._mismatch   # a claim before found the frame contradicting its task
    if raw._owner is not None:
        # A claim before took the slab and was cut short (an exception from a
        # signal handler while the layout's Python code ran): finish it.
        return (<ViewTemplate>raw._template).views(<BatchOwner>raw._owner)
    if raw.slot >= len(handles):
        return None
    entry = handles[raw.slot]
    if entry is None:
        return None
    cdef WorkerChannel handle = <WorkerChannel?>entry
    if handle.tag != raw.tag:
        return None
    cdef dict slabs = handle.slabs
    slab = slabs.pop((raw.epoch, raw.idx), _NO_TASK)
    if slab is _NO_TASK:
        return None
    cached = handle.layouts.get(raw.layout_id)
    if slab is None or (<Slab?>slab).slab_id != raw.slab_id or cached is None:
        raw._mismatch = ClaimMismatch(None if slab is None else (<Slab>slab).slab_id)
        if slab is not None:
            release(slab)
        return raw._mismatch
    # Kept on the RawBatch before any Python code runs (VIEWS_ASSEMBLE): the
    # slab is off the handle now, and only this claim may hand it out.
    raw._template = <ViewTemplate?>(<tuple?>cached)[1]
    raw._owner = (BatchOwner(slab, 0, raw.nbytes, release) if lender is None
                  else lender.owner(<Slab?>slab, raw.nbytes))
    return (<ViewTemplate>raw._template).views(<BatchOwner>raw._owner)


@cython.final
@cython.auto_pickle(False)
cdef class _HandingNext:
    """EpochIterator.__next__, compiled: takes the iterator's `_next_lock`,
    calls the wrapped `_next(it)` and, once it returned a batch, clears
    ``it._ready_in.ready`` (where `_next` left the batch) before the lock
    is released.

    Compiled on purpose: a signal handler runs (and may raise) after any
    call made from Python bytecode, so in Python the batch `_next` returned
    could be lost between its return and the training loop.  No bytecode
    runs here: either the loop gets the batch, or the slot keeps it for the
    next call (NOTE [ Signal-safe hand-over ])."""
    cdef readonly object __wrapped__

    def __init__(self, fn):
        if not callable(fn):
            raise TypeError(f"expected a callable, got {type(fn).__name__}")
        self.__wrapped__ = fn

    def __get__(self, obj, objtype):
        return self if obj is None else _MethodType(self, obj)

    def __call__(self, it):
        lock = it._next_lock
        lock.acquire()
        try:
            batch = self.__wrapped__(it)
            it._ready_in.ready = None
        finally:
            lock.release()
        return batch

    def __repr__(self):
        return f"<handing_next of {self.__wrapped__!r}>"


def handing_next(fn):
    """The __next__ of an iterator whose `_next(it)` leaves the batch it
    returns in ``it._ready_in.ready``: `fn` under ``it._next_lock``, the slot
    cleared once it returned, compiled (see _HandingNext)."""
    return _HandingNext(fn)
