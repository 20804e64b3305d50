/* The core's plain-C helpers: no Python object, so they run without the GIL.
 * Header-only (static), compiled into mxload._core; declared in mxl_c.pxd.
 *
 *   mxl_monotonic_ns             the clock of the collation kernels' own timings
 *                                and of the ReorderBuffer's wait deadlines;
 *   mxl_copy_nd, mxl_fill_nd     strided n-d copy and pattern fill: the inner
 *                                loops of stack_fill, pad_fill and copy_into;
 *   mxl_prefetch, mxl_prefetch_span
 *                                ask for memory before a loop needs it: the
 *                                many-small-fields paths are bound by the latency
 *                                of samples scattered over the heap, not by copying.
 *
 * mxl_copy_nd and mxl_fill_nd keep their odometer (one index per dimension) in
 * a stack array of MXL_MAX_DIMS entries, as pad_fill does its pad shape: their
 * callers refuse arrays with more dimensions first (_check_ndim in collate.pxi).
 */
#ifndef MXL_COPY_H
#define MXL_COPY_H

#include <stddef.h>
#include <string.h>
#include <time.h>
#include <stdint.h>

/* numpy 1.x's NPY_MAXDIMS: the same arrays collate whatever numpy runs. */
#define MXL_MAX_DIMS 32

/* Sizes and strides, as numpy's npy_intp (checked at compile time in mxl_c.pxd). */
typedef ptrdiff_t mxl_ssize_t;

/* Monotonic clock in nanoseconds: kernels time themselves with it, so a
 * per-field timing costs two vDSO calls instead of a Python call. */
static inline int64_t mxl_monotonic_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + (int64_t)ts.tv_nsec;
}

/* A hint that `p`'s cache line is read soon; never faults, whatever `p` is. */
static inline void mxl_prefetch(const void *p)
{
#if defined(__GNUC__) || defined(__clang__)
    __builtin_prefetch(p, 0, 3);
#else
    (void)p;
#endif
}

/* The same for the lines of [p, p + nbytes), up to MXL_PREFETCH_MAX_BYTES: a
 * longer span's sequential reads are the hardware prefetcher's to follow. */
#define MXL_PREFETCH_MAX_BYTES 1024
static inline void mxl_prefetch_span(const char *p, mxl_ssize_t nbytes)
{
    mxl_ssize_t off;
    if (nbytes > MXL_PREFETCH_MAX_BYTES)
        nbytes = MXL_PREFETCH_MAX_BYTES;
    for (off = 0; off < nbytes; off += 64)
        mxl_prefetch(p + off);
}

/* Copy `count` elements of `itemsize` bytes with arbitrary strides.  Fixed
 * sizes get a typed assignment (the compiler turns the memcpy into one move). */
static inline void mxl_copy_strided_1d(char *dst, mxl_ssize_t dst_stride,
                                       const char *src, mxl_ssize_t src_stride,
                                       mxl_ssize_t count, mxl_ssize_t itemsize)
{
    mxl_ssize_t i;
#define MXL_LOOP(N) for (i = 0; i < count; i++) { memcpy(dst, src, N); dst += dst_stride; src += src_stride; } break;
    switch (itemsize) {
    case 1: MXL_LOOP(1)
    case 2: MXL_LOOP(2)
    case 4: MXL_LOOP(4)
    case 8: MXL_LOOP(8)
    case 16: MXL_LOOP(16)
    default:
        for (i = 0; i < count; i++) {
            memcpy(dst, src, (size_t)itemsize);
            dst += dst_stride;
            src += src_stride;
        }
    }
#undef MXL_LOOP
}

/* Advance an odometer over dimensions [0, nd) of `shape`, moving both
 * pointers by their strides; returns 0 once every position was visited. */
