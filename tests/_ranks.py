"""Processes of a job, seen from outside: start a script's ranks as plain processes (torchrun's
variables set by hand) and see how each one ends, its own exit code and time, with no launcher
stopping the others for it (torchrun and plait.spawn end the survivors once one rank fails);
the TCP sockets processes listen on."""

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Ended:
    rank: int
    code: int | None   # None: still running at the deadline (then killed)
    at: float          # time.time() when it was seen gone
    stderr: str


def free_port() -> int:
    """A port rank 0 binds later: below the ephemeral range where one is free
    (``plait.store.unclaimable_port``: no outgoing connection can be given it meanwhile)."""
    from plait.store import unclaimable_port

    port = unclaimable_port()
    if port is not None:
        return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(script: Path, *args: str, world: int = 2, timeout: float = 120.0) -> list[Ended]:
    """Run ``script`` on ``world`` ranks of one single-node job (rank 0 hosts the store on
    127.0.0.1, as under `plait run`); every rank still alive after ``timeout`` is killed."""
    base = {**os.environ, "PYTHONPATH": str(ROOT), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world), "TORCHELASTIC_RUN_ID": "test",
            "TORCHELASTIC_USE_AGENT_STORE": "False"}
    procs = [subprocess.Popen([sys.executable, str(script), *args], cwd=script.parent,
                              env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    ended: dict[int, float] = {}
    deadline = time.monotonic() + timeout
    while len(ended) < world and time.monotonic() < deadline:
        for r, p in enumerate(procs):
            if r not in ended and p.poll() is not None:
                ended[r] = time.time()
        time.sleep(0.05)
    out = []
    for r, p in enumerate(procs):
        if r not in ended:
            p.kill()
        _, err = p.communicate()
        out.append(Ended(r, p.returncode if r in ended else None, ended.get(r, time.time()),
                         err))
    return out


def listening(pids) -> dict[int, str]:
    """{port: local address} of the TCP sockets the given processes listen on (from /proc)."""
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").glob("*"):
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    out = {}
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            addr, port = fields[1].split(":")
            if width == 8:
                host = ".".join(str(int(addr[i:i + 2], 16)) for i in (6, 4, 2, 0))
            else:
                host = "::" if int(addr, 16) == 0 else addr
            out[int(port, 16)] = host
    return out


def routable_interface() -> str | None:
    """A network interface with an IPv4 address outside 127.0.0.0/8 (Linux), or None."""
    import fcntl
    import socket
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:  # SIOCGIFADDR
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
            except OSError:
                continue
            if not socket.inet_ntoa(packed[20:24]).startswith("127."):
                return name
    return None
