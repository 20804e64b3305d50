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
    # A pointer, not a typed memoryview (see NOTE [ No memoryviews in the core ]).
    cdef int64_t *lens = <int64_t *>cnp.PyArray_DATA(lengths)
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
    cdef int64_t *off = <int64_t *>cnp.PyArray_DATA(offsets)   # (NOTE [ No memoryviews in the core ])
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


# ---------------------------------------------------------------------------
# Samples that are dicts, tuples or lists of arrays: every field at once
# (default_batchify's fast path, mxload/_collate/plan.py's plan_tree).
#
# A SampleTree is sample 0's structure flattened in preorder, made once and
# kept between batches by the caller.  gather() walks every sample against it
# in C (GIL held, borrowed references, no Python-level loop), checks each
# array leaf as stack_check would (a plain ndarray, sample 0's dtype and
# shape) and records its data pointer; TreeTable.fill then copies every leaf's
# column into the batch buffer in one nogil call.  A sample that differs in
# any way is answered with its index only: the caller then plans the batch
# the checked way, whose errors name the field and the sample.

# Deeper structures are left to the checked path (and its recursion limit).
TREE_MAX_DEPTH = 32

# Array leaves whose memory a flat dict's gather requests at once (see _gather_flat_dict).
DEF GATHER_AHEAD = 16
# Rows ahead of the copy whose lines TreeTable.fill requests.  Rows drawn at random from a
# dataset far larger than the caches (dict16's 82 MB, 256 B rows): 2 ahead 57.9 us a batch,
# 4 53.9, 8 53.9, 16 53.3; from hot caches 34.4 at 2, 33.7 at 8.
DEF FILL_AHEAD = 8


cdef class TreeTable


cdef inline bint _same_key(PyObject *a, PyObject *b) except -1:
    """Equal dict keys that are not the same object: str and int only, whose
    comparison runs no Python code (anything else takes the checked path)."""
    if mxl_unicode_check_exact(a) and mxl_unicode_check_exact(b):
        return mxl_rich_compare_bool(a, b, Py_EQ)
    if mxl_long_check_exact(a) and mxl_long_check_exact(b):
        return mxl_rich_compare_bool(a, b, Py_EQ)
    return False


