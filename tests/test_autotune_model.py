"""The autotuner's model alone (mxload/_runtime/autotune/model.py): predictions from made-up
measurements."""
from __future__ import annotations

import numpy as np
import pytest

from mxload._runtime.autotune import model

pytestmark = pytest.mark.timeout(10)

MS = 1_000_000


def test_in_process_adds_the_load_and_the_step():
    assert model.predict_ns(0, 2 * MS, 3 * MS, 3 * MS, 4, batch_bytes=10**9) == 5 * MS
    assert model.optimistic_ns(0, 2 * MS, 3 * MS, 3 * MS, 4) == 5 * MS


def test_workers_are_bound_by_the_loop_the_load_shared_or_the_cores():
    # The loop's own path: a long step with cheap batches.
    assert model.predict_ns(4, MS, 10 * MS, 0, 8) == 10 * MS + model.MAIN_OVERHEAD_NS
    # The load shared by k workers (each paying its own cost per batch).
    work = 8 * MS + model.worker_cost_ns(1 << 20)
    assert model.predict_ns(2, 8 * MS, 0, 0, 8, batch_bytes=1 << 20) == work / 2
    # The cores: all of it spread over 2.
    assert model.predict_ns(8, 8 * MS, 0, 0, 2) == (model.MAIN_OVERHEAD_NS + 8 * MS
                                                    + model.worker_cost_ns(0)) / 2


def test_more_workers_never_predict_slower_and_a_big_batch_costs_them_more():
    times = [model.predict_ns(k, 4 * MS, MS, MS, 4) for k in range(1, 9)]
    assert times == sorted(times, reverse=True)
    assert model.predict_ns(2, MS, 0, 0, 4, batch_bytes=10 << 20) > model.predict_ns(2, MS, 0, 0, 4)
    assert model.worker_cost_ns(1000) == model.WORKER_BATCH_NS + model.WORKER_NS_PER_BYTE * 1000


def test_the_optimistic_bound_leaves_out_what_the_model_only_estimates():
    for k in range(1, 5):
        assert model.optimistic_ns(k, 4 * MS, MS, MS, 4) <= model.predict_ns(k, 4 * MS, MS, MS, 4)
    assert model.optimistic_ns(2, 4 * MS, MS, 0, 4) == 2 * MS


def test_a_probes_rate_leaves_out_its_warm_up_but_not_its_slow_batches():
    loads, steps = [9 * MS, MS, 3 * MS, MS], [MS, MS, MS]
    assert model.probe_rate(loads, steps) == pytest.approx(3 / 0.008)
    assert model.probe_rate([MS], []) == pytest.approx(1000.0)   # one batch: its own
    assert model.probe_rate([0, 0], [0]) is None


def test_a_batches_bytes_are_its_arrays_in_any_nesting():
    batch = {"x": np.zeros((4, 8), np.float32), "y": (np.zeros(4, np.int64), [np.zeros(2, np.uint8)])}
    assert model.batch_nbytes(batch) == 128 + 32 + 2
    assert model.batch_nbytes("not an array") == 0
