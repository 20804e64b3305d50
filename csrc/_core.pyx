# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# cython: initializedcheck=False
"""mxload's compiled core: reorder buffer, collation kernels, layout planner,
shared-memory slabs, the fetcher's receive path, the per-batch task send,
hand-off and the engine's window,
Ctrl-C deferral and the workers' parent watchdog.  C declarations live in
mxl_c.pxd, the typed fields of its own extension types in mxload/_core.pxd; the code is
split by job into the .pxi files included below."""

cimport cython
from cpython.pyport cimport PY_SSIZE_T_MAX
from cpython.buffer cimport PyBuffer_FillInfo, PyBuffer_Release, PyObject_GetBuffer, PyBUF_SIMPLE, PyBUF_WRITABLE
from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.list cimport PyList_New
from cpython.ref cimport Py_INCREF, Py_XDECREF
from cpython.exc cimport PyErr_CheckSignals
from cpython.mem cimport PyMem_Malloc, PyMem_Free, PyMem_Realloc
from libc.errno cimport errno, EAGAIN, EINTR
from libc.stdint cimport int64_t, uint64_t
from libc.stdlib cimport malloc
from libc.string cimport memcpy

cimport numpy as cnp
import os
import warnings
from collections import deque
from itertools import islice as _islice
from operator import index as _operator_index
from _thread import allocate_lock as _allocate_lock

import numpy as np

from mxl_c cimport *

cnp.import_array()

# NOTE [ No memoryviews in the core ]
# A typed memoryview (`int64_t[::1] v = array`) anywhere in this module makes Cython add its
# memoryview support, whose module initialization registers its types with collections.abc
# inside `try: ... except: pass`: a Ctrl-C landing there (during `import mxload`) was dropped,
# and the program ran on as if it had never been pressed.  So the core reads arrays through
# pointers (cnp.PyArray_DATA of an array it made, contiguous) and never declares a memoryview;
# tests/test_interrupts.py lands a Ctrl-C at each such registration of an import.

include "interrupt.pxi"
include "reorder.pxi"
include "collate.pxi"
include "slab.pxi"
include "receive.pxi"
include "channel.pxi"
include "task.pxi"
include "handoff.pxi"
include "books.pxi"
include "supply.pxi"
include "sample.pxi"
include "window.pxi"
include "watchdog.pxi"

cdef extern from *:
    """
    #ifndef MXL_COMPILE_FLAGS
    #define MXL_COMPILE_FLAGS "unknown"
    #endif
    #ifndef MXL_NUMPY_BUILD_VERSION
    #define MXL_NUMPY_BUILD_VERSION "unknown"
    #endif
    """
    const char *MXL_COMPILE_FLAGS
    const char *MXL_NUMPY_BUILD_VERSION

# How this extension was built (shown by mxload.show_config()).
BUILD_INFO = {
    "compile_flags": MXL_COMPILE_FLAGS.decode(),
    "numpy_build_version": MXL_NUMPY_BUILD_VERSION.decode(),
    "numpy_c_api": True,
    # The clock ReorderBuffer's waits are timed on (see mxl_cond.h).
    "wait_clock": MXL_COND_CLOCK_NAME.decode(),
}
