# C declarations used by mxload._core: kept apart from the code that uses them.
from libc.stddef cimport ptrdiff_t
from libc.stdint cimport int64_t, uint32_t, uint64_t
from posix.uio cimport iovec

cdef extern from "mxl_copy.h" nogil:
    ctypedef ptrdiff_t mxl_ssize_t
    enum: MXL_MAX_DIMS
    int64_t mxl_monotonic_ns()
    void mxl_prefetch(const void *p)
    void mxl_prefetch_span(const char *p, mxl_ssize_t nbytes)
    void mxl_copy_nd(char *dst, const mxl_ssize_t *dst_strides,
                     const char *src, const mxl_ssize_t *src_strides,
                     const mxl_ssize_t *shape, int ndim, mxl_ssize_t itemsize)
    void mxl_fill_nd(char *dst, const mxl_ssize_t *strides, const mxl_ssize_t *shape,
                     int ndim, const char *pattern, mxl_ssize_t itemsize)

cdef extern from "<time.h>" nogil:
    ctypedef long time_t
    struct timespec:
        time_t tv_sec
        long tv_nsec

cdef extern from "<pthread.h>" nogil:
    ctypedef struct pthread_mutex_t:
        pass
    ctypedef struct pthread_mutexattr_t:
        pass
    ctypedef struct pthread_cond_t:
        pass
    int pthread_mutex_init(pthread_mutex_t *m, const pthread_mutexattr_t *attr)
    int pthread_mutex_destroy(pthread_mutex_t *m)
    int pthread_mutex_lock(pthread_mutex_t *m)
    int pthread_mutex_trylock(pthread_mutex_t *m)
    int pthread_mutex_unlock(pthread_mutex_t *m)
    int pthread_cond_destroy(pthread_cond_t *c)
    int pthread_cond_broadcast(pthread_cond_t *c)
    int pthread_cond_timedwait(pthread_cond_t *c, pthread_mutex_t *m, const timespec *abstime)
    int pthread_atfork(void (*prepare)() noexcept nogil, void (*parent)() noexcept nogil,
                       void (*child)() noexcept nogil)

cdef extern from "mxl_watchdog.h" nogil:
    int mxl_start_watchdog(int fd)

cdef extern from "mxl_cond.h" nogil:
    const char *MXL_COND_CLOCK_NAME
    int mxl_cond_init(pthread_cond_t *c)
    void mxl_cond_deadline(timespec *ts, double seconds)

cdef extern from "<stdlib.h>" nogil:
    # A slab's private copy (BatchLender): aligned as a slab's fields are.
    int posix_memalign(void **memptr, size_t alignment, size_t size)
    void free(void *ptr)


cdef extern from "<sys/mman.h>" nogil:
    int PROT_READ
    int PROT_WRITE
    int MAP_SHARED
    void *MAP_FAILED
    void *mmap(void *addr, size_t length, int prot, int flags, int fd, long offset)
    int munmap(void *addr, size_t length)

cdef extern from *:
    """
    #include <sys/mman.h>
    #ifdef MAP_POPULATE
    #define MXL_MAP_POPULATE MAP_POPULATE
    #else
    #define MXL_MAP_POPULATE 0
    #endif
    """
    int MXL_MAP_POPULATE

cimport numpy as cnp
from cpython.object cimport PyObject, PyTypeObject
cdef extern from *:
    """
    #include <numpy/arrayobject.h>
    #include "mxl_copy.h"
    /* The kernels read numpy's shape and stride arrays (npy_intp) as mxl_ssize_t. */
    typedef char mxl_ssize_t_is_npy_intp[sizeof(mxl_ssize_t) == sizeof(npy_intp) ? 1 : -1];
    """

cdef extern from "numpy/arrayobject.h":
    # numpy's own .pxd declares this over Python dtype objects; the kernels
    # compare raw descriptor pointers without touching refcounts.
    bint mxl_equiv_descr "PyArray_EquivTypes"(cnp.PyArray_Descr *a, cnp.PyArray_Descr *b)
    # An array over memory we own (steals the descriptor reference; the
    # caller sets the base): numpy's .pxd leaves it commented out.
    object mxl_array_new "PyArray_NewFromDescr"(PyTypeObject *subtype, cnp.PyArray_Descr *descr, int nd,
                                                 cnp.npy_intp *dims, cnp.npy_intp *strides, void *data,
                                                 int flags, PyObject *obj)
    # dtype.hasobject without two Python attribute lookups.
    bint mxl_descr_hasobject "PyDataType_REFCHK"(cnp.PyArray_Descr *d) nogil

cdef extern from "Python.h":
    # CPython >= 3.10: make `signum` pending as if it had just arrived.
    int PyErr_SetInterruptEx(int signum)

cdef extern from "<signal.h>":
    int SIGINT

cdef extern from "<poll.h>" nogil:
    struct pollfd:
        int fd
        short events
        short revents
    short POLLIN
    short POLLHUP
    short POLLERR
    short POLLNVAL
    int poll(pollfd *fds, unsigned long nfds, int timeout)

