"""Run a two-line training script with command-line arguments and read its one-line error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = "import plait\nplait.init()\nprint('STARTED')\n"


def refused(tmp_path: Path, args: list[str], env: dict | None = None,
            timeout: float = 300) -> str:
    """The ``plait: error:`` line of a script that plait refused: exit status 2, one error line,
    nothing started, no traceback (asserted here)."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script), *args], env=env, capture_output=True,
                          text=True, timeout=timeout)
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("plait: error:")]
    assert proc.returncode == 2 and "STARTED" not in proc.stdout, proc.stderr[-2000:]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    return errors[0]