@cython.final
cdef class SampleTree:
    """Sample 0's structure (plain dicts, tuples and lists), flattened.

    Its leaves are either arrays (plain ndarrays of a fixed-size dtype: the
    tree's own kernel stacks them) or other objects (their columns go back
    to the caller to plan).  `nodes` lists (kind, nchildren, key) per node in
    preorder (kind a TREE_ constant, key the dict key of a dict's child, else
    None); `leaves` lists (shape, dtype) per array leaf, in preorder."""

    cdef mxl_tree_node *_nodes
    cdef mxl_tree_leaf *_leaves
    cdef Py_ssize_t _nnodes, _cap_nodes, _nleaves, _cap_leaves, _nother
    cdef list _refs
    cdef readonly list nodes
    cdef readonly list leaves
    cdef bint _flat_dict          # a dict of arrays only: gather's shortcut

    def __cinit__(self, first):
        self._refs = []
        self.nodes = []
        self.leaves = []
        if not (mxl_dict_check_exact(<PyObject *>first) or mxl_tuple_check_exact(<PyObject *>first)
                or mxl_list_check_exact(<PyObject *>first)):
            raise TypeError(f"sample 0 is a {type(first).__name__}, not a plain dict, tuple or list")
        self._add(first, None, 0)
        self._flat_dict = (self._nodes[0].kind == MXL_TREE_DICT and self._nnodes == self._nleaves + 1)

    def __dealloc__(self):
        PyMem_Free(self._nodes)
        PyMem_Free(self._leaves)

    @property
    def nleaves(self):
        """The number of array leaves."""
        return self._nleaves

    @property
    def nother(self):
        """The number of other leaves (columns gather() hands back)."""
        return self._nother

    cdef Py_ssize_t _new_node(self, int kind, key) except -1:
        cdef mxl_tree_node *grown
        if self._nnodes == self._cap_nodes:
            self._cap_nodes = 2 * self._cap_nodes + 16
            grown = <mxl_tree_node *>PyMem_Realloc(self._nodes, self._cap_nodes * sizeof(mxl_tree_node))
            if grown is NULL:
                raise MemoryError()
            self._nodes = grown
        cdef Py_ssize_t k = self._nnodes
        self._nnodes += 1
        self._nodes[k].kind = kind
        self._nodes[k].nchildren = 0
        self._nodes[k].size = 1
        self._nodes[k].leaf = -1
        self._nodes[k].key = NULL
        if key is not None:
            self._refs.append(key)
            self._nodes[k].key = <PyObject *>key
        self.nodes.append(None)
        return k

    cdef Py_ssize_t _new_leaf(self, cnp.ndarray a) except -1:
        cdef mxl_tree_leaf *grown
        cdef mxl_tree_leaf *leaf
        cdef int d
        cdef mxl_ssize_t step
        if self._nleaves == self._cap_leaves:
            self._cap_leaves = 2 * self._cap_leaves + 16
            grown = <mxl_tree_leaf *>PyMem_Realloc(self._leaves, self._cap_leaves * sizeof(mxl_tree_leaf))
            if grown is NULL:
                raise MemoryError()
            self._leaves = grown
        cdef Py_ssize_t j = self._nleaves
        self._nleaves += 1
        leaf = &self._leaves[j]
        dtype = a.dtype
        self._refs.append(dtype)
        leaf.descr = cnp.PyArray_DESCR(a)
        leaf.ndim = a.ndim
        leaf.itemsize = a.itemsize
        step = leaf.itemsize
        for d in range(leaf.ndim - 1, -1, -1):
            leaf.dims[d] = cnp.PyArray_DIMS(a)[d]
            leaf.strides[d] = step
            step *= leaf.dims[d]
        leaf.row_bytes = step
        self.leaves.append((_shape_of(a), dtype))
        return j

    cdef Py_ssize_t _add(self, obj, key, int depth) except -1:
        cdef PyObject *o = <PyObject *>obj
        cdef Py_ssize_t k, i, n
        cdef int kind
        if depth < TREE_MAX_DEPTH and mxl_dict_check_exact(o):
            kind = MXL_TREE_DICT
        elif depth < TREE_MAX_DEPTH and mxl_tuple_check_exact(o):
            kind = MXL_TREE_TUPLE
        elif depth < TREE_MAX_DEPTH and mxl_list_check_exact(o):
            kind = MXL_TREE_LIST
        elif (mxl_array_check_exact(o) and not mxl_descr_hasobject(cnp.PyArray_DESCR(<cnp.ndarray>obj))
              and (<cnp.ndarray>obj).ndim + 1 <= MXL_MAX_DIMS):
            kind = MXL_TREE_ARRAY
        else:
            kind = MXL_TREE_OTHER
        k = self._new_node(kind, key)
        if kind == MXL_TREE_ARRAY:
            self._nodes[k].leaf = self._new_leaf(<cnp.ndarray>obj)
        elif kind == MXL_TREE_OTHER:
            self._nodes[k].leaf = self._nother
            self._nother += 1
        elif kind == MXL_TREE_DICT:
            items = list((<dict>obj).items())
            for child_key, value in items:
                self._add(value, child_key, depth + 1)
            n = len(items)
        else:
            items = list(obj)
            for value in items:
                self._add(value, None, depth + 1)
            n = len(items)
        if kind <= MXL_TREE_LIST:
            self._nodes[k].nchildren = n
            self._nodes[k].size = self._nnodes - k
        else:
            n = 0
        self.nodes[k] = (kind, n, key)
        return k

    def gather(self, list samples not None):
        """`samples` (sample 0 of the same structure as the tree's, with
        the same dtype objects) as a TreeTable, or the index of the first
        sample that differs from the tree: another container type, length
        or key order, or an array leaf that is not a plain ndarray of sample
        0's dtype and shape."""
        cdef Py_ssize_t n = len(samples), i
        cdef TreeTable t = TreeTable.__new__(TreeTable)
        t._setup(self, n)
        if self._flat_dict:
            i = self._gather_flat_dict(samples, t)
            return t if i < 0 else i
        for i in range(n):
            if not self._walk(0, mxl_list_item(<PyObject *>samples, i), i, t):
                return i
        return t

    cdef Py_ssize_t _gather_flat_dict(self, list samples, TreeTable t) except -2:
        """gather() for the commonest shape, a dict of arrays only: the same
        checks as _walk with the node bookkeeping left out.  Returns the
        index of the first sample that differs, or -1.

        Each array object and its dims are a cache line of their own (dims
        live in a separate allocation), read one behind the other.  So a
        sample's leaves go in chunks of GATHER_AHEAD, in three passes that
        each request the next pass's memory for the whole chunk, and the
        misses overlap.  (It gained 3%: the walk is bound by its instructions,
        a third of them PyDict_Next's, more than by the memory; see
        docs/performance.md.)"""
        cdef Py_ssize_t n = t.n, nl = self._nleaves, i, c, c0, cn, pos
        cdef PyObject *obj
        cdef PyObject *key
        cdef PyObject *value
        cdef PyObject *values[GATHER_AHEAD]
        cdef mxl_tree_node *nodes = self._nodes + 1   # the leaves, in order
        for i in range(n):
            obj = mxl_list_item(<PyObject *>samples, i)
            if i + 1 < n:
                mxl_prefetch(mxl_list_item(<PyObject *>samples, i + 1))
            if not mxl_dict_check_exact(obj) or mxl_dict_size(obj) != nl:
                return i
            pos = 0
            for c0 in range(0, nl, GATHER_AHEAD):
                cn = min(GATHER_AHEAD, nl - c0)
                for c in range(cn):
                    mxl_dict_next(obj, &pos, &key, &value)
                    if key != nodes[c0 + c].key and not _same_key(key, nodes[c0 + c].key):
                        return i
                    values[c] = value
                    mxl_prefetch(value)
                for c in range(cn):
                    if mxl_array_check_exact(values[c]):
                        mxl_prefetch(mxl_array_dims(<cnp.PyArrayObject *>values[c]))
                for c in range(cn):
                    if not _tree_leaf(&self._leaves[c0 + c], values[c], i, (c0 + c) * n + i, t):
                        return i
        return -1

    cdef int _walk(self, Py_ssize_t k, PyObject *obj, Py_ssize_t i, TreeTable t) except -1:
        """Check sample i's part `obj` against node k and record its leaves;
        0 if it differs.  Array leaves are checked in the container's loop."""
        cdef mxl_tree_node *node = &self._nodes[k]
        cdef mxl_tree_node *cn
        cdef Py_ssize_t c, pos = 0, child = k + 1
        cdef PyObject *key
        cdef PyObject *value
        cdef bint is_tuple
        if node.kind == MXL_TREE_ARRAY:   # only a root array: containers check their own
            return _tree_leaf(&self._leaves[node.leaf], obj, i, node.leaf * t.n + i, t)
        if node.kind == MXL_TREE_OTHER:
            mxl_incref(obj)
            mxl_list_set_item(mxl_list_item(<PyObject *>t.columns, node.leaf), i, obj)
            return 1
        if node.kind == MXL_TREE_DICT:
            if not mxl_dict_check_exact(obj) or mxl_dict_size(obj) != node.nchildren:
                return 0
            for c in range(node.nchildren):
                mxl_dict_next(obj, &pos, &key, &value)
                cn = &self._nodes[child]
                if key != cn.key and not _same_key(key, cn.key):
                    return 0
                if cn.kind == MXL_TREE_ARRAY:
                    if not _tree_leaf(&self._leaves[cn.leaf], value, i, cn.leaf * t.n + i, t):
                        return 0
                elif not self._walk(child, value, i, t):
                    return 0
                child += cn.size
            return 1
        # A tuple or a list stands for either, as in the checked path, but
        # sample 0's is the batch's container type: it must be the tree's.
        is_tuple = mxl_tuple_check_exact(obj)
        if is_tuple:
            if mxl_tuple_size(obj) != node.nchildren:
                return 0
        elif not mxl_list_check_exact(obj) or mxl_list_size(obj) != node.nchildren:
            return 0
        if i == 0 and is_tuple != (node.kind == MXL_TREE_TUPLE):
            return 0
        for c in range(node.nchildren):
            value = mxl_tuple_item(obj, c) if is_tuple else mxl_list_item(obj, c)
            cn = &self._nodes[child]
            if cn.kind == MXL_TREE_ARRAY:
                if not _tree_leaf(&self._leaves[cn.leaf], value, i, cn.leaf * t.n + i, t):
                    return 0
            elif not self._walk(child, value, i, t):
                return 0
            child += cn.size
        return 1


