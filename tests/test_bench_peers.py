"""bench/peers.py runs: its help, its pieces in process (a missing peer is skipped with the
reason, a failed one is a row that says so, the stacking SPDL's stage uses), one measurement
in process, and (e2e tier) one fresh-process measurement of every installed peer.  The
bench's figures never decide anything here.  Skipped where CI copies the tests out of the
tree (no bench/ beside them)."""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

import fresh_python
import numpy as np
import pytest

pytestmark = pytest.mark.timeout(60)

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
PEERS_PY = os.path.join(BENCH, "peers.py")
if not os.path.exists(PEERS_PY):
    pytest.skip("bench/ is not beside the tests (the installed wheel's run)", allow_module_level=True)


@pytest.fixture(scope="module")
def peers():
    spec = importlib.util.spec_from_file_location("bench_peers", PEERS_PY)
    module = importlib.util.module_from_spec(spec)
    # The bench puts bench/ first on sys.path (bench/ray.py would then shadow ray for the
    # rest of the session) and imports its helpers: both undone after this module's tests.
    path, modules = list(sys.path), set(sys.modules)
    sys.modules[spec.name] = module     # its dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path[:] = path
        for name in set(sys.modules) - modules:
            if (getattr(sys.modules[name], "__file__", None) or "").startswith(BENCH + os.sep):
                del sys.modules[name]


def test_help_names_every_peer_and_imports_none_of_them():
    code = (f"import runpy, sys\nsys.argv = ['peers.py', '--help']\ntry:\n"
            f"    runpy.run_path({PEERS_PY!r}, run_name='__main__')\n"
            f"except SystemExit as e:\n    assert e.code == 0, e.code\n"
            f"print('imported:', sorted(m for m in ('grain', 'spdl', 'torch') if m in sys.modules))")
    out = fresh_python.run_args("-c", code, timeout=30)
    assert out.returncode == 0, out.stderr
    for name in ("mxload", "torch", "grain", "grain-threads", "spdl-threads", "spdl-processes",
                 "spdl-subprocess", "spdl-torch"):
        assert name in out.stdout
    assert "--quick" in out.stdout and "--repeats" in out.stdout
    assert out.stdout.rstrip().endswith("imported: []")


def test_importing_mxload_imports_no_peer():
    out = fresh_python.run("import mxload.synthetic\n"
                           "print(sorted(m for m in ('grain', 'spdl') if m in sys.modules))", timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_a_peer_not_installed_says_why_and_what_to_install(peers):
    ghost = peers.Peer("ghost", ("no_such_module_mxload_test",), "-", peers.PEERS["mxload"].open)
    assert ghost.missing() == "no_such_module_mxload_test not installed (pip install 'mxload[peers]')"
    assert peers.PEERS["mxload"].missing() == ""


def test_a_failed_measurement_is_a_row_that_says_so(peers):
    args = argparse.Namespace(workloads=["dict16"], workers=[0])
    rows = peers.rows(args, ["mxload", "torch"], {}, {("dict16", "torch", 0): "exit 1: boom"}, {})
    assert rows == [["dict16", "torch", "0", "failed"] + ["-"] * 8]


def test_rows_set_each_peer_against_mxload_and_the_limit(peers):
    args = argparse.Namespace(workloads=["dict16"], workers=[2])
    run = {"ttfb_s": 0.1, "cpu_ms": 1.0, "other_load": 0.0}
    results = {("dict16", "mxload", 2): [{**run, "bps": 90.0}, {**run, "bps": 110.0}],
               ("dict16", "grain", 2): [{**run, "bps": 50.0}]}
    rows = peers.rows(args, ["mxload", "grain"], results, {}, {("dict16", 2): [200.0]})
    assert rows[0][:2] == ["dict16", "limit 2 proc"] and rows[0][4] == "200.0"
    assert rows[1][1:3] == ["mxload", "2"] and rows[1][4:6] == ["100.0", "90.0-110.0"]
    assert rows[1][8] == "0.50"
    assert rows[2][1] == "grain" and rows[2][7] == "2.00x" and rows[2][8] == "0.25"


def test_paired_ratios_are_taken_round_by_round(peers):
    # Round 1 ran on a machine twice as fast as round 2: the medians' ratio mixes the rounds,
    # each round's own ratio does not.
    args = argparse.Namespace(workloads=["jpeg"], workers=[2])
    run = {"ttfb_s": 0.1, "cpu_ms": 1.0, "other_load": 0.0}
    results = {("jpeg", name, 2): [{**run, "bps": bps} for bps in rounds]
               for name, rounds in (("mxload", (100.0, 50.0, 90.0)), ("spdl-threads", (80.0, 40.0, 90.0)))}
    limits = {("jpeg", 2): [100.0, 50.0, 100.0]}
    rows = peers.rows(args, ["mxload", "spdl-threads"], results, {}, limits)
    mx, spdl = rows[1], rows[2]
    assert len(mx) == len(rows[0]) == 12
    assert mx[8] == "0.90" and mx[10] == "-" and mx[11] == "1.00"            # 90/100; rounds 1.0, 1.0, 0.9
    assert spdl[7] == "1.12x" and spdl[10] == "1.25x" and spdl[11] == "0.80"  # 90/80; 1.25, 1.25, 1.0


def test_stack_samples_stacks_field_by_field(peers):
    samples = [(np.full(3, i, np.float32), i) for i in range(4)]
    x, y = peers.stack_samples(samples)
    assert x.shape == (4, 3) and x[2, 0] == 2 and y.tolist() == [0, 1, 2, 3]
    d = peers.stack_samples([{"a": np.zeros(2), "b": {"c": 1}} for _ in range(3)])
    assert d["a"].shape == (3, 2) and d["b"]["c"].tolist() == [1, 1, 1]


def test_one_measurement_in_process(peers, capsys):
    assert peers.child({"loader": "mxload", "workload": "dict16", "workers": 0, "batches": 3,
                        "scale": 0.01}) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("RESULT ")
    got = json.loads(line[len("RESULT "):])
    assert set(got) == {"ttfb_s", "bps", "cpu_ms", "other_load"} and got["bps"] > 0


@pytest.mark.e2e
@pytest.mark.timeout(300)
@pytest.mark.parametrize("workers", [0, 2])
def test_every_installed_peer_measures_in_a_fresh_process(peers, workers):
    """What the bench runs for each configuration: `peers.py --child SPEC`, on a tiny dict16."""
    ran = []
    for name, peer in peers.PEERS.items():
        if peer.missing() or workers < peer.min_workers:
            continue
        spec = {"loader": name, "workload": "dict16", "workers": workers, "batches": 3, "scale": 0.01}
        got = peers.run_child(spec)
        assert not isinstance(got, str), f"{name} with {workers} workers: {got}"
        assert got["bps"] > 0
        ran.append(name)
    assert "mxload" in ran, ran
    print(f"measured: {ran} (python {sys.version_info[:2]})")
