# Collation kernels and the layout planner.
#
# Every kernel works in two phases: validate (GIL held, cheap C loop over the
# array headers) and copy (GIL released, nothing but pointers and memcpy).
# The destination is always caller-provided, so the same kernel writes into a
# private buffer or straight into a shared-memory slab.

ALIGNMENT = 64


cdef inline str _shape_str(tuple shape):
    return "(" + ", ".join([str(s) for s in shape]) + ("," if len(shape) == 1 else "") + ")"


cdef list _as_arrays(arrays, str what):
    """Return a list of ndarrays; reject empty input and object dtypes."""
    cdef list out
    if isinstance(arrays, list):
        out = <list>arrays
    else:
        out = list(arrays)
    if not out:
        raise ValueError(f"cannot {what} an empty list of samples")
    cdef Py_ssize_t i, n = len(out)
    cdef bint copied = False
    for i in range(n):
        a = out[i]
        if not cnp.PyArray_CheckExact(a):
            if not copied:
                out = list(out)
                copied = True
            if a is None:
                raise TypeError(f"sample {i} is None; cannot {what} None")
            a = np.asarray(a)
            out[i] = a
        if mxl_descr_hasobject(cnp.PyArray_DESCR(<cnp.ndarray>a)):
            raise TypeError(
                f"sample {i} has dtype {(<cnp.ndarray>a).dtype} (Python objects); "
                f"only fixed-size numeric, bool or string dtypes can be collated")
    return out


cdef inline tuple _shape_of(cnp.ndarray a):
    return tuple([a.shape[d] for d in range(a.ndim)])


# The largest ndim of a batch (out) or a sample the kernels handle.
MAX_DIMS = MXL_MAX_DIMS


cdef inline int _check_ndim(int ndim, str what) except -1:
    if ndim > MXL_MAX_DIMS:
        raise ValueError(f"{what} has {ndim} dimensions; mxload collates at most {MXL_MAX_DIMS} "
                         f"(the batch dimension included)")
    return 0


cdef _check_out(cnp.ndarray out, tuple shape, object dtype, list arrays):
    # Any strides: the kernels write exactly out's elements.
    if not cnp.PyArray_ISWRITEABLE(out):
        raise ValueError("out must be writeable")
    if _shape_of(out) != shape:
        raise ValueError(f"out has shape {_shape_str(_shape_of(out))}, expected {_shape_str(shape)}")
    if out.dtype != dtype:
        raise ValueError(f"out has dtype {out.dtype}, expected {dtype}")
    for i in range(len(arrays)):
        if np.may_share_memory(arrays[i], out):
            raise ValueError(f"out overlaps sample {i}; pass a separate out array")


def stack_check(arrays):
    """Validate samples for stacking.

    Returns (arrays as a list of ndarrays, batched shape, dtype).  Raises
    ValueError naming the first sample whose shape or dtype differs from
    sample 0, TypeError for object arrays or None."""
    cdef list arrs = _as_arrays(arrays, "stack")
    cdef cnp.ndarray first = arrs[0], a
    cdef int nd = first.ndim, d
    cdef cnp.npy_intp *dims0 = cnp.PyArray_DIMS(first)
    cdef cnp.PyArray_Descr *descr0 = cnp.PyArray_DESCR(first)
    cdef Py_ssize_t i, n = len(arrs)
    _check_ndim(nd + 1, f"the batch of {n} samples")
    for i in range(1, n):
        a = arrs[i]
        if cnp.PyArray_DESCR(a) != descr0 and not mxl_equiv_descr(cnp.PyArray_DESCR(a), descr0):
            raise ValueError(
                f"sample {i} has dtype {a.dtype}, expected {first.dtype} (the dtype of sample 0)")
        if a.ndim != nd:
            raise ValueError(
                f"sample {i} has shape {_shape_str(_shape_of(a))}, expected "
                f"{_shape_str(_shape_of(first))} (the shape of sample 0)")
        for d in range(nd):
            if cnp.PyArray_DIMS(a)[d] != dims0[d]:
                raise ValueError(
                    f"sample {i} has shape {_shape_str(_shape_of(a))}, expected "
                    f"{_shape_str(_shape_of(first))} (the shape of sample 0)")
    return arrs, (n,) + _shape_of(first), first.dtype


cdef inline bint _fits(cnp.ndarray a, cnp.ndarray out, int axis) noexcept:
    """Sample `a` fits one row of `out` (shorter only along the pad axis)."""
    cdef int d, nd = out.ndim - 1
    cdef cnp.npy_intp *dims = cnp.PyArray_DIMS(a)
    cdef cnp.npy_intp *row = cnp.PyArray_DIMS(out) + 1
    if cnp.PyArray_NDIM(a) != nd or cnp.PyArray_ITEMSIZE(a) != cnp.PyArray_ITEMSIZE(out):
        return False
    for d in range(nd):
        if dims[d] > row[d] or (d != axis and dims[d] != row[d]):
            return False
    return True


