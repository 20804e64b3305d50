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
