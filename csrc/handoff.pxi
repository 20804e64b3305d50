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


def claim_batch(RawBatch raw not None, list handles not None, release):
    """The batch the receive path stored for the worker in slot `raw.slot`
    (its ProcessHandle in `handles`): views of its task's slab, taken off
    the handle, from the layout the worker named before; `release(slab)`
    returns the slab to the pool when the batch's last view dies.

    None if the task is no longer that handle's (its worker was replaced:
    the restart released the slab and sends the task again); a
    ClaimMismatch if the frame contradicts the task."""
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
        if slab is not None:
            release(slab)
        return ClaimMismatch(None if slab is None else (<Slab>slab).slab_id)
    return (<ViewTemplate?>(<tuple?>cached)[1]).views(BatchOwner(slab, 0, raw.nbytes, release))
