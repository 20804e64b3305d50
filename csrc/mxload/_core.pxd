# Declarations of mxload._core's own extension types whose fields the compiled code reads
# and Python code sets: typed here, so renaming a field is a build error, not an
# AttributeError (or a silently wrong read) at run time.  Cython finds a module's own .pxd by
# the module's full name (mxload._core) on the include path (csrc/): hence csrc/mxload/.

cdef class WorkerChannel:
    # The main process's side of one worker process's task channel (the receive path and
    # the task send read it; mxload._runtime.local.launcher.ProcessHandle extends it).
    cdef public object sock              # socket.socket | None: the task socket
    cdef public long long tag            # its name on the batches the receive path stores
    cdef public set known_slabs          # slab ids whose descriptor the worker has
    cdef public list pending_drops       # slab ids the worker should forget (retired)
    cdef public dict slabs               # (epoch, batch index) -> the Slab its task fills, or None
    cdef public dict layouts             # layout id -> (layout, ViewTemplate): layouts it named
    cdef public list held                # tasks waiting to go with the next one (TaskHold)


cdef class Handover:
    # One epoch's hand-over of its batches to the training loop (handoff.pxi: NOTE [ Signal-safe
    # hand-over ]).  The engine's window and the in-process producer store into `ready`.
    cdef public object ready             # (batch index, batch) on its way to the loop, or None
    cdef readonly Py_ssize_t pending     # handed to the loop, not counted taken yet; -1: none
    cdef readonly object lock            # a _thread lock: one batch to one caller
    cdef object _taken                   # EpochProgress.taken, bound at construction
    cdef object _acquire, _release       # the lock's, bound at construction
    cpdef int settle(self) except -1
    cpdef Py_ssize_t handing(self) except -2


cdef class HandingIterator:
    # The base of an iterator whose __next__ is handing_next(...) (epoch.EpochIterator,
    # dataloader._LoaderIterator): the compiled __next__ reads its Handover here.
    cdef public Handover handover


cdef class WorkerRecord:
    # The engine's view of one worker (books.pxi): the window takes a batch's task off it.
    cdef public bint alive
    cdef public bint exhausted
    cdef public dict outstanding         # (epoch, batch index) -> indices, in dispatch order


cdef class WorkerBooks:
    # The base of mxload._runtime.roster.Roster (books.pxi), as the window reads it.
    cdef public list workers             # WorkerRecord by worker id
    cdef public list takers              # ids of the workers taking tasks; None: pick() counts again
    cpdef object pick(self, Py_ssize_t idx, bint in_order, bint stream=*)
    cpdef bint all_done(self) except -1
