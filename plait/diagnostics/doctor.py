"""`plait doctor`: the checks that explain most failed starts, each with its fix.

Per area: ``xla`` (torch vs torch-xla, PJRT_DEVICE), ``tpu`` (torch vs torch-tpu, libtpu,
tcmalloc, a TPU held by another process), ``cuda`` (NCCL peer-to-peer between consumer GPUs) and
``launch`` (InfiniBand across nodes, the master address and port, the gloo interface on one
node, the world-size variables).

Every check returns pass, warn, fail or skip (not relevant here), what it saw, and what to do.
The checks read the environment, package metadata, ``/proc``, ``/dev`` and ``/sys``; none of
them imports torch_xla or torch_tpu (importing starts their runtimes and, on a TPU, claims the
chips) or starts a process group.
"""

from __future__ import annotations

import glob
import json
import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass

from ..accelerators.base import module_present
from ..accelerators.versions import installed_version, stack_mismatch

STATUSES = ("pass", "warn", "fail", "skip")


@dataclass(frozen=True)
class Check:
    name: str
    area: str       # "xla", "tpu", "cuda", "launch"
    status: str     # one of STATUSES
    detail: str
    fix: str = ""


# ------------------------------------------------------------------------------ the stacks
def check_versions(module: str) -> Check:
    area = "xla" if module == "torch_xla" else "tpu"
    dist = {"torch_xla": "torch-xla", "torch_tpu": "torch-tpu"}[module]
    version = installed_version(dist)
    if version is None:
        return Check(f"torch vs {dist}", area, "skip", f"{dist} is not installed")
    problem = stack_mismatch(module)
    if problem:
        fix = problem.split("; ", 1)[1] if "; " in problem else ""
        return Check(f"torch vs {dist}", area, "fail", problem.split("; ", 1)[0], fix)
    return Check(f"torch vs {dist}", area, "pass",
                 f"{dist} {version} matches torch {installed_version('torch')}")


def check_pjrt_device(env: Mapping[str, str]) -> Check:
    if not module_present("torch_xla"):
        return Check("PJRT_DEVICE", "xla", "skip", "torch_xla is not installed")
    value = env.get("PJRT_DEVICE")
    want = "TPU" if tpu_device_files() else "CPU"
    if value is None:
        return Check("PJRT_DEVICE", "xla", "warn", "unset: torch_xla picks a device by itself "
                     "and says so in a warning", f"export PJRT_DEVICE={want}")
    if value.upper() not in ("TPU", "CPU", "CUDA"):
        return Check("PJRT_DEVICE", "xla", "fail", f"PJRT_DEVICE={value!r} is not TPU, CPU or "
                     f"CUDA", f"export PJRT_DEVICE={want}")
    if value.upper() == "TPU" and not tpu_device_files():
        return Check("PJRT_DEVICE", "xla", "fail", "PJRT_DEVICE=TPU but this machine has no "
                     "TPU device files (/dev/accel*, /dev/vfio/*)",
                     "run on a TPU VM, or export PJRT_DEVICE=CPU for the XLA CPU device")
    return Check("PJRT_DEVICE", "xla", "pass", f"PJRT_DEVICE={value}")


def tpu_device_files() -> list[str]:
    """The TPU chips' device files: /dev/accel* (v2-v4, v5p) or /dev/vfio/N (v5e and later)."""
    return sorted(glob.glob("/dev/accel*") + glob.glob("/dev/vfio/[0-9]*"))


def holders(paths: list[str], proc: str = "/proc") -> dict[int, str]:
    """{pid: command line} of the processes (other than this one) with one of ``paths`` open."""
    wanted = {os.path.realpath(p) for p in paths}
    found: dict[int, str] = {}
    for fd_dir in glob.glob(os.path.join(proc, "[0-9]*", "fd")):
        pid = int(fd_dir.split(os.sep)[-2])
        if pid == os.getpid():
            continue
        try:
            targets = {os.path.realpath(os.path.join(fd_dir, fd)) for fd in os.listdir(fd_dir)}
        except OSError:  # gone, or not ours to read
            continue
        if targets & wanted:
            try:
                with open(os.path.join(proc, str(pid), "cmdline"), "rb") as f:
                    found[pid] = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                found[pid] = "?"
    return found


