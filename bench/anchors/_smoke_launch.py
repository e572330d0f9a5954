"""The launcher of ``vs_anchors.py --smoke``: every anchor script's job from one process.

Most of a smoke job's time is not training (a few steps of a tiny model) but starting Python and
importing torch and the library, three times per job under torchrun (its agent and two ranks).
Here torch, Accelerate and Lightning are imported once, and each job runs under torchelastic's
``elastic_launch`` (the agent torchrun itself runs) with the ``fork`` start method, so every
rank inherits those imports instead of repeating them. The ranks see the environment torchrun
gives them (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, TORCHELASTIC_RUN_ID, ...) and run the
script as ``__main__``. The parent never computes or joins a process group, so it forks with
no threads of torch's running. Timed runs (``vs_anchors.py`` without ``--smoke``) start each
job with torchrun, as users do.

    python _smoke_launch.py NPROC JOBS.json
    JOBS.json: [{"name": ..., "script": "/abs/path.py", "argv": [...]}, ...]

Prints one JSON line per job: {"name": ..., "ok": bool, "error": str}.
"""

from __future__ import annotations

import json
import runpy
import sys
import uuid
from pathlib import Path

import accelerate  # noqa: F401  imported once here, inherited by every forked rank
import lightning.fabric  # noqa: F401
import torch  # noqa: F401
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

import plait  # noqa: F401

# Each rank's script globals, kept to the end of the forked process, which leaves by os._exit
# without tearing them down: a script that does not destroy its process group (Accelerate's
# does not) would otherwise free it as run_path returns, and gloo's destructor, joining its
# worker threads after the peer has gone, can wait forever.
_KEPT: list[dict] = []


def _rank_main(script: str, argv: list[str]) -> None:
    """One rank: the script as ``__main__``, its folder first on the path (as ``python x.py``)."""
    sys.argv = [script, *argv]
    sys.path.insert(0, str(Path(script).parent))
    _KEPT.append(runpy.run_path(script, run_name="__main__"))


def main(argv: list[str]) -> int:
    nproc, jobs = int(argv[0]), json.loads(Path(argv[1]).read_text())
    failed = 0
    for job in jobs:
        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc,
                              run_id=str(uuid.uuid4()), rdzv_backend="c10d",
                              rdzv_endpoint="localhost:0", max_restarts=0,
                              start_method="fork")
        try:
            elastic_launch(config, _rank_main)(job["script"], job["argv"])
            result = {"name": job["name"], "ok": True, "error": ""}
        except ChildFailedError as err:
            failed += 1
            result = {"name": job["name"], "ok": False, "error": str(err)[-3000:]}
        print(json.dumps(result), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