cdef _check_rows(list arrays, cnp.ndarray out):
    # The fills trust stack_check/pad_check for the samples' dtypes, but
    # never write outside `out`: its rows and dimensions and every sample's
    # shape are checked (in C), and out's strides are followed.
    _check_ndim(out.ndim, "out")
    if out.ndim < 1 or cnp.PyArray_DIMS(out)[0] != len(arrays):
        raise ValueError(f"out has {out.shape[0] if out.ndim else 0} rows for {len(arrays)} samples")
    if not cnp.PyArray_ISWRITEABLE(out):
        raise ValueError("out must be writeable")


cdef inline bint _is_contiguous(const mxl_ssize_t *shape, const mxl_ssize_t *strides, int nd,
                                mxl_ssize_t itemsize) noexcept:
    """(shape, strides) is one C-ordered block with no gaps."""
    cdef mxl_ssize_t step = itemsize
    cdef int d
    for d in range(nd - 1, -1, -1):
        if shape[d] != 1 and strides[d] != step:
            return False
        step *= shape[d]
    return True


_MISMATCH = "sample {} does not fit out; validate samples with stack_check/pad_check first"


def stack_fill(list arrays, cnp.ndarray out):
    """Copy validated samples (from stack_check) into out[i]; GIL released.

    Returns the copy time in nanoseconds."""
    _check_rows(arrays, out)
    cdef Py_ssize_t n = len(arrays), i
    cdef cnp.ndarray a
    cdef int nd = out.ndim - 1
    cdef mxl_ssize_t itemsize = out.itemsize
    cdef char *dst = <char *>cnp.PyArray_DATA(out)
    cdef mxl_ssize_t dst_step = cnp.PyArray_STRIDES(out)[0]
    cdef const mxl_ssize_t *dst_strides = <const mxl_ssize_t *>cnp.PyArray_STRIDES(out) + 1
    cdef const mxl_ssize_t *shape = <const mxl_ssize_t *>cnp.PyArray_DIMS(out) + 1
    cdef char **srcs = <char **>PyMem_Malloc(n * sizeof(char *))
    cdef const mxl_ssize_t **src_strides = <const mxl_ssize_t **>PyMem_Malloc(n * sizeof(mxl_ssize_t *))
    cdef int64_t t0
    if srcs is NULL or src_strides is NULL:
        PyMem_Free(srcs)
        PyMem_Free(src_strides)
        raise MemoryError()
    try:
        for i in range(n):
            a = arrays[i]
            if not _fits(a, out, -1):
                raise ValueError(_MISMATCH.format(i))
            srcs[i] = <char *>cnp.PyArray_DATA(a)
            src_strides[i] = <const mxl_ssize_t *>cnp.PyArray_STRIDES(a)
        with nogil:
            t0 = mxl_monotonic_ns()
            for i in range(n):
                mxl_copy_nd(dst + i * dst_step, dst_strides, srcs[i], src_strides[i],
                            shape, nd, itemsize)
            t0 = mxl_monotonic_ns() - t0
    finally:
        PyMem_Free(srcs)
        PyMem_Free(src_strides)
    return t0


def stack(arrays, out=None):
    """Stack equally shaped arrays along a new first axis.

    With `out`, write into it (writeable, right shape and dtype, any strides,
    not overlapping a sample)."""
    arrs, shape, dtype = stack_check(arrays)
    if out is None:
        out = np.empty(shape, dtype)
    else:
        _check_out(out, shape, dtype, arrs)
    stack_fill(arrs, out)
    return out