def check_tpu_free() -> Check:
    files = tpu_device_files()
    if not files:
        return Check("TPU not held by another process", "tpu", "skip", "no TPU device files")
    held = holders(files)
    if held:
        who = "; ".join(f"pid {pid}: {cmd[:80]}" for pid, cmd in sorted(held.items()))
        pids = " ".join(str(p) for p in sorted(held))
        return Check("TPU not held by another process", "tpu", "fail",
                     f"the TPU is open in another process ({who}); a second runtime cannot "
                     f"claim it", f"stop it if it is stale: kill {pids}")
    return Check("TPU not held by another process", "tpu", "pass",
                 f"{len(files)} TPU device file(s), none open elsewhere")


def check_libtpu(env: Mapping[str, str]) -> Check:
    needed = bool(tpu_device_files()) or env.get("PJRT_DEVICE", "").upper() == "TPU"
    stacks = [m for m in ("torch_xla", "torch_tpu") if module_present(m)]
    if not stacks:
        return Check("libtpu", "tpu", "skip", "neither torch_xla nor torch_tpu is installed")
    if module_present("libtpu"):
        return Check("libtpu", "tpu", "pass", f"libtpu {installed_version('libtpu') or ''} "
                     f"installed".replace("  ", " "))
    if needed:
        return Check("libtpu", "tpu", "fail", "libtpu is not installed: the TPU runtime cannot "
                     "start", "pip install 'torch-xla[tpu]' (PyTorch/XLA) or torch-tpu, which "
                     "pulls libtpu")
    return Check("libtpu", "tpu", "pass", "not installed, not needed (no TPU here)")


def check_tcmalloc(env: Mapping[str, str], maps: str = "/proc/self/maps") -> Check:
    if not module_present("torch_tpu"):
        return Check("tcmalloc for TorchTPU", "tpu", "skip", "torch_tpu is not installed")
    try:
        with open(maps) as f:
            loaded = "tcmalloc" in f.read()
    except OSError:
        loaded = False
    if loaded or "tcmalloc" in env.get("LD_PRELOAD", ""):
        return Check("tcmalloc for TorchTPU", "tpu", "pass", "tcmalloc is preloaded")
    return Check("tcmalloc for TorchTPU", "tpu", "warn", "tcmalloc is not preloaded: TorchTPU "
                 "warns at import and its host side runs slower on glibc malloc",
                 "apt-get install libtcmalloc-minimal4 and export "
                 "LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")


# ------------------------------------------------------------------------------ GPUs
CONSUMER_GPUS = ("geforce", "rtx 40", "rtx 30", "rtx 50", "titan")


def check_nccl_p2p(env: Mapping[str, str]) -> Check:
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return Check("NCCL peer-to-peer", "cuda", "skip", "fewer than 2 CUDA GPUs")
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    consumer = any(c in n.lower() for n in names for c in CONSUMER_GPUS)
    p2p = torch.cuda.can_device_access_peer(0, 1)
    if not p2p and env.get("NCCL_P2P_DISABLE") != "1":
        return Check("NCCL peer-to-peer", "cuda", "warn" if not consumer else "fail",
                     f"{names[0]} x {len(names)}: no peer-to-peer access between GPU 0 and 1; "
                     f"NCCL may hang or corrupt data trying it", "export NCCL_P2P_DISABLE=1")
    return Check("NCCL peer-to-peer", "cuda", "pass",
                 f"{names[0]} x {len(names)}: P2P {'on' if p2p else 'off (NCCL_P2P_DISABLE=1)'}")


