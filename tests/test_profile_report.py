"""The profiler's report alone (mxload/_profile_report.py): made-up collected totals in, the
rows, the table and the verdict out (no loader, no clock)."""
from __future__ import annotations

import json

import pytest

import mxload
from mxload._profile_report import STAGES, WORKER_STAGES, Collected, report_of

pytestmark = pytest.mark.timeout(10)

S = 1_000_000_000   # ns


def collected(**changes) -> Collected:
    """One second of 20 batches by 2 workers, the training loop waiting 60% of it in fetch."""
    stage_ns = dict.fromkeys(STAGES, 0)
    stage_ns.update(fetch=6 * S // 10, consumer_compute=4 * S // 10)
    values = dict(
        wall_ns=S, stage_ns=stage_ns,
        worker_stage_ns={"fetch": 18 * S // 10, "collate": S // 10, "transport": 0},
        fields={"sample[0]": ["memcpy", 20, S // 20, 20 * 4096, (8, 128), "float32"]},
        workers={0: [95 * S // 100, 10, 0, S, 101, 0], 1: [95 * S // 100, 10, 0, S, 102, 1]},
        cpu={101: ((0, 0), (S // 10, 0), 0), 102: ((0, 0), (S // 10, 0), 0)},
        main_cpu_ns=S // 10, batches=20, samples=160, autotune=None)
    values.update(changes)
    return Collected(**values)


def test_the_stages_and_the_rows_come_from_the_totals(monkeypatch):
    monkeypatch.setattr("mxload._profile_report.usable_cores", lambda: 8)
    report = report_of(collected())
    assert isinstance(report, mxload.Report) and report.batches == 20 and report.samples == 160
    assert report.wall_s == 1.0 and report.stages["fetch"] == 0.6
    assert report.consumer_wait_s == pytest.approx(0.6) and report.loader_bound
    assert set(report.worker_stages) == set(WORKER_STAGES)
    (field,) = report.fields
    assert field["path"] == "sample[0]" and field["bytes_per_batch"] == 4096 and field["elements"] == 1
    w0, w1 = report.workers
    assert (w0["worker"], w0["pid"], w0["busy_share"], w0["cpu_share"]) == (0, 101, 0.95, 0.1)
    assert w1["restarts"] == 1 and w0["cpu_of_busy"] == pytest.approx(0.1 / 0.95)
    assert report.cpu["usable_cores"] == 8 and report.cores_busy == pytest.approx(0.3)
    json.dumps(report.to_dict())
    assert "verdict: " + report.verdict in str(report)


def test_workers_that_sleep_in_fetch_are_told_to_add_workers(monkeypatch):
    """Busy 95% of the time, on 10% of a core each: I/O or sleeping, not computing."""
    monkeypatch.setattr("mxload._profile_report.usable_cores", lambda: 8)
    verdict = report_of(collected()).verdict
    assert verdict.startswith("loader-bound") and "add workers" in verdict, verdict


def test_a_loop_that_barely_waits_is_consumer_bound():
    stage_ns = dict.fromkeys(STAGES, 0)
    stage_ns.update(fetch=S // 20, consumer_compute=19 * S // 20)
    verdict = report_of(collected(stage_ns=stage_ns)).verdict
    assert verdict.startswith("consumer-bound: the training loop waited for data 5%"), verdict


@pytest.mark.parametrize("batches, words", [(0, "no batches"), (4, "too few batches to judge (4;")])
def test_too_few_batches_get_no_verdict(batches, words):
    assert report_of(collected(batches=batches)).verdict.startswith(words)


def test_a_list_valued_field_is_one_row_named_by_its_elements():
    fields = {f"sample['boxes'][{i}]": ["memcpy", 20, S // 1000, 20 * 16, (4,), "float32"]
              for i in range(600)}
    fields["sample['image']"] = ["memcpy", 20, S // 100, 20 * 4096, (32, 32), "uint8"]
    report = report_of(collected(fields=fields))
    rows = {f["path"]: f for f in report.fields}
    assert set(rows) == {"sample['boxes']", "sample['image']"}
    assert rows["sample['boxes']"]["elements"] == 600 and rows["sample['boxes']"]["seconds"] == 0.6
