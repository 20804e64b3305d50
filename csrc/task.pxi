# The main process's per-batch send: task frames (messages.PackedTask),
# packed in C and sent with the indices straight from their memory, several
# to one worker in one message when they can (see mxl_send.h for why a send
# never blocks).

cdef enum:
    _TASK_PROFILING = 1
    _TASK_HAS_INDICES = 2
    # The most task frames one message carries.
    _MAX_FRAMES = 8

cdef object _INT64_LE = np.dtype("<i8")


cdef struct _Frame:
    # One task frame as two pieces: its head (header, fixed fields, dropped
    # slab ids) and its indices, wherever they are.
    char *head
    Py_ssize_t hlen
    const char *data
    Py_ssize_t dlen


cdef object _pack_frame(_Frame *f, char *head, bytes prefix, int64_t epoch, int64_t batch_index,
                        object indices, bint profiling, int64_t slab_id, int64_t slab_size,
                        object drop_slabs, int nfds):
    """Pack one task's head into `head` (MXL_TASK_FIXED + 8 per dropped slab
    bytes) and point `f` at it and at the indices' memory.  Returns the
    object that memory belongs to, to keep alive until the frame is sent."""
    cdef int flags = _TASK_PROFILING if profiling else 0
    cdef Py_ssize_t n = 0, ndrops = len(drop_slabs), i
    cdef const char *data = NULL
    cdef object owner = None
    if indices is not None:
        flags |= _TASK_HAS_INDICES
        if type(indices) is bytes:
            if len(<bytes>indices) % 8:
                raise ValueError(f"task indices of {len(<bytes>indices)} bytes, not a whole number of int64")
            data = <bytes>indices
            n = len(<bytes>indices) // 8
            owner = indices
        else:
            if (type(indices) is np.ndarray and cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>indices)
                    and mxl_equiv_descr(cnp.PyArray_DESCR(<cnp.ndarray>indices), <cnp.PyArray_Descr *>_INT64_LE)):
                owner = indices
            else:
                owner = np.ascontiguousarray(indices, _INT64_LE)
            data = <const char *>cnp.PyArray_DATA(<cnp.ndarray>owner)
            n = cnp.PyArray_SIZE(<cnp.ndarray>owner)
    if ndrops + n > MXL_TASK_MAX_WORDS:   # the frame's length is a uint32
        raise ValueError(f"a task of {n} indices and {ndrops} dropped slabs does not fit in one frame "
                         f"(at most {MXL_TASK_MAX_WORDS} in all)")
    mxl_pack_task(head, prefix, epoch, batch_index, slab_id, slab_size, flags, <uint32_t>ndrops,
                  <uint32_t>n, nfds)
    for i in range(ndrops):
        mxl_put_le(head + MXL_TASK_FIXED + 8 * i, <uint64_t><int64_t>drop_slabs[i], 8)
    f.head = head
    f.hlen = MXL_TASK_FIXED + 8 * ndrops
    f.data = data
    f.dlen = 8 * n
    return owner


cdef object _send_frames(int sock, _Frame *frames, int nframes, int fd):
    """Send `frames` as one message, `fd` (-1: none) with its first byte,
    without blocking.  None once all of it is sent; else (the socket being
    full) the unsent rest and the descriptor still to pass (-1: it went).
    OSError: the worker's end is gone."""
    cdef iovec iov[2 * _MAX_FRAMES]
    cdef int k, n = 0
    cdef Py_ssize_t total = 0, skip, at = 0, piece
    cdef long sent
    cdef bytes rest
    for k in range(nframes):
        iov[n].iov_base = frames[k].head
        iov[n].iov_len = frames[k].hlen
        n += 1
        if frames[k].dlen:
            iov[n].iov_base = <void *>frames[k].data
            iov[n].iov_len = frames[k].dlen
            n += 1
        total += frames[k].hlen + frames[k].dlen
    sent = mxl_send_pieces(sock, iov, n, fd)
    if sent < 0:
        raise OSError(-sent, os.strerror(-sent))
    if sent == total:
        return None
    rest = PyBytes_FromStringAndSize(NULL, total - sent)
    skip = sent
    for k in range(n):
        piece = <Py_ssize_t>iov[k].iov_len
        if skip >= piece:
            skip -= piece
            continue
        memcpy(<char *>rest + at, <char *>iov[k].iov_base + skip, piece - skip)
        at += piece - skip
        skip = 0
    return rest, (fd if sent == 0 else -1)