# ------------------------------------------------------------------------------ launching
def _nnodes(env: Mapping[str, str]) -> int:
    for key in ("NNODES", "PET_NNODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"):
        value = env.get(key, "")
        if value.isdigit():
            return int(value)
    hosts = [h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]
    return max(1, len(hosts))


def check_infiniband(env: Mapping[str, str], sys_dir: str = "/sys/class/infiniband") -> Check:
    nodes = _nnodes(env)
    if nodes <= 1:
        return Check("InfiniBand for multi-node", "launch", "skip", "single node")
    devices = sorted(os.listdir(sys_dir)) if os.path.isdir(sys_dir) else []
    if devices:
        return Check("InfiniBand for multi-node", "launch", "pass", f"{', '.join(devices)}")
    return Check("InfiniBand for multi-node", "launch", "warn",
                 f"{nodes} nodes and no InfiniBand device: inter-node collectives go over "
                 f"TCP sockets", "expect lower bandwidth; set NCCL_SOCKET_IFNAME to the fastest "
                 "interface (TPU pods use their own interconnect: ignore this there)")


def check_master(env: Mapping[str, str], timeout: float = 2.0) -> Check:
    addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    if not addr:
        return Check("master address and port", "launch", "skip",
                     "MASTER_ADDR unset (plait run picks 127.0.0.1 and a free port)")
    if not port or not port.isdigit() or not 0 < int(port) < 65536:
        return Check("master address and port", "launch", "fail",
                     f"MASTER_PORT={port!r} is not a port number", "export MASTER_PORT=29500")
    try:
        ip = str(socket.getaddrinfo(addr, int(port), proto=socket.IPPROTO_TCP)[0][4][0])
    except (socket.gaierror, UnicodeError) as exc:
        return Check("master address and port", "launch", "fail",
                     f"MASTER_ADDR={addr!r} does not resolve ({exc})",
                     "use the first node's IP address or a hostname every node resolves")
    local = ip.startswith("127.") or ip == "::1" or ip in _local_addresses()
    with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET) as s:
        s.settimeout(timeout)
        code = s.connect_ex((ip, int(port)))
    if local and code == 0 and env.get("RANK", "0") == "0":
        return Check("master address and port", "launch", "fail",
                     f"{addr}:{port} is already in use on this machine: rank 0 cannot listen",
                     "pick a free MASTER_PORT, or stop the process holding it")
    if not local and code not in (0, 111):  # 111: refused, i.e. reachable, not listening yet
        return Check("master address and port", "launch", "fail",
                     f"cannot reach {addr}:{port} ({os.strerror(code)})",
                     "check the address, and that a firewall lets the port through")
    return Check("master address and port", "launch", "pass",
                 f"{addr} ({ip}):{port} {'is free here' if local else 'is reachable'}")


def _local_addresses() -> set[str]:
    try:
        return {str(a[4][0]) for a in socket.getaddrinfo(socket.gethostname(), None)}
    except socket.gaierror:
        return set()


def check_gloo_interface(env: Mapping[str, str]) -> Check:
    if _nnodes(env) > 1:
        return Check("gloo interface on one node", "launch", "skip", "multi-node job")
    if env.get("GLOO_SOCKET_IFNAME"):
        return Check("gloo interface on one node", "launch", "pass",
                     f"GLOO_SOCKET_IFNAME={env['GLOO_SOCKET_IFNAME']}")
    try:
        ip = socket.gethostbyname(socket.gethostname())
    except OSError as exc:
        return Check("gloo interface on one node", "launch", "warn",
                     f"the hostname does not resolve ({exc}): gloo cannot pick an address",
                     "export GLOO_SOCKET_IFNAME=lo")
    if not ip.startswith("127."):
        return Check("gloo interface on one node", "launch", "warn",
                     f"gloo binds to the hostname's address {ip}, not loopback: a firewall or "
                     f"a stale DNS entry there hangs a one-node job at its first collective",
                     "plait run sets GLOO_SOCKET_IFNAME=lo for a one-node job; under torchrun, "
                     "export GLOO_SOCKET_IFNAME=lo")
    return Check("gloo interface on one node", "launch", "pass", f"hostname resolves to {ip}")


