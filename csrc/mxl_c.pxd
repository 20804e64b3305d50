# C declarations used by mxload._core: kept apart from the code that uses them.
from libc.stddef cimport ptrdiff_t
from libc.stdint cimport int64_t, uint64_t

cdef extern from "mxl_copy.h" nogil:
    ctypedef ptrdiff_t mxl_ssize_t
    enum: MXL_MAX_DIMS
    int64_t mxl_monotonic_ns()
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

cdef extern from "mxl_cond.h" nogil:
    const char *MXL_COND_CLOCK_NAME
    int mxl_cond_init(pthread_cond_t *c)
    void mxl_cond_deadline(timespec *ts, double seconds)

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
    # dtype.hasobject without two Python attribute lookups.
    bint mxl_descr_hasobject "PyDataType_REFCHK"(cnp.PyArray_Descr *d) nogil

cdef extern from "Python.h":
    # CPython >= 3.10: make `signum` pending as if it had just arrived.
    int PyErr_SetInterruptEx(int signum)

cdef extern from "<signal.h>":
    int SIGINT
