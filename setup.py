"""Build mxload's compiled core (mxload._core) from the Cython sources in csrc/."""
import os
import sys

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup

compile_args = ["-O3"] if sys.platform != "win32" else ["/O2"]
if os.environ.get("MXLOAD_DEBUG"):
    compile_args = ["-O0", "-g"]

core = Extension(
    "mxload._core",
    sources=["csrc/_core.pyx"],
    include_dirs=[np.get_include(), "csrc"],
    extra_compile_args=compile_args,
    define_macros=[
        ("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION"),
        ("MXL_COMPILE_FLAGS", '"%s"' % " ".join(compile_args)),
        ("MXL_NUMPY_BUILD_VERSION", '"%s"' % np.__version__),
    ],
)

setup(
    ext_modules=cythonize(
        [core],
        include_path=["csrc"],
        compiler_directives={"language_level": "3"},
    ),
)
