# A worker process's task channel, as the main process's compiled code sees it
# (declared in _core.pxd).


cdef class WorkerChannel:
    """The main process's side of one worker's task channel: its socket, the slabs its
    tasks fill, the slab descriptors it already has and the batch layouts it named.  The
    task send (send_tasks) and the hand-off (claim_batch) read these typed fields;
    ``mxload._runtime.local.launcher.ProcessHandle`` is a subclass that adds the process."""

    def __cinit__(self, *args, **kwargs):
        self.sock = None
        self.tag = 0
        self.known_slabs = set()
        self.pending_drops = []
        self.slabs = {}
        self.layouts = {}
        self.held = []