cdef extern from "mxl_recv.h" nogil:
    enum: MXL_FRAME_HEADER
    enum: MXL_HEADER_TAG_AT
    enum: MXL_HEADER_VERSION_AT
    enum: MXL_BATCH_WORDS
    enum: MXL_BATCH_SIZE
    enum: MXL_FDQ
    ctypedef struct mxl_batch_frame:
        int64_t epoch
        int64_t idx
        int64_t slab_id
        int64_t nbytes
        int64_t layout_id
    ctypedef struct mxl_channel:
        int sock
        int sentinel
        int64_t tag
        int nfds
        int eof
        int fd_overflow
        int end_reported
        int death_reported
    int mxl_event_open()
    void mxl_event_signal(int fd)
    void mxl_event_clear(int fd)
    void mxl_event_close(int fd)
    void mxl_channel_init(mxl_channel *ch)
    void mxl_channel_reset(mxl_channel *ch)
    long mxl_channel_fill(mxl_channel *ch)
    int mxl_channel_next(const mxl_channel *ch, const char **header, const char **payload,
                         uint32_t *plen, int *nfds)
    void mxl_channel_pop(mxl_channel *ch, uint32_t plen)
    int mxl_channel_take_fds(mxl_channel *ch, int n, int *out)
    void mxl_batch_decode(const char *p, mxl_batch_frame *f)

# One batch a worker wrote into a slab, as the fetcher's GIL-free path stores it.
ctypedef struct mxl_raw_entry:
    mxl_batch_frame frame
    int slot
    int64_t tag

cdef extern from "mxl_send.h" nogil:
    enum: MXL_TASK_FIXED
    enum: MXL_TASK_MAX_WORDS
    void mxl_put_le(char *p, uint64_t v, int nbytes)
    void mxl_pack_task(char *head, const char *prefix, int64_t epoch, int64_t idx, int64_t slab_id,
                       int64_t slab_size, int flags, uint32_t ndrops, uint32_t nindices, int nfds)
    long mxl_send_pieces(int sock, iovec *iov, int n, int fd)
    long mxl_send_frame(int sock, const char *head, size_t hlen, const char *data, size_t dlen, int fd)

# --- The sample-tree walker (collate.pxi's SampleTree): borrowed-reference
# access to the containers and arrays of a batch's samples, so the walk over
# every sample's fields is C with no reference counting per field.
cdef extern from "Python.h":
    bint mxl_dict_check_exact "PyDict_CheckExact"(PyObject *o)
    Py_ssize_t mxl_dict_size "PyDict_GET_SIZE"(PyObject *o)
    int mxl_dict_next "PyDict_Next"(PyObject *d, Py_ssize_t *pos, PyObject **key, PyObject **value)
    bint mxl_tuple_check_exact "PyTuple_CheckExact"(PyObject *o)
    Py_ssize_t mxl_tuple_size "PyTuple_GET_SIZE"(PyObject *o)
    PyObject *mxl_tuple_item "PyTuple_GET_ITEM"(PyObject *o, Py_ssize_t i)
    bint mxl_list_check_exact "PyList_CheckExact"(PyObject *o)
    Py_ssize_t mxl_list_size "PyList_GET_SIZE"(PyObject *o)
    PyObject *mxl_list_item "PyList_GET_ITEM"(PyObject *o, Py_ssize_t i)
    void mxl_list_set_item "PyList_SET_ITEM"(PyObject *o, Py_ssize_t i, PyObject *v)
    bint mxl_unicode_check_exact "PyUnicode_CheckExact"(PyObject *o)
    bint mxl_long_check_exact "PyLong_CheckExact"(PyObject *o)
    int mxl_rich_compare_bool "PyObject_RichCompareBool"(PyObject *a, PyObject *b, int op) except -1
    void mxl_incref "Py_INCREF"(PyObject *o)
    enum: Py_EQ

cdef extern from "numpy/arrayobject.h":
    bint mxl_array_check_exact "PyArray_CheckExact"(PyObject *o)
    cnp.PyArray_Descr *mxl_array_descr "PyArray_DESCR"(cnp.PyArrayObject *a) nogil
    int mxl_array_ndim "PyArray_NDIM"(cnp.PyArrayObject *a) nogil
    cnp.npy_intp *mxl_array_dims "PyArray_DIMS"(cnp.PyArrayObject *a) nogil
    cnp.npy_intp *mxl_array_strides "PyArray_STRIDES"(cnp.PyArrayObject *a) nogil
    void *mxl_array_data "PyArray_DATA"(cnp.PyArrayObject *a) nogil

# A SampleTree's nodes, sample 0's structure in preorder.
cdef enum:
    MXL_TREE_DICT = 0     # a plain dict: its children in sample 0's key order
    MXL_TREE_TUPLE = 1    # a plain tuple
    MXL_TREE_LIST = 2     # a plain list
    MXL_TREE_ARRAY = 3    # a plain ndarray, stacked by the tree's own kernel
    MXL_TREE_OTHER = 4    # anything else: its column goes back to Python

ctypedef struct mxl_tree_node:
    int kind
    Py_ssize_t nchildren
    Py_ssize_t size       # nodes in this subtree, itself included (the next sibling is size on)
    Py_ssize_t leaf       # ARRAY: index among the array leaves; OTHER: among the other leaves
    PyObject *key         # the child of a dict: its key (the tree holds a reference)

ctypedef struct mxl_tree_leaf:
    cnp.PyArray_Descr *descr         # sample 0's dtype (the tree holds a reference)
    int ndim
    mxl_ssize_t itemsize
    mxl_ssize_t row_bytes            # one sample's bytes
    mxl_ssize_t dims[MXL_MAX_DIMS]
    mxl_ssize_t strides[MXL_MAX_DIMS]  # C-contiguous, as the leaf's rows in the batch buffer
