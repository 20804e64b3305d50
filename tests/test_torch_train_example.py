"""examples/torch_train.py is a typical PyTorch training script with one
mxload line, the DataLoader import: it trains, and with that line swapped
back to torch's import it runs the same way (nothing else needed changing)."""
from __future__ import annotations

import os

import fresh_python
import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "torch_train.py")
MXLOAD_IMPORT = "from mxload.torch import DataLoader"
TORCH_IMPORT = "from torch.utils.data import DataLoader"


def _train(path):
    out = fresh_python.run_args(path, "--epochs", "2", "--workers", "2", "--samples", "1024", timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    accuracy = [float(line.rsplit(None, 1)[1]) for line in out.stdout.splitlines() if "accuracy" in line]
    assert len(accuracy) == 2, out.stdout
    return accuracy


@pytest.mark.torch
def test_torch_training_script_runs_with_only_the_import_changed(tmp_path):
    source = open(SCRIPT).read()
    code = source.split('"""', 2)[2]   # after the module docstring
    mxload_lines = [line for line in code.splitlines() if "mxload" in line and not line.startswith("#")]
    assert mxload_lines == [MXLOAD_IMPORT], mxload_lines
    assert _train(SCRIPT)[-1] > 0.9
    torch_version = tmp_path / "torch_train.py"
    torch_version.write_text(source.replace(MXLOAD_IMPORT, TORCH_IMPORT))
    assert _train(str(torch_version))[-1] > 0.9
