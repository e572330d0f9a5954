"""The torchrun process that ``plait run`` starts: torchrun's own ``main``, plus what it lacks.

``python -m plait.torchrun PARENT_PID REPORT.json [torchrun arguments]`` runs
``torch.distributed.run.main`` in this process, and around it:

* **It dies with its parent.** If ``plait run`` is killed (even with SIGKILL), the kernel sends
  this process SIGTERM (Linux ``PR_SET_PDEATHSIG``), on which torchrun stops its workers.
  torchrun itself never notices that its launcher went away.
* **The standalone rendezvous store listens on 127.0.0.1 only.** For
  ``--rdzv-endpoint=127.0.0.1:0`` the store is bound here, on a port the OS picks (no race for a
  port picked earlier), and torchrun's c10d rendezvous reuses it (``plait.store``); torchrun's
  own store listens on every interface.
* **A fresh worker store per restart.** torchrun (2.13) shares one TCPStore with its workers
  and keeps it across restarts, but workers do not prefix their keys by attempt, so after a
  restart the new ranks read the dead ranks' gloo addresses and fail with ``Gloo
  connectFullMesh failed ... Connection refused``. With ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
  each attempt gets its own store (on a new port), hosted by worker rank 0.
* **Failures as data.** When workers fail, torchrun raises ``ChildFailedError`` with every
  failed rank, exit code and error file; this writes them to REPORT.json (``plait run`` names
  the ranks from it, traceback or not) and exits 1 without torchrun's own 40-line report.
  A signal ends it quietly with 128 + the signal number, after torchrun has stopped the workers.
"""

from __future__ import annotations

import json
import os
import signal
import sys

from .lifecycle import die_with_parent
from .store import LOOPBACK, loopback_store, unclaimable_port


def _bind_standalone_store(argv: list[str]) -> tuple[list[str], object | None]:
    """Host the rendezvous store for ``--rdzv-endpoint=127.0.0.1:0`` on loopback."""
    flag = f"--rdzv-endpoint={LOOPBACK}:0"
    if flag not in argv:
        return argv, None
    store = loopback_store(0, multi_tenant=True)
    return [f"--rdzv-endpoint={LOOPBACK}:{store.port}" if a == flag else a for a in argv], store


def _worker_store_port_below_ephemeral() -> None:
    """Have torchrun's agent give worker rank 0 a store port below the ephemeral range.

    With its store not shared, the agent takes the workers' MASTER_PORT from
    ``get_free_port`` (a ``bind(0)`` port, released at once) and worker rank 0 binds it once it
    has imported torch; meanwhile the kernel may give that port to an outgoing connection,
    among them the other ranks' retrying connects to it (a TCP self-connect), and rank 0 fails
    with ``Address already in use``. torch takes no port for this but a static rendezvous's,
    so this process (torchrun's, nothing else runs in it) replaces the name that rendezvous
    module looks up (``plait.store.unclaimable_port``)."""
    from torch.distributed.elastic.rendezvous import api as rendezvous_api

    free_port = rendezvous_api.get_free_port

    def port() -> int:
        return unclaimable_port() or free_port()

    rendezvous_api.get_free_port = port


def failure_records(err: BaseException) -> list[dict]:
    """Rank, exit code (or signal) and error file of each failed worker of a ChildFailedError."""
    out = []
    for rank, failure in sorted(getattr(err, "failures", {}).items()):
        code = failure.exitcode
        record = {"rank": int(rank), "local_rank": failure.local_rank, "exitcode": code,
                  "pid": failure.pid, "error_file": failure.error_file}
        if code is not None and code < 0:
            try:
                record["signal"] = signal.Signals(-code).name
            except ValueError:
                pass
        out.append(record)
    return out


def main(argv: list[str]) -> int:
    parent, report, args = int(argv[0]), argv[1], argv[2:]
    die_with_parent(parent)
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    _worker_store_port_below_ephemeral()
    args, store = _bind_standalone_store(args)
    try:
        torchrun.run(torchrun.parse_args(args))
    except ChildFailedError as err:
        with open(report, "w") as f:
            json.dump(failure_records(err), f)
        return 1
    except SignalException as err:
        return 128 + int(err.sigval)
    except Exception as err:  # noqa: BLE001 - rendezvous timeout, bad endpoint...: one line
        with open(report, "w") as f:
            json.dump({"launcher_error": f"{type(err).__name__}: {err}".strip()}, f)
        return 1
    finally:
        del store
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
