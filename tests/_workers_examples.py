"""An example script run as the body of a rank that plait.spawn started: the same script, the
same arguments, the same output, on ranks forked from a server that imported torch once, instead
of `plait run`'s launcher, torchrun's agent and one fresh interpreter per rank (each import of
torch is seconds of CPU). plait.init() joins the process group plait.spawn made."""

import contextlib
import io
import os
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_example(rank, world_size, script, args):
    """Run examples/``script`` with ``args`` as ``__main__``; return what it printed on stdout."""
    os.chdir(ROOT)
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    path = str(ROOT / "examples" / script)
    sys.argv = [path, *args]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as exc:  # an example that ends with sys.exit(0)
            if exc.code not in (0, None):
                raise
    return out.getvalue()