static inline int mxl_advance(mxl_ssize_t *index, const mxl_ssize_t *shape, int nd,
                              char **dst, const mxl_ssize_t *dst_strides,
                              const char **src, const mxl_ssize_t *src_strides)
{
    int d;
    for (d = nd - 1; d >= 0; d--) {
        index[d]++;
        *dst += dst_strides[d];
        *src += src_strides[d];
        if (index[d] < shape[d])
            return 1;
        *dst -= dst_strides[d] * shape[d];
        *src -= src_strides[d] * shape[d];
        index[d] = 0;
    }
    return 0;
}

/* Copy an n-d array (src, src_strides) into (dst, dst_strides), both of
 * `shape`.  Trailing dimensions that are contiguous in both are merged into
 * one memcpy block, so the common cases (contiguous sample into a contiguous
 * batch, or into a padded row) are a single memcpy per sample or per row. */
static void mxl_copy_nd(char *dst, const mxl_ssize_t *dst_strides,
                        const char *src, const mxl_ssize_t *src_strides,
                        const mxl_ssize_t *shape, int ndim, mxl_ssize_t itemsize)
{
    mxl_ssize_t block = itemsize;
    mxl_ssize_t index[MXL_MAX_DIMS];
    int nd = ndim, d;

    for (d = 0; d < ndim; d++)
        if (shape[d] == 0)
            return;
    while (nd > 0 && src_strides[nd - 1] == block && dst_strides[nd - 1] == block) {
        block *= shape[nd - 1];
        nd--;
    }
    if (nd == 0) {
        memcpy(dst, src, (size_t)block);
        return;
    }
    for (d = 0; d < nd; d++)
        index[d] = 0;
    if (block == itemsize) {
        /* innermost dimension is strided: copy it element by element */
        int last = nd - 1;
        do {
            mxl_copy_strided_1d(dst, dst_strides[last], src, src_strides[last],
                                shape[last], itemsize);
        } while (mxl_advance(index, shape, last, &dst, dst_strides, &src, src_strides));
        return;
    }
    do {
        memcpy(dst, src, (size_t)block);
    } while (mxl_advance(index, shape, nd, &dst, dst_strides, &src, src_strides));
}

/* Fill `nbytes` (a multiple of itemsize) with the element `pattern`. */
static void mxl_fill(char *dst, mxl_ssize_t nbytes, const char *pattern, mxl_ssize_t itemsize)
{
    mxl_ssize_t i, done;
    int uniform = 1;
    if (nbytes <= 0)
        return;
    for (i = 1; i < itemsize; i++)
        if (pattern[i] != pattern[0]) {
            uniform = 0;
            break;
        }
    if (uniform) {
        memset(dst, (unsigned char)pattern[0], (size_t)nbytes);
        return;
    }
    memcpy(dst, pattern, (size_t)itemsize);
    done = itemsize;
    while (done < nbytes) {
        mxl_ssize_t n = done <= nbytes - done ? done : nbytes - done;
        memcpy(dst + done, dst, (size_t)n);
        done += n;
    }
}

/* Fill the n-d region (dst, strides, shape) with the element `pattern`,
 * touching nothing between its elements.  Trailing dimensions contiguous in
 * dst are merged into one block, so a contiguous region is a single fill. */
static void mxl_fill_nd(char *dst, const mxl_ssize_t *strides, const mxl_ssize_t *shape,
                        int ndim, const char *pattern, mxl_ssize_t itemsize)
{
    mxl_ssize_t block = itemsize;
    mxl_ssize_t index[MXL_MAX_DIMS];
    const char *unused = dst;  /* mxl_advance moves a second pointer too */
    int nd = ndim, d;

    for (d = 0; d < ndim; d++)
        if (shape[d] == 0)
            return;
    while (nd > 0 && strides[nd - 1] == block) {
        block *= shape[nd - 1];
        nd--;
    }
    for (d = 0; d < nd; d++)
        index[d] = 0;
    do {
        mxl_fill(dst, block, pattern, itemsize);
    } while (nd > 0 && mxl_advance(index, shape, nd, &dst, strides, &unused, strides));
}

#endif