cdef inline bint _tree_leaf(mxl_tree_leaf *leaf, PyObject *obj, Py_ssize_t i, Py_ssize_t at,
                            TreeTable t) noexcept:
    """Check sample i's array leaf `obj` against `leaf` and record it in
    the table's cell `at`; 0 if it differs."""
    cdef cnp.PyArrayObject *a
    cdef cnp.PyArray_Descr *descr
    cdef cnp.npy_intp *dims
    cdef int d
    if not mxl_array_check_exact(obj):
        return 0
    a = <cnp.PyArrayObject *>obj
    descr = mxl_array_descr(a)
    # Sample 0 must bring the tree's very dtype (the batch's dtype is
    # sample 0's); the others one equivalent to it, as stack_check asks.
    if descr != leaf.descr and (i == 0 or not mxl_equiv_descr(descr, leaf.descr)):
        return 0
    if mxl_array_ndim(a) != leaf.ndim:
        return 0
    dims = mxl_array_dims(a)
    for d in range(leaf.ndim):
        if dims[d] != leaf.dims[d]:
            return 0
    t._srcs[at] = <const char *>mxl_array_data(a)
    # NULL: one C-contiguous block, copied with a single memcpy of the row.
    t._strides[at] = (NULL if cnp.PyArray_CHKFLAGS(<cnp.ndarray>obj, cnp.NPY_ARRAY_C_CONTIGUOUS)
                      else <const mxl_ssize_t *>mxl_array_strides(a))
    mxl_incref(obj)
    t._refs[t._nrefs] = obj
    t._nrefs += 1
    return 1


