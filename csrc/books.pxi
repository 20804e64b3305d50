# The engine's books of its workers, as the window reads them (typed in mxload/_core.pxd):
# each worker's record, and the base of mxload._runtime.roster.Roster, which decides with them.


@cython.auto_pickle(False)
cdef class WorkerRecord:
    """The engine's view of one worker: alive, its stream exhausted, and the tasks it holds
    (`outstanding`: (epoch, batch index) -> indices, in dispatch order: what a restart sends
    again)."""

    def __init__(self, bint alive=True, bint exhausted=False, dict outstanding=None):
        self.alive = alive
        self.exhausted = exhausted
        self.outstanding = {} if outstanding is None else outstanding

    def __repr__(self):
        return (f"WorkerRecord(alive={self.alive}, exhausted={self.exhausted}, "
                f"outstanding={self.outstanding!r})")


@cython.auto_pickle(False)
cdef class WorkerBooks:
    """The base of the engine's roster (mxload._runtime.roster.Roster): one WorkerRecord per
    worker id in `workers`, and `takers`, the ids of the workers that take tasks, counted
    again by pick() once set to None.  The window dispatches round-robin over `takers` while
    they stand and asks pick() otherwise."""

    def __cinit__(self, *args, **kwargs):
        self.workers = []
        self.takers = None

    cpdef object pick(self, Py_ssize_t idx, bint in_order, bint stream=False):
        """The worker that takes batch `idx`'s task, or None (the roster's)."""
        raise NotImplementedError("the roster picks")

    cpdef bint all_done(self) except -1:
        """Every worker's stream ended, or the worker did (the roster's)."""
        raise NotImplementedError("the roster knows")
