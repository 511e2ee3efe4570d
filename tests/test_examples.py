"""The runnable examples of docs/examples/ run on the CPU and check what they claim (their own byte
checks: an example that finds a wrong byte exits non-zero)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvwrite

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "docs" / "examples"


def _has_transfer_ops() -> bool:
    try:
        return callable(kvwrite.pack_kv_pages)
    except AttributeError:
        return False


SCRIPTS = ["offload_roundtrip.py", "tp_exchange.py", "pd_handoff.py"]
needs_transfer_ops = pytest.mark.skipif(not _has_transfer_ops(), reason="needs the transfer ops")


def _run(script: str, env: dict) -> None:
    env = {**os.environ, **env,
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(EXAMPLES / script)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(script.removesuffix(".py") + ":"), done.stdout


@needs_transfer_ops
@pytest.mark.parametrize("script", SCRIPTS)
def test_example_runs_on_the_cpu(script):
    # No GPU visible: the script takes the torch implementation, both sides on the host.
    _run(script, {"CUDA_VISIBLE_DEVICES": ""})


@pytest.mark.gpu
@needs_transfer_ops
@pytest.mark.parametrize("script", SCRIPTS)
def test_example_runs_on_the_gpu(script):
    # The GPU path: pinned host pool, SM and copy engines (offload), GPU pages and mapping (TP).
    _run(script, {})