@cython.final
cdef class TreeTable:
    """One batch's samples as SampleTree.gather found them: each array
    leaf's column (data pointers, the arrays kept alive), filled by fill();
    `columns` holds the other leaves' columns, one list each."""

    cdef SampleTree _tree
    cdef readonly Py_ssize_t n
    cdef const char **_srcs
    cdef const mxl_ssize_t **_strides   # NULL where the sample's array is C-contiguous
    cdef PyObject **_refs          # the arrays recorded so far, one reference each
    cdef Py_ssize_t _nrefs
    cdef readonly list columns

    cdef int _setup(self, SampleTree tree, Py_ssize_t n) except -1:
        cdef Py_ssize_t cells = tree._nleaves * n, k
        self._tree = tree
        self.n = n
        self._srcs = <const char **>PyMem_Malloc((cells + 1) * sizeof(char *))
        self._strides = <const mxl_ssize_t **>PyMem_Malloc((cells + 1) * sizeof(mxl_ssize_t *))
        self._refs = <PyObject **>PyMem_Malloc((cells + 1) * sizeof(PyObject *))
        if self._srcs is NULL or self._strides is NULL or self._refs is NULL:
            raise MemoryError()
        # PyList_New's empty slots are NULL until gather() sets them; a table
        # gather() gave up on is never handed out.
        self.columns = [PyList_New(n) for k in range(tree._nother)]
        return 0

    def __dealloc__(self):
        cdef Py_ssize_t k
        if self._refs is not NULL:
            for k in range(self._nrefs):
                Py_XDECREF(self._refs[k])
        PyMem_Free(self._refs)
        PyMem_Free(self._srcs)
        PyMem_Free(self._strides)

    def fill(self, buffer, Py_ssize_t base_offset, list offsets not None):
        """Copy every array leaf's column into `buffer` (anything exporting
        a writable buffer): leaf j as one C-contiguous (n,) + shape block at
        base_offset + offsets[j]; GIL released.  Returns each leaf's ns."""
        cdef SampleTree tree = self._tree
        cdef Py_ssize_t nl = tree._nleaves, n = self.n, j, i
        if len(offsets) != nl:
            raise ValueError(f"{len(offsets)} offsets for {nl} array leaves")
        if nl == 0:
            return []
        cdef Py_buffer view
        cdef int64_t *ns = <int64_t *>PyMem_Malloc((nl + 1) * sizeof(int64_t))
        cdef Py_ssize_t *at = <Py_ssize_t *>PyMem_Malloc((nl + 1) * sizeof(Py_ssize_t))
        cdef mxl_tree_leaf *leaf
        cdef char *dst
        cdef const char **srcs = self._srcs
        cdef const mxl_ssize_t **strides = self._strides
        cdef int64_t t0
        if ns is NULL or at is NULL:
            PyMem_Free(ns)
            PyMem_Free(at)
            raise MemoryError()
        try:
            PyObject_GetBuffer(buffer, &view, PyBUF_WRITABLE | PyBUF_SIMPLE)
            try:
                for j in range(nl):
                    at[j] = base_offset + <Py_ssize_t>offsets[j]
                    if base_offset < 0 or at[j] < base_offset or at[j] + n * tree._leaves[j].row_bytes > view.len:
                        raise ValueError(f"leaf {j} at offset {at[j]} ({n * tree._leaves[j].row_bytes} bytes) "
                                         f"is outside the buffer's {view.len} bytes")
                with nogil:
                    for j in range(nl):
                        leaf = &tree._leaves[j]
                        dst = <char *>view.buf + at[j]
                        t0 = mxl_monotonic_ns()
                        for i in range(n):
                            # The rows are scattered over the heap: ask for a later
                            # row's lines while row i is copied.
                            if i + FILL_AHEAD < n:
                                mxl_prefetch_span(srcs[j * n + i + FILL_AHEAD], leaf.row_bytes)
                            if strides[j * n + i] is NULL:
                                memcpy(dst, srcs[j * n + i], leaf.row_bytes)
                            else:
                                mxl_copy_nd(dst, leaf.strides, srcs[j * n + i], strides[j * n + i],
                                            leaf.dims, leaf.ndim, leaf.itemsize)
                            dst += leaf.row_bytes
                        ns[j] = mxl_monotonic_ns() - t0
            finally:
                PyBuffer_Release(&view)
            return [ns[j] for j in range(nl)]
        finally:
            PyMem_Free(ns)
            PyMem_Free(at)

    def fill_leaf(self, Py_ssize_t j, cnp.ndarray out not None):
        """Copy array leaf j's column into `out` (writeable, (n,) + the
        leaf's shape, its dtype, any strides); GIL released.  Returns the ns."""
        cdef SampleTree tree = self._tree
        if j < 0 or j >= tree._nleaves:
            raise IndexError(f"array leaf {j} of {tree._nleaves}")
        cdef mxl_tree_leaf *leaf = &tree._leaves[j]
        shape, dtype = tree.leaves[j]
        if _shape_of(out) != (self.n,) + shape:
            raise ValueError(f"out has shape {_shape_str(_shape_of(out))}, expected "
                             f"{_shape_str((self.n,) + shape)}")
        if not mxl_equiv_descr(cnp.PyArray_DESCR(out), leaf.descr):
            raise ValueError(f"out has dtype {out.dtype}, expected {dtype}")
        if not cnp.PyArray_ISWRITEABLE(out):
            raise ValueError("out must be writeable")
        cdef Py_ssize_t n = self.n, i
        cdef char *dst = <char *>cnp.PyArray_DATA(out)
        cdef mxl_ssize_t step = cnp.PyArray_STRIDES(out)[0]
        cdef const mxl_ssize_t *dst_strides = <const mxl_ssize_t *>cnp.PyArray_STRIDES(out) + 1
        cdef const char **srcs = self._srcs + j * n
        cdef const mxl_ssize_t **strides = self._strides + j * n
        cdef int64_t t0
        with nogil:
            t0 = mxl_monotonic_ns()
            for i in range(n):
                mxl_copy_nd(dst + i * step, dst_strides, srcs[i],
                            strides[i] if strides[i] is not NULL else leaf.strides,
                            leaf.dims, leaf.ndim, leaf.itemsize)
            t0 = mxl_monotonic_ns() - t0
        return t0