def pad_check(arrays, int axis=0):
    """Validate samples for padding along `axis`.

    Returns (arrays, batched shape, dtype, lengths) where batched shape has the
    maximum extent along `axis` and lengths[i] is sample i's extent."""
    cdef list arrs = _as_arrays(arrays, "pad")
    cdef cnp.ndarray first = arrs[0], a
    cdef int nd = first.ndim, d
    cdef Py_ssize_t i, n = len(arrs)
    if nd == 0:
        raise ValueError("cannot pad 0-d samples (scalars); use Stack() for scalars")
    _check_ndim(nd + 1, f"the batch of {n} samples")
    if axis < -nd or axis >= nd:
        raise ValueError(f"pad axis {axis} is out of range for samples with {nd} dimensions")
    if axis < 0:
        axis += nd
    cdef cnp.PyArray_Descr *descr0 = cnp.PyArray_DESCR(first)
    cdef cnp.ndarray lengths = np.empty(n, np.int64)
    cdef int64_t[::1] lens = lengths
    cdef Py_ssize_t longest = 0
    for i in range(n):
        a = arrs[i]
        if cnp.PyArray_DESCR(a) != descr0 and not mxl_equiv_descr(cnp.PyArray_DESCR(a), descr0):
            raise ValueError(
                f"sample {i} has dtype {a.dtype}, expected {first.dtype} (the dtype of sample 0)")
        if a.ndim != nd:
            raise ValueError(
                f"sample {i} has {a.ndim} dimensions (shape {_shape_str(_shape_of(a))}), expected "
                f"{nd} like sample 0 (shape {_shape_str(_shape_of(first))})")
        for d in range(nd):
            if d != axis and cnp.PyArray_DIMS(a)[d] != cnp.PyArray_DIMS(first)[d]:
                raise ValueError(
                    f"sample {i} has shape {_shape_str(_shape_of(a))}, expected "
                    f"{_shape_str(_shape_of(first))} except along the pad axis {axis}")
        lens[i] = cnp.PyArray_DIMS(a)[axis]
        if lens[i] > longest:
            longest = lens[i]
    shape = list(_shape_of(first))
    shape[axis] = longest
    return arrs, (n,) + tuple(shape), first.dtype, lengths


def pad_fill(list arrays, cnp.ndarray out, int axis, bytes pattern):
    """Copy validated samples (from pad_check) into out, filling the rest of
    each row with `pattern` (one element's bytes); GIL released.

    Returns the copy time in nanoseconds."""
    _check_rows(arrays, out)
    if axis < 0 or axis >= out.ndim - 1:
        raise ValueError(f"pad axis {axis} is out of range for out with {out.ndim} dimensions")
    cdef Py_ssize_t n = len(arrays), i
    cdef cnp.ndarray a
    cdef int nd = out.ndim - 1
    cdef mxl_ssize_t itemsize = out.itemsize
    if len(pattern) != itemsize:
        raise ValueError(f"pad pattern has {len(pattern)} bytes, expected {itemsize}")
    cdef const char *pat = pattern
    cdef char *dst = <char *>cnp.PyArray_DATA(out)
    cdef char *row
    cdef mxl_ssize_t dst_step = cnp.PyArray_STRIDES(out)[0]
    cdef const mxl_ssize_t *dst_strides = <const mxl_ssize_t *>cnp.PyArray_STRIDES(out) + 1
    cdef mxl_ssize_t full_len = cnp.PyArray_DIMS(out)[axis + 1]
    cdef mxl_ssize_t axis_stride = dst_strides[axis]
    cdef const mxl_ssize_t *row_shape = <const mxl_ssize_t *>cnp.PyArray_DIMS(out) + 1
    # The padding of a row: the row's shape with `full_len - length` along axis.
    cdef mxl_ssize_t pad_shape[MXL_MAX_DIMS]
    cdef int d
    for d in range(nd):
        pad_shape[d] = row_shape[d]
    # Padding along a later axis is many short runs: when the row is one
    # contiguous block, filling all of it (one memset) before the copy is faster.
    cdef bint whole_row = axis > 0 and _is_contiguous(row_shape, dst_strides, nd, itemsize)
    cdef char **srcs = <char **>PyMem_Malloc(n * sizeof(char *))
    cdef const mxl_ssize_t **src_strides = <const mxl_ssize_t **>PyMem_Malloc(n * sizeof(mxl_ssize_t *))
    cdef const mxl_ssize_t **shapes = <const mxl_ssize_t **>PyMem_Malloc(n * sizeof(mxl_ssize_t *))
    cdef int64_t t0
    cdef mxl_ssize_t length
    if srcs is NULL or src_strides is NULL or shapes is NULL:
        PyMem_Free(srcs)
        PyMem_Free(src_strides)
        PyMem_Free(shapes)
        raise MemoryError()
    try:
        for i in range(n):
            a = arrays[i]
            if not _fits(a, out, axis):
                raise ValueError(_MISMATCH.format(i))
            srcs[i] = <char *>cnp.PyArray_DATA(a)
            src_strides[i] = <const mxl_ssize_t *>cnp.PyArray_STRIDES(a)
            shapes[i] = <const mxl_ssize_t *>cnp.PyArray_DIMS(a)
        with nogil:
            t0 = mxl_monotonic_ns()
            for i in range(n):
                row = dst + i * dst_step
                length = shapes[i][axis]
                if length < full_len:
                    if whole_row:
                        mxl_fill_nd(row, dst_strides, row_shape, nd, pat, itemsize)
                    else:
                        pad_shape[axis] = full_len - length
                        mxl_fill_nd(row + length * axis_stride, dst_strides, pad_shape, nd,
                                    pat, itemsize)
                mxl_copy_nd(row, dst_strides, srcs[i], src_strides[i], shapes[i], nd, itemsize)
            t0 = mxl_monotonic_ns() - t0
    finally:
        PyMem_Free(srcs)
        PyMem_Free(src_strides)
        PyMem_Free(shapes)
    return t0


