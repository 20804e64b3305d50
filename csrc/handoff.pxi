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
    return _claim_batch(raw, handles, release, lender)


@cython.final
@cython.auto_pickle(False)
cdef class RawClaim:
    """A transport's `claim_raw`, compiled: claim_batch with the transport's worker
    `handles`, `release` and `lender` bound once.  The engine's window calls claim() (C);
    Python calls the object itself."""
    cdef list handles
    cdef object release
    cdef BatchLender lender

    def __cinit__(self, list handles not None, release, BatchLender lender=None):
        self.handles = handles
        self.release = release
        self.lender = lender

    def __call__(self, RawBatch raw not None):
        return _claim_batch(raw, self.handles, self.release, self.lender)

    cdef object claim(self, RawBatch raw):
        return _claim_batch(raw, self.handles, self.release, self.lender)


cdef object _claim_batch(RawBatch raw, list handles, release, BatchLender lender):
    """claim_batch, for C callers."""
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


# NOTE [ Signal-safe hand-over ]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A Python signal handler runs, and may raise, between any two bytecodes of the thread that
# calls next(): a program's SIGALRM step timeout, a Ctrl-C the loop catches and ignores, a
# SIGTERM handler that checkpoints.  A loop that catches such an exception and goes on must
# still get every batch once, in order (as torch's does), and a checkpoint must count exactly
# the batches the loop got.  So a batch travels from its worker to the loop through slots,
# each moved to the next by plain stores in C, with no Python code between the take from one
# slot and the store into the next:
#
#   1. the buffer's `handover` (ReorderBuffer.keep_handover): the consumer's wait
#      (ReorderBuffer.get/pop_next, FrameReceiver.get) leaves the batch there as it takes
#      it out of the buffer.  A claim of a RawBatch that an exception cut short is finished
#      by claiming it again (claim_batch keeps the taken slab on the RawBatch).
#   2. `Handover.ready`: EngineWindow.next_batch's commit (the task out of the books, the
#      batch out of `due`, the counts) moves it there and clears the buffer's slot; the
#      in-process producer (epoch.InProcessBatches) stores it there directly.  Either also
#      moves the BatchSupply's `handed` past it in the same stores.
#   3. `Handover.handing()`: once next() returns the batch, the compiled __next__
#      (handing_next) moves its index into `pending` and clears `ready`, then returns it
#      with no bytecode in between: the loop has the batch, or `ready` still holds it and
#      the next call returns it (each producer looks in `ready` before making another).
#   4. `Handover.settle()`: at the start of the next call (or of the next epoch, or in a
#      checkpoint's count) the pending index is counted taken (EpochProgress.taken, which
#      counts an index once however often it is called), then cleared.
#
# One Handover per epoch (epoch.start_epoch makes it): every producer of the epoch stores
# into it, the engine's window from begin_epoch on (persistent workers serve one epoch after
# another), num_workers="auto"'s in-process and engine producers in turn, so a switch never
# loses a batch kept there.  Its `lock` gives each batch to one caller: threads sharing an
# iterator take turns, the compiled __next__ holding it from settle() to handing().
# A step that cannot be retried (a transport without put_task dispatches in Python:
# EngineWindow.torn) aborts the epoch (EpochAbortedError), never loses nor repeats a batch;
# every other step between the wait and the loop is retry-safe.
# Tests: tests/test_interrupts.py lands signals at each step; tests/test_handoff.py holds the
# Handover's contract; the races tier repeats both.
# Cost: settle() and handing() are C calls (settle's EpochProgress.taken one Python call a
# batch); bench/instructions.py counts the whole next() at 37.4k instructions a batch (median
# of 5 runs, 35.8-40.1k), where the hand-over spread over Python frames made it 46.6-47.4k.


@cython.final
@cython.auto_pickle(False)
cdef class Handover:
    """One epoch's hand-over of its batches to the training loop (see NOTE [ Signal-safe
    hand-over ] above): the slot `ready`, the `lock` one caller at a time holds, and the
    `pending` index (handed to the loop, not counted yet; -1: none).  `taken(idx)` counts a
    batch taken (EpochProgress.taken: an index counts once however often it is given).

    States: empty (ready None, pending -1); holding (ready (idx, batch): on its way, or kept
    by an exception that cut its way short); handed (pending idx, ready None: the loop has
    it, uncounted).  handing(): holding -> handed; settle(): handed -> empty."""

    def __cinit__(self, taken):
        if not callable(taken):
            raise TypeError(f"expected a callable counting a batch taken, got {type(taken).__name__}")
        self.ready = None
        self.pending = -1
        self._taken = taken
        self.lock = _allocate_lock()
        self._acquire = self.lock.acquire
        self._release = self.lock.release

    cpdef int settle(self) except -1:
        """Count the pending batch taken, if any (the loop got it), then forget it: a
        `taken` an exception cut short is called again by the next settle()."""
        cdef Py_ssize_t idx = self.pending
        if idx >= 0:
            self._taken(idx)
            self.pending = -1
        return 0

    cpdef Py_ssize_t handing(self) except -2:
        """The batch in `ready` goes to the loop: its index is pending (counted at the next
        settle()) and `ready` is empty.  Returns that index; -1 (nothing changed) when
        `ready` is empty.  A batch still pending is settled first."""
        cdef Py_ssize_t idx
        got = self.ready
        if got is None:
            return -1
        if self.pending >= 0:
            self.settle()
        idx = (<tuple?>got)[0]
        self.pending = idx   # plain stores from here: nothing runs between them
        self.ready = None
        return idx

    def __repr__(self):
        held = "empty" if self.ready is None else f"batch {(<tuple>self.ready)[0]} ready"
        return f"<Handover {held}, pending {self.pending}>"


@cython.auto_pickle(False)
cdef class HandingIterator:
    """The base of an iterator whose __next__ is handing_next(...): its epoch's Handover."""


@cython.final
@cython.auto_pickle(False)
cdef class _HandingNext:
    """An iterator's __next__, compiled (see NOTE [ Signal-safe hand-over ]): under its
    Handover's lock, settle() the batch the last call handed out, call the wrapped
    `_next(it)` (which leaves the batch it returns in the Handover's `ready`) and, once it
    returned, handing() moves the batch out of `ready`.

    Compiled on purpose: a signal handler runs (and may raise) after any call made from
    Python bytecode, so in Python the batch `_next` returned could be lost between its
    return and the training loop.  No bytecode runs here: either the loop gets the batch,
    or the slot keeps it for the next call."""
    cdef readonly object __wrapped__

    def __init__(self, fn):
        if not callable(fn):
            raise TypeError(f"expected a callable, got {type(fn).__name__}")
        self.__wrapped__ = fn

    def __get__(self, obj, objtype):
        return self if obj is None else _MethodType(self, obj)

    def __call__(self, HandingIterator it not None):
        cdef Handover h = it.handover
        if h is None:
            raise RuntimeError(f"{type(it).__name__} has no Handover: its epoch never began")
        h._acquire()
        try:
            h.settle()
            batch = self.__wrapped__(it)
            h.handing()
        finally:
            h._release()
        return batch

    def __repr__(self):
        return f"<handing_next of {self.__wrapped__!r}>"


def handing_next(fn):
    """The __next__ of a HandingIterator whose `_next(it)` leaves the batch it returns in
    ``it.handover.ready``: `fn` under the Handover's lock, between settle() and handing(),
    compiled (see _HandingNext)."""
    return _HandingNext(fn)
