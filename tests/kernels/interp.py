"""Running Triton kernels that call Triton's library functions (``tl.min``, ``tl.sum``, ...) in the interpreter.

Those library functions are ``@triton.jit`` functions themselves; the interpreter can call them only when
``TRITON_INTERPRET=1`` was set before ``triton`` was imported (then every ``@triton.jit`` is interpreted). The
block-copy kernels use none and run interpreted in-process; the sparse-attention kernels do, so their Triton cases
run in a child pytest with ``TRITON_INTERPRET=1`` (:func:`run_interpreted`), and are skipped in a parent without it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
REPO = Path(__file__).resolve().parents[2]

needs_interpreter = pytest.mark.skipif(
    not INTERPRETED, reason="Triton cases run in the TRITON_INTERPRET=1 child of test_triton_cases_interpreted"
)


def run_interpreted(test_file: str, select: str) -> None:
    """Run ``test_file``'s tests matching ``-k select`` in a child pytest with ``TRITON_INTERPRET=1``; fail with
    its output unless all of them pass (and at least one ran)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file, "-k", select],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and " skipped" not in proc.stdout.splitlines()[-1], proc.stdout[-2000:]