TREE_DICT = MXL_TREE_DICT
TREE_TUPLE = MXL_TREE_TUPLE
TREE_LIST = MXL_TREE_LIST
TREE_ARRAY = MXL_TREE_ARRAY
TREE_OTHER = MXL_TREE_OTHER


def field_views(buffer, Py_ssize_t base_offset, list offsets not None, list fields not None):
    """C-contiguous numpy arrays over `buffer` (anything exporting a buffer),
    field k's (its .shape and .dtype, a numpy dtype) at base_offset +
    offsets[k], each with `buffer` as its base: np.ndarray(shape, dtype,
    buffer=buffer, offset=...) for a whole plan in one call."""
    cdef Py_ssize_t nf = len(fields), k, off, nbytes
    cdef Py_buffer view
    cdef int nd, d, flags
    cdef cnp.npy_intp dims[MXL_MAX_DIMS]
    cdef cnp.dtype dtype
    cdef tuple shape
    cdef cnp.ndarray arr
    cdef char *base
    cdef list out = []
    if len(offsets) != nf:
        raise ValueError(f"{len(offsets)} offsets for {nf} fields")
    if nf == 0:
        return out
    flags = cnp.NPY_ARRAY_CARRAY
    if PyObject_GetBuffer(buffer, &view, PyBUF_WRITABLE | PyBUF_SIMPLE) != 0:
        raise BufferError("buffer is not a writable contiguous buffer")
    try:
        base = <char *>view.buf
        for k in range(nf):
            field = fields[k]
            shape = field.shape
            dtype = field.dtype
            nd = len(shape)
            _check_ndim(nd, f"field {k}")
            nbytes = dtype.itemsize
            for d in range(nd):
                dims[d] = shape[d]
                nbytes *= dims[d]
            off = base_offset + <Py_ssize_t>offsets[k]
            if off < 0 or nbytes < 0 or off + nbytes > view.len:
                raise ValueError(f"field {k} at offset {off} ({nbytes} bytes) is outside the buffer's "
                                 f"{view.len} bytes")
            Py_INCREF(dtype)   # PyArray_NewFromDescr steals it
            arr = mxl_array_new(<PyTypeObject *>cnp.ndarray, <cnp.PyArray_Descr *>dtype, nd, dims, NULL,
                                base + off, flags, NULL)
            cnp.set_array_base(arr, buffer)
            out.append(arr)
    finally:
        PyBuffer_Release(&view)
    return out
