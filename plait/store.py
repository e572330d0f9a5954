"""Rendezvous stores that listen on the loopback address only.

torch's ``TCPStore`` server listens on every interface (``*:port``); nothing in its constructor
names the address to bind. A store is readable and writable by anyone who reaches the port, and
torch's dynamic rendezvous unpickles state kept there, so a single-node job must not expose one
to the network. ``TCPStore`` does accept an already-listening socket (``master_listen_fd``): we
bind that socket to 127.0.0.1 ourselves. With ``multi_tenant=True`` every later
``TCPStore(..., port, is_master=True, multi_tenant=True)`` in the same process (torchrun's c10d
rendezvous, ``init_process_group``'s ``env://`` store on rank 0) reuses this server instead of
opening its own, so torch's code paths run unchanged on top of it.
"""

from __future__ import annotations

import socket
import sys
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.distributed as dist

LOOPBACK = "127.0.0.1"


def loopback_store(port: int = 0, world_size: int | None = None, *,
                   timeout: timedelta = timedelta(seconds=60),
                   multi_tenant: bool = False) -> dist.TCPStore:
    """A master ``TCPStore`` on 127.0.0.1:``port`` (0: a free port the OS picks, no race).

    ``.port`` says which one. Raises ``OSError`` when the port is taken.
    """
    import torch.distributed as dist  # here: `plait run`'s launcher never imports torch

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((LOOPBACK, port))
        sock.listen(1024)
        store = dist.TCPStore(LOOPBACK, sock.getsockname()[1], world_size, is_master=True,
                              timeout=timeout, wait_for_workers=False, multi_tenant=multi_tenant,
                              master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store now owns the descriptor (it does not duplicate it)
    return store


def ephemeral_range() -> tuple[int, int]:
    """The ports the kernel hands out to outgoing connections (Linux's
    ``ip_local_port_range``; elsewhere the IANA range 49152-65535)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 49152, 65535


def unclaimable_port(tries: int = 64) -> int | None:
    """A free port below the ephemeral range (so that no outgoing connection can be given it),
    or None when none of ``tries`` random ones is free.

    A port the OS picks with ``bind(0)`` comes from the ephemeral range, and is only free until
    the socket that found it closes. A launcher that passes such a port on (torchrun's agent
    picks the worker store's port so, then worker rank 0 binds it seconds later, once torch is
    imported) loses it if the kernel gives it meanwhile to an outgoing connection; one is the
    other ranks' own retrying connects to that very port, which the kernel can complete as a
    TCP self-connect. Rank 0 then fails with ``Address already in use``. Outside the range only
    a process that binds the port explicitly can take it."""
    import random

    low, _ = ephemeral_range()
    first = max(1024, low - 16384)
    if low - first < 1024:
        return None
    rng = random.Random()
    for _ in range(tries):
        port = rng.randrange(first, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("", port))
            except OSError:
                continue
        return port
    return None


def loopback_interface() -> str | None:
    """The name of the loopback network interface ("lo" on Linux, "lo0" on macOS), or None.

    For ``GLOO_SOCKET_IFNAME``: torch builds every gloo process group (the default one, and
    those DeviceMesh and ``new_group`` create) with ``ProcessGroupGloo(store, rank, size,
    timeout)``, whose device is the interface that variable names, else the address the host
    name resolves to, often a routable one; ``init_process_group`` ignores ``pg_options`` for
    gloo (torch 2.13), so a launcher of a single-node job names the interface in its workers'
    environment (plait.launch, plait.spawn).
    """
    if sys.platform.startswith("linux"):
        for flags in sorted(Path("/sys/class/net").glob("*/flags")):
            try:
                if int(flags.read_text(), 16) & 0x8:  # IFF_LOOPBACK
                    return flags.parent.name
            except (OSError, ValueError):
                continue
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in ("lo", "lo0") if n in names), None)