def pad_value_bytes(val, dtype):
    """The bytes of one element equal to `val` in `dtype` (a structured
    dtype takes a tuple, like numpy)."""
    try:
        # An overflow is reported below, as an error: silence numpy's own
        # overflow warning (numpy 2) and its wrap-around deprecation (numpy 1).
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            element = np.array(val, dtype=dtype)
    except (TypeError, ValueError, OverflowError) as e:
        raise ValueError(f"pad value {val!r} cannot be represented as {np.dtype(dtype)}: {e}") from None
    if element.ndim != 0:
        raise ValueError(f"pad value must be a scalar, got {val!r}")
    if element.dtype.kind in "biufc" and isinstance(val, (int, float, complex, np.number)):
        # numpy 1.x wraps or truncates silently (300 -> 44 in uint8): insist
        # the value survives the conversion.
        back = element.item()
        if back != val and not (back != back and val != val):
            raise ValueError(f"pad value {val!r} cannot be represented as {np.dtype(dtype)} "
                             f"(it would become {back!r})")
    return element.tobytes()


def pad(arrays, int axis=0, val=0, out=None, bint ret_length=False):
    """Pad arrays ragged along `axis` to the longest one and stack them.

    Returns the padded batch, or (batch, lengths) with ret_length."""
    arrs, shape, dtype, lengths = pad_check(arrays, axis)
    if axis < 0:
        axis += len(shape) - 1
    if out is None:
        out = np.empty(shape, dtype)
    else:
        _check_out(out, shape, dtype, arrs)
    pad_fill(arrs, out, axis, pad_value_bytes(val, dtype))
    return (out, lengths) if ret_length else out


def copy_into(cnp.ndarray src, cnp.ndarray out):
    """Copy one array of the same shape into `out` (any strides); GIL released.

    Returns the copy time in nanoseconds."""
    _check_ndim(out.ndim, "out")
    if src.ndim != out.ndim or _shape_of(src) != _shape_of(out):
        raise ValueError(f"shape mismatch: {_shape_str(_shape_of(src))} vs {_shape_str(_shape_of(out))}")
    if out.dtype != src.dtype:
        raise ValueError(f"dtype mismatch: {src.dtype} vs {out.dtype}")
    if src.dtype.hasobject:
        raise TypeError(f"arrays of dtype {src.dtype} (Python objects) cannot be copied into a buffer")
    if not cnp.PyArray_ISWRITEABLE(out):
        raise ValueError("out must be writeable")
    if np.may_share_memory(src, out):
        raise ValueError("source and destination overlap")
    cdef char *dst = <char *>cnp.PyArray_DATA(out)
    cdef const char *s = <const char *>cnp.PyArray_DATA(src)
    cdef const mxl_ssize_t *ds = <const mxl_ssize_t *>cnp.PyArray_STRIDES(out)
    cdef const mxl_ssize_t *ss = <const mxl_ssize_t *>cnp.PyArray_STRIDES(src)
    cdef const mxl_ssize_t *shape = <const mxl_ssize_t *>cnp.PyArray_DIMS(src)
    cdef int nd = src.ndim
    cdef mxl_ssize_t itemsize = src.itemsize
    cdef int64_t t0
    with nogil:
        t0 = mxl_monotonic_ns()
        mxl_copy_nd(dst, ds, s, ss, shape, nd, itemsize)
        t0 = mxl_monotonic_ns() - t0
    return t0


def plan_layout(nbytes, Py_ssize_t alignment=ALIGNMENT):
    """Place fields of the given byte sizes in one buffer.

    Returns (offsets as an int64 array, total bytes); every offset is a
    multiple of `alignment` so each batched field starts on a cache line."""
    if alignment <= 0 or (alignment & (alignment - 1)) != 0:
        raise ValueError(f"alignment must be a positive power of two, got {alignment}")
    cdef Py_ssize_t n = len(nbytes), i
    cdef cnp.ndarray offsets = np.empty(n, np.int64)
    cdef int64_t[::1] off = offsets
    cdef int64_t pos = 0, size
    for i in range(n):
        size = nbytes[i]
        if size < 0:
            raise ValueError(f"field {i} has negative size {size}")
        off[i] = pos
        pos += (size + alignment - 1) & ~(alignment - 1)
    return offsets, pos


def monotonic_ns():
    """The C monotonic clock the kernels time themselves with."""
    return mxl_monotonic_ns()
