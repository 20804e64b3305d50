"""The leak checks of conftest.py see what a test leaves, and only that."""
from __future__ import annotations

import os

import pytest
from conftest import _snapshot, is_slab_mapping, leftovers

from mxload._runtime.slabs import create_shared_fd, map_slab

pytestmark = pytest.mark.timeout(30)


def test_a_mapped_slab_left_behind_is_reported():
    before = _snapshot()
    fd = create_shared_fd(65536)
    slab = map_slab(fd, 65536)
    os.close(fd)
    assert "slab mappings" in leftovers(before)
    del slab
    assert leftovers(before) == {}


def test_shm_entries_of_others_are_ignored_and_ours_reported():
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    before = _snapshot()
    foreign = f"/dev/shm/someone-else-{os.getpid()}"
    ours = f"/dev/shm/mxload-leak-check-{os.getpid()}"
    try:
        open(foreign, "w").close()
        assert leftovers(before) == {}
        open(ours, "w").close()
        assert leftovers(before) == {"shm": [os.path.basename(ours)]}
    finally:
        for path in (foreign, ours):
            if os.path.exists(path):
                os.unlink(path)


def test_only_slab_files_count_as_slab_mappings():
    prefix = "7f00-7f10 rw-s 00000000 00:01 1234                       "
    assert is_slab_mapping(prefix + "/memfd:mxload-slab (deleted)\n")
    assert is_slab_mapping(prefix + "/dev/shm/mxload-0123abcd\n")
    assert not is_slab_mapping("7f00-7f10 r-xp 00000000 08:01 99  /tmp/mxload-ci.X/venv/lib/libtorch.so\n")
    assert not is_slab_mapping("7f00-7f10 rw-p 00000000 00:00 0 \n")
