"""The examples run end to end (build into kernel_meta/, run, check) in a fresh process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize("script", ["conv3d_backprop_filter.py", "conv3d_backprop_input.py"])
def test_example_runs_and_checks(tmp_path, script):
    """As a user runs it: measured selection on (its record in a private cache folder)."""
    env = dict(os.environ, TBE_LIKE_CACHE_DIR=str(tmp_path / "cache"), TBE_LIKE_MEASURE="1")
    done = subprocess.run([sys.executable, str(EXAMPLES / script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "schedule: measured in" in done.stdout or "schedule: rule" in done.stdout
    assert done.stdout.strip().endswith("OK")
    assert "max abs error" in done.stdout and "kernel time" in done.stdout
    built = sorted(p.suffix for p in (tmp_path / "kernel_meta").iterdir())
    assert built == [".json", ".so"]


@pytest.mark.parametrize("script", ["convolution_backward.py", "deconv_grad_filter.py"])
def test_operator_example_runs_and_caches(tmp_path, script):
    """The framework-operator examples compile into the kernel cache (here a private one)."""
    cache = tmp_path / "cache"
    env = dict(os.environ, TBE_LIKE_CACHE_DIR=str(cache))
    done = subprocess.run([sys.executable, str(EXAMPLES / script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().endswith("OK")
    assert "max abs error" in done.stdout and "kernel time" in done.stdout
    assert sorted(cache.glob("*.so")) and not (tmp_path / "kernel_meta").exists()


def test_training_example_matches_pytorch(tmp_path):
    """examples/train_torch.py: tbe_like.torch.Conv3d trains as torch.nn.Conv3d does."""
    pytest.importorskip("torch")
    env = dict(os.environ, TBE_LIKE_CACHE_DIR=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, str(EXAMPLES / "train_torch.py")], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "the same training" in done.stdout
