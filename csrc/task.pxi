# The main process's per-batch send: a task's frame (messages.PackedTask),
# packed in C and sent with the indices straight from their memory (see
# mxl_send.h for why it never blocks).

cdef enum:
    _TASK_PROFILING = 1
    _TASK_HAS_INDICES = 2
    _TASK_HEAD_ON_STACK = MXL_TASK_FIXED + 8 * 16   # room for 16 dropped slabs

cdef object _INT64_LE = np.dtype("<i8")


def send_task(int sock, bytes prefix, int64_t epoch, int64_t batch_index, object indices, bint profiling,
              int64_t slab_id, int64_t slab_size, object drop_slabs, int slab_fd):
    """Send one task's frame on socket descriptor `sock` without blocking.

    `prefix`: the frame's magic, protocol version and type tag (4 bytes);
    `indices`: an int64 array or its bytes (None: a stream's task);
    `slab_fd`: a slab's descriptor to pass with the frame (-1: none).
    Returns None once all of it is sent; else, the socket being full, the
    unsent rest of the frame and whether the descriptor went, for the caller
    to finish with a blocking send.  OSError: the worker's end is gone."""
    cdef char stack_head[_TASK_HEAD_ON_STACK]
    cdef char *head = stack_head
    cdef const char *data = NULL
    cdef Py_ssize_t n = 0, ndrops, hlen, i, total, at
    cdef int flags = _TASK_PROFILING if profiling else 0
    cdef cnp.ndarray array
    cdef long sent
    cdef bint fd_went
    cdef bytes rest
    if len(prefix) != 4:
        raise ValueError(f"a task frame's prefix is 4 bytes, got {len(prefix)}")
    if indices is not None:
        flags |= _TASK_HAS_INDICES
        if type(indices) is bytes:
            if len(<bytes>indices) % 8:
                raise ValueError(f"task indices of {len(<bytes>indices)} bytes, not a whole number of int64")
            data = <bytes>indices
            n = len(<bytes>indices) // 8
        else:
            if (type(indices) is np.ndarray and cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>indices)
                    and mxl_equiv_descr(cnp.PyArray_DESCR(<cnp.ndarray>indices), <cnp.PyArray_Descr *>_INT64_LE)):
                array = <cnp.ndarray>indices
            else:
                array = np.ascontiguousarray(indices, _INT64_LE)
            data = <const char *>cnp.PyArray_DATA(array)
            n = cnp.PyArray_SIZE(array)
    ndrops = len(drop_slabs)
    if ndrops + n > MXL_TASK_MAX_WORDS:   # the frame's length is a uint32
        raise ValueError(f"a task of {n} indices and {ndrops} dropped slabs does not fit in one frame "
                         f"(at most {MXL_TASK_MAX_WORDS} in all)")
    hlen = MXL_TASK_FIXED + 8 * ndrops
    total = hlen + 8 * n
    if hlen > _TASK_HEAD_ON_STACK:
        head = <char *>PyMem_Malloc(hlen)
        if head == NULL:
            raise MemoryError()
    try:
        mxl_pack_task(head, prefix, epoch, batch_index, slab_id, slab_size, flags, <uint32_t>ndrops,
                      <uint32_t>n, 1 if slab_fd >= 0 else 0)
        for i in range(ndrops):
            mxl_put_le(head + MXL_TASK_FIXED + 8 * i, <uint64_t><int64_t>drop_slabs[i], 8)
        sent = mxl_send_frame(sock, head, hlen, data, 8 * n, slab_fd)
        if sent < 0:
            raise OSError(-sent, os.strerror(-sent))
        if sent == total:
            return None
        fd_went = sent > 0
        rest = PyBytes_FromStringAndSize(NULL, total - sent)
        at = 0
        if sent < hlen:
            memcpy(<char *>rest, head + sent, hlen - sent)
            at = hlen - sent
            sent = hlen
        if n:
            memcpy(<char *>rest + at, data + (sent - hlen), total - sent)
        return rest, fd_went
    finally:
        if head != stack_head:
            PyMem_Free(head)
