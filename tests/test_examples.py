"""The examples in examples/ run on a tiny input and do what they say (the e2e tier: CI runs it
against the installed wheel)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def run(name, *args, timeout=200):
    out = subprocess.run([sys.executable, os.path.join(EXAMPLES, name), *args], capture_output=True,
                         text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_text_pad_pads_and_bucketing_cuts_the_padding():
    text = run("text_pad.py", "--workers", "2")
    shuffled, bucketed = (int(line.rsplit("%", 1)[0].rsplit(None, 1)[1])
                          for line in text.splitlines() if "of the token slots are padding" in line)
    assert bucketed < shuffled


def test_profile_my_dataset_prints_both_reports():
    text = run("profile_my_dataset.py", "--workers", "2", "--batches", "6")
    assert text.count("verdict:") == 2 and text.count("total ") == 2


def test_image_folder_trains_on_a_generated_folder():
    pytest.importorskip("PIL")
    pytest.importorskip("torch")
    text = run("image_folder.py", "--make-data", "--epochs", "1", "--workers", "2")
    assert "epoch 0: loss" in text and "images/s" in text
