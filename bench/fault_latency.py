"""How fast a job ends when it must: a signal to `plait run`, and a hung rank.

    PYTHONPATH=. python bench/fault_latency.py [--rounds 2] [--timeouts 5,10]

* signal: `plait run --nproc 2` on a script that all-reduces in a loop; once rank 0 says it is
  up, send SIGTERM (then SIGINT) to `plait run` and time until `plait run` and every process it
  started are gone (Linux: read from /proc).
* watchdog: rank 1 sleeps inside step 3 under `plait.init(timeout=T)`; time from the moment it
  starts sleeping to the end of `plait run` (every rank gone), beside T.
Prints seconds per round and the median; the machine's load average is printed with them, as
every figure here is mostly process start-up and scheduling.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from plait.lifecycle import descendants, running

LOOP = """
import time, torch, torch.distributed as dist, plait
run = plait.init()
run.print("ready")
while True:
    dist.all_reduce(torch.ones(1)); time.sleep(0.05)
"""

HANG = """
import sys, time, torch, torch.nn as nn, plait
from pathlib import Path
run = plait.init(timeout=float(sys.argv[1]), quiet=True)
model = run.parallelize(nn.Linear(8, 8))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
step = 0
def loss_fn(out, y):
    if run.rank == 1 and step == 3:
        Path(sys.argv[2]).write_text(str(time.time())); time.sleep(3600)
    return nn.functional.mse_loss(out, y)
for step in range(1, 6):
    run.step(model, (torch.randn(4, 8), torch.randn(4, 8)), loss_fn, opt)
"""


def _plait(*args: str, cwd: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "plait.cli", *args], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def signal_round(sig: int, folder: str) -> float:
    script = Path(folder) / "loop.py"
    script.write_text(LOOP)
    proc = _plait("run", "--nproc", "2", str(script), cwd=folder)
    ready = threading.Event()

    def read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            if "ready" in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(300):
        proc.kill()
        raise RuntimeError("the job did not start")
    time.sleep(1.0)
    job = [proc.pid, *descendants(proc.pid)]
    sent = time.monotonic()
    os.kill(proc.pid, sig)
    proc.wait(timeout=120)
    while running(job):
        time.sleep(0.02)
    return time.monotonic() - sent


def hang_round(timeout: float, folder: str) -> float:
    script, stamp = Path(folder) / "hang.py", Path(folder) / "slept_at"
    script.write_text(HANG)
    stamp.unlink(missing_ok=True)
    proc = _plait("run", "--nproc", "2", str(script), str(timeout), str(stamp), cwd=folder)
    proc.communicate(timeout=timeout + 600)
    if proc.returncode == 0 or not stamp.exists():
        raise RuntimeError(f"the watchdog did not end the job (exit {proc.returncode})")
    return time.time() - float(stamp.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--timeouts", default="5,10", help="watchdog timeouts to try (s)")
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory() as folder:
        for sig in (signal.SIGTERM, signal.SIGINT):
            times = [signal_round(sig, folder) for _ in range(args.rounds)]
            print(f"{signal.Signals(sig).name:7s} -> every process gone: "
                  + ", ".join(f"{t:.2f}" for t in times)
                  + f" s (median {statistics.median(times):.2f} s)")
        for timeout in (float(t) for t in args.timeouts.split(",")):
            times = [hang_round(timeout, folder) for _ in range(args.rounds)]
            med = statistics.median(times)
            print(f"watchdog timeout {timeout:g} s -> job ended after the stall: "
                  + ", ".join(f"{t:.2f}" for t in times)
                  + f" s (median {med:.2f} s = timeout + {med - timeout:.2f} s)")
    print(f"load average at end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