def send_task(int sock, bytes prefix, int64_t epoch, int64_t batch_index, object indices, bint profiling,
              int64_t slab_id, int64_t slab_size, object drop_slabs, int slab_fd):
    """Send one task's frame on socket descriptor `sock` without blocking.

    `prefix`: the frame's magic, protocol version and type tag (4 bytes);
    `indices`: an int64 array or its bytes (None: a stream's task);
    `slab_fd`: a slab's descriptor to pass with the frame (-1: none).
    Returns None once all of it is sent; else, the socket being full, the
    unsent rest of the frame and the descriptor still to pass (-1: it went),
    for the caller to finish with a blocking send.  OSError: the worker's
    end is gone."""
    cdef _Frame frame
    cdef char *head
    if len(prefix) != 4:
        raise ValueError(f"a task frame's prefix is 4 bytes, got {len(prefix)}")
    head = <char *>PyMem_Malloc(MXL_TASK_FIXED + 8 * len(drop_slabs))
    if head == NULL:
        raise MemoryError()
    try:
        keep = _pack_frame(&frame, head, prefix, epoch, batch_index, indices, profiling, slab_id, slab_size,
                           drop_slabs, 1 if slab_fd >= 0 else 0)
        return _send_frames(sock, &frame, 1, slab_fd)
    finally:
        PyMem_Free(head)


@cython.final
@cython.auto_pickle(False)
cdef class TaskHold:
    """The process transport's put_task, compiled: task (epoch, batch index,
    indices, profiling) joins the tasks held on worker `wid`'s channel, and
    `wid` the transport's set of workers holding some, in one call.  The
    engine's dispatch makes it its last step, once the task is in its books:
    a signal handler's exception (raised after any call made from Python)
    finds the task in both or in neither.  True once the worker holds
    `per_message` tasks: the transport's send_queued(wid) sends them."""
    cdef list _channels
    cdef set _holding
    cdef public Py_ssize_t per_message

    def __cinit__(self, list channels not None, set holding not None, Py_ssize_t per_message=1):
        self._channels = channels
        self._holding = holding
        self.per_message = per_message

    def __call__(self, Py_ssize_t wid, tuple task not None):
        if wid < 0 or wid >= len(self._channels):   # (the module does not check bounds)
            raise IndexError(f"no worker {wid}: there are {len(self._channels)}")
        cdef WorkerChannel channel = <WorkerChannel?>self._channels[wid]
        cdef list held = channel.held
        self._holding.add(wid)
        held.append(task)
        return len(held) >= self.per_message


@cython.final
@cython.auto_pickle(False)
cdef class QueuePut:
    """A thread transport's put_task, compiled: task goes into worker `wid`'s
    queue (its put wakes the thread) in one call.  Always False: nothing is
    held back."""
    cdef list _queues

    def __cinit__(self, list queues not None):
        self._queues = queues

    def __call__(self, Py_ssize_t wid, tuple task not None):
        if wid < 0 or wid >= len(self._queues):   # (the module does not check bounds)
            raise IndexError(f"no worker {wid}: there are {len(self._queues)}")
        self._queues[wid].put(task)
        return False


# A task frame's fixed part (header and fields before the dropped slabs and indices): the
# Python side (mxload/_runtime/local/wire.py) checks its own layout against it at import.
TASK_FRAME_FIXED_SIZE = MXL_TASK_FIXED