def check_world_size(env: Mapping[str, str]) -> Check:
    def num(key: str) -> int | None:
        value = env.get(key, "")
        return int(value) if value.isdigit() else None

    world, rank = num("WORLD_SIZE"), num("RANK")
    local_world, local_rank = num("LOCAL_WORLD_SIZE"), num("LOCAL_RANK")
    problems = []
    if world is not None and rank is not None and rank >= world:
        problems.append(f"RANK={rank} >= WORLD_SIZE={world}")
    if local_world is not None and local_rank is not None and local_rank >= local_world:
        problems.append(f"LOCAL_RANK={local_rank} >= LOCAL_WORLD_SIZE={local_world}")
    if world is not None and local_world and world % local_world:
        problems.append(f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE="
                        f"{local_world}")
    tasks = num("SLURM_NTASKS")
    if world is not None and tasks is not None and tasks != world and tasks != _nnodes(env):
        problems.append(f"SLURM_NTASKS={tasks} is neither WORLD_SIZE={world} nor the node "
                        f"count")
    if world is None and rank is None and local_world is None:
        return Check("world-size variables", "launch", "skip", "not under a launcher")
    if problems:
        return Check("world-size variables", "launch", "fail", "; ".join(problems),
                     "launch with plait run (or torchrun), which sets them together; unset "
                     "stale ones left in the shell")
    return Check("world-size variables", "launch", "pass",
                 f"WORLD_SIZE={world}, RANK={rank}, LOCAL_WORLD_SIZE={local_world}")


# ------------------------------------------------------------------------------ all of it
CHECKS: tuple[Callable[[Mapping[str, str]], Check], ...] = (
    lambda env: check_versions("torch_xla"),
    check_pjrt_device,
    lambda env: check_versions("torch_tpu"),
    check_libtpu,
    check_tcmalloc,
    lambda env: check_tpu_free(),
    check_nccl_p2p,
    check_infiniband,
    check_master,
    check_gloo_interface,
    check_world_size,
)


def run_checks(env: Mapping[str, str] | None = None) -> list[Check]:
    env = dict(os.environ) if env is None else env
    return [check(env) for check in CHECKS]


def advice(area: str, env: Mapping[str, str] | None = None) -> str:
    """The first failing or warning check of ``area`` as "detail: fix" (for error messages)."""
    for check in run_checks(env):
        if check.area == area and check.status in ("fail", "warn"):
            return f"{check.detail}: {check.fix}" if check.fix else check.detail
    return ""


def to_json(checks: list[Check]) -> str:
    counts = {s: sum(c.status == s for c in checks) for s in STATUSES}
    return json.dumps({"checks": [asdict(c) for c in checks], "summary": counts}, indent=2)


def format_text(checks: list[Check]) -> str:
    counts = {s: sum(c.status == s for c in checks) for s in STATUSES}
    lines = [f"plait doctor: {counts['pass']} pass, {counts['warn']} warn, {counts['fail']} fail"
             f" ({counts['skip']} not relevant here)"]
    width = max(len(c.name) for c in checks)
    for c in checks:
        if c.status == "skip":
            continue
        lines.append(f"[{c.status.upper():<4}] {c.area:<6} {c.name:<{width}}  {c.detail}")
        if c.fix:
            lines.append(f"{'':14}{'':<{width}}  fix: {c.fix}")
    skipped = [f"{c.name} ({c.detail})" for c in checks if c.status == "skip"]
    if skipped:
        lines.append("skipped: " + "; ".join(skipped))
    return "\n".join(lines)


def command(args) -> int:
    checks = run_checks()
    print(to_json(checks) if args.format == "json" else format_text(checks))
    return 1 if any(c.status == "fail" for c in checks) else 0
