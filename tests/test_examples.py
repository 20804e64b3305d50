"""The examples in examples/ run on a tiny input and do what they say (the e2e tier: CI runs it
against the installed wheel)."""
from __future__ import annotations

import json
import os

import fresh_python
import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def run(name, *args, timeout=200):
    out = fresh_python.run_args(os.path.join(EXAMPLES, name), *args, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_text_pad_pads_and_bucketing_cuts_the_padding():
    text = run("text_pad.py", "--workers", "2")
    shuffled, bucketed = (int(line.rsplit("%", 1)[0].rsplit(None, 1)[1])
                          for line in text.splitlines() if "of the token slots are padding" in line)
    assert bucketed < shuffled


def test_profile_my_dataset_prints_both_reports(tmp_path):
    text = run("profile_my_dataset.py", "--workers", "2", "--batches", "6", "--trace-dir", str(tmp_path))
    assert text.count("verdict:") == 2 and text.count("total ") == 2
    traces = sorted(tmp_path.iterdir())
    assert [p.name for p in traces] == ["fast-loop.json", "slow-loop.json"]
    assert all(json.loads(p.read_text())["traceEvents"] for p in traces)
    assert f"(trace: {traces[0]})" in text


def test_profile_my_dataset_never_writes_a_fixed_temporary_name():
    """Its trace went to <temp>/mxload-example-trace.json: two runs (or two users) overwrote
    each other's, or met another user's file there."""
    import re
    import shutil
    folders = []
    for _ in range(2):
        text = run("profile_my_dataset.py", "--workers", "0", "--batches", "6")
        (fast,) = re.findall(r"\(trace: (.*fast-loop\.json)\)", text)
        folders.append(os.path.dirname(fast))
    try:
        assert folders[0] != folders[1] and all(os.path.isdir(f) for f in folders)
    finally:
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.torch
def test_image_folder_trains_on_a_generated_folder():
    pytest.importorskip("PIL")
    text = run("image_folder.py", "--make-data", "--epochs", "1", "--workers", "2")
    assert "epoch 0: loss" in text and "images/s" in text