def send_tasks(WorkerChannel handle not None, pool, bytes prefix, list tasks not None, bint consume=False):
    """Send `tasks` ((epoch, batch index, indices, profiling) each, in order)
    to `handle`'s worker (its WorkerChannel: a ProcessHandle) without blocking, as few messages
    as it can: every frame in a slab from `pool` when one is free (recorded
    on the handle under (epoch, batch index) as its message goes, before
    the worker can answer; None: the worker makes one), the slabs the worker
    must forget named in the first.  A slab the worker has not seen yet goes
    as a descriptor with the first byte of a message, so its frame starts a
    new one.

    Returns (n, messages, unsent): the first `n` tasks were sent, or
    started, in `messages` messages; unsent is None, or (rest of the last
    message, descriptor still to pass or -1) when the worker is not reading,
    for the caller to finish before it sends the tasks after them.  OSError:
    the worker's end is gone.

    With `consume`, the tasks of each message sent whole are removed from
    `tasks` as it goes (those of a message left unsent stay first, for the
    caller to remove once it finished it): the list says what is left to
    send even if a signal handler's exception cuts this call short in the
    pool's Python code, which runs before anything of a message is recorded
    or sent."""
    cdef _Frame frames[_MAX_FRAMES]
    cdef Py_ssize_t ntasks = len(tasks), done = 0, i, ndrops, messages = 0, removed = 0
    cdef int nframes, fd, frame_fd, sock
    cdef int64_t slab_id, slab_size
    cdef char *heads
    cdef char *at
    cdef dict slabs = handle.slabs
    cdef set known = handle.known_slabs
    cdef list keep = []
    cdef list taken = []      # (task key, slab or None) of the message being packed
    cdef int64_t new_id
    carried = None
    if len(prefix) != 4:
        raise ValueError(f"a task frame's prefix is 4 bytes, got {len(prefix)}")
    cdef list drops = handle.pending_drops
    ndrops = len(drops)
    heads = <char *>PyMem_Malloc(_MAX_FRAMES * MXL_TASK_FIXED + 8 * ndrops)
    if heads == NULL:
        raise MemoryError()
    try:
        sock = handle.sock.fileno()
        carried = None    # a slab taken for the task that starts the next message
        while done < ntasks:
            nframes = 0
            fd = -1
            new_id = -1
            at = heads
            i = done
            while i < ntasks and nframes < _MAX_FRAMES:
                epoch, batch_index, indices, profiling = <tuple?>tasks[i]
                if carried is not None:
                    slab, carried = carried, None
                else:
                    slab = pool.acquire(known)
                slab_id, slab_size, frame_fd = -1, 0, -1
                if slab is not None:
                    slab_id = (<Slab?>slab).slab_id
                    slab_size = (<Slab>slab).size
                    if slab_id not in known:
                        if nframes:
                            carried = slab   # its descriptor must lead a message: the next one
                            break
                        taken.append(((epoch, batch_index), slab))
                        frame_fd = pool.fd(slab_id)
                        new_id = slab_id
                    else:
                        taken.append(((epoch, batch_index), slab))
                else:
                    taken.append(((epoch, batch_index), None))
                keep.append(_pack_frame(&frames[nframes], at, prefix, epoch, batch_index, indices, profiling,
                                        slab_id, slab_size, drops if nframes == 0 else (),
                                        1 if frame_fd >= 0 else 0))
                at += frames[nframes].hlen
                if frame_fd >= 0:
                    fd = frame_fd
                nframes += 1
                i += 1
            unsent = _send_frames(sock, frames, nframes, fd)
            # Sent, or started: recorded now, no Python code run since the
            # send (the worker's answers are taken under the engine lock,
            # which the caller holds).
            for key, slab in taken:
                slabs[key] = slab
            del taken[:]
            if new_id >= 0:
                known.add(new_id)
            if ndrops:
                handle.pending_drops = drops = []
                ndrops = 0
            messages += 1
            del keep[:]
            if unsent is not None:
                return removed + i, messages, unsent
            if consume:
                del tasks[:i]
                removed += i
                ntasks -= i
                done = 0
            else:
                done = i
        return removed + done, messages, None
    except BaseException:
        # Cut short before its message went (the pool's Python code, a bad
        # task): the slabs taken for it go back to the pool.
        for key, slab in taken:
            if slab is not None:
                pool.release(slab)
        raise
    finally:
        PyMem_Free(heads)
        if carried is not None:
            pool.release(carried)   # its task waits for the caller's next call
