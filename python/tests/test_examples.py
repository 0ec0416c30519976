"""The example trainer runs on the CPU, its three trainers agreeing."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from conftest import CHECKOUT


@pytest.mark.parametrize("extra", [
    [], ["--checkpoint"],
    ["--clip", "0.5", "--lr-schedule", "warmup-cosine", "--warmup-steps", "2", "--lr", "1e-2"],
    ["--param-storage", "master"], ["--compile"],
])
def test_train_script_runs_on_the_cpu_and_its_trainers_agree(extra):
    """train.py's three trainers (this package, plain PyTorch, FSDP2 on gloo), small, bf16."""
    small = ["--device", "cpu", "--steps", "4", "--warmup", "1", "--vocab", "128", "--dim", "32",
             "--heads", "2", "--layers", "2", "--seq", "16", "--batch", "2", *extra]
    run = subprocess.run([sys.executable, str(CHECKOUT / "examples" / "torch" / "train.py"),
                          *small], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    found = re.findall(r"(\S+): mean step .* plain PyTorch (\S+)", run.stdout)
    assert [name for name, _ in found] == ["fsdp-fusion", "PyTorch", "FSDP2"], run.stdout
    worst = max(float(difference) for _, difference in found)
    assert worst <= 1e-3, run.stdout
    if "--clip" in extra:
        norms = re.findall(r"max relative gradient-norm difference vs plain PyTorch (\S+)",
                           run.stdout)
        assert len(norms) == 3 and max(map(float, norms)) <= 1e-2, run.stdout
