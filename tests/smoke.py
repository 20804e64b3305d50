"""Smoke test of an installed mxload (a wheel or an sdist build): not collected by pytest.

Checks that the compiled core imports, that the typing files were installed, that
show_config() works, and that worker processes collate correct batches into shared
memory.  Used by .ci/run for the sdist check and by cibuildwheel on macOS, where the
test suite's /proc-based leak checks cannot run.

    python tests/smoke.py
"""
from __future__ import annotations

import os
import sys

import numpy as np


def main() -> int:
    import mxload
    from mxload import _core, batchify

    package_dir = os.path.dirname(os.path.abspath(mxload.__file__))
    for name in ("py.typed", "_core.pyi"):
        assert os.path.isfile(os.path.join(package_dir, name)), f"{name} is missing from {package_dir}"
    assert os.path.dirname(os.path.abspath(_core.__file__)) == package_dir

    mxload.show_config()
    assert int(_core.BUILD_INFO["numpy_build_version"].split(".")[0]) >= 2, _core.BUILD_INFO

    x = np.arange(200, dtype=np.float32).reshape(100, 2)
    y = np.arange(100)
    for workers in (0, 2):
        loader = mxload.DataLoader(mxload.ArrayDataset(x, y), batch_size=8, shuffle=True, seed=0,
                                   num_workers=workers)
        seen = []
        for bx, by in loader:
            assert bx.dtype == np.float32 and bx.shape[1:] == (2,) and len(bx) == len(by)
            assert (bx[:, 0] == 2 * by).all()
            seen.extend(by.tolist())
        loader.close()
        assert sorted(seen) == list(range(100)), f"{workers} workers: wrong samples"

    padded, lengths = _core.pad([np.ones(3), np.ones(5)], val=-1, ret_length=True)
    assert padded.shape == (2, 5) and lengths.tolist() == [3, 5] and padded[0, 3] == -1
    assert batchify.Stack()([np.zeros(2), np.ones(2)]).shape == (2, 2)

    print(f"smoke test passed: mxload {mxload.__version__} from {package_dir}, "
          f"numpy {np.__version__}, python {sys.version.split()[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
