"""Detect how this process was launched (torchrun, mpirun, srun, ...).

Pure standard library on purpose: it must be importable (and testable) without
torch, CUDA or MPI.  ``fusedist.init`` calls :func:`detect_launch_env` once and
uses the result to bootstrap its process group.

Detection order (the first match wins):

1. ``explicit`` -- ``rank=`` and ``world_size=`` keyword arguments.
2. ``torchrun`` -- ``RANK`` / ``WORLD_SIZE`` (or the torchrun markers
   ``TORCHELASTIC_RUN_ID`` / ``GROUP_RANK``).  Also covers hand-set
   ``RANK=.. WORLD_SIZE=.. MASTER_ADDR=..`` environments.
3. ``openmpi`` -- ``OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}``.
4. ``mpich``   -- ``PMI_RANK`` / ``PMI_SIZE`` / ``MPI_LOCALRANKID`` /
   ``MPI_LOCALNRANKS`` (MPICH Hydra, Intel MPI).
5. ``slurm``   -- ``SLURM_PROCID`` / ``SLURM_NTASKS`` / ``SLURM_LOCALID`` (srun).
6. ``single``  -- nothing found: rank 0 of 1.

So ``mpirun`` or ``torchrun`` inside a SLURM allocation are reported as
``openmpi``/``mpich``/``torchrun``, not ``slurm``.  Only ``SLURM_PROCID``
triggers SLURM detection: a plain ``python`` in an ``salloc`` shell is
``single``.  (An sbatch batch script itself has ``SLURM_PROCID=0``; start ranks
with ``srun`` there.)

``local_rank``, ``local_world_size``, ``master_addr``, ``master_port`` and
``node_id`` keyword arguments override the detected values for every launcher.

``node_id`` identifies the node a rank runs on (ranks with equal ``node_id``
are treated as sharing a host).  Priority: ``node_id=`` keyword, then the
``FUSEDIST_NODE_ID`` environment variable (e.g. to emulate several nodes on
one host), then ``SLURM_NODEID`` for ``slurm``, else ``socket.gethostname()``
(torchrun, MPI, explicit, single).

``master_addr``/``master_port``: taken from ``MASTER_ADDR``/``MASTER_PORT``.
For ``slurm`` the address defaults to the first host of the step's node list
(``SLURM_STEP_NODELIST``, else ``SLURM_JOB_NODELIST``/``SLURM_NODELIST``) and
the port to ``29500 + SLURM_JOB_ID % 1000``.  For MPI launchers the address
stays ``None`` when ``MASTER_ADDR`` is unset (the runtime bootstraps through
MPI).  Whenever an address is known but no port, the port is 29500.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from typing import Mapping

from .. import envs

__all__ = ["LaunchEnv", "LaunchEnvError", "detect_launch_env", "expand_slurm_nodelist",
           "host_address"]

DEFAULT_MASTER_PORT = 29500
_PREFIX = "fusedist.init: "
_FIX_HINT = "or pass rank=/world_size= to fusedist.init"


class LaunchEnvError(ValueError):
    """Launch environment is incomplete or inconsistent (message starts with 'fusedist.init: ')."""

    def __init__(self, message: str):
        if not message.startswith(_PREFIX):
            message = _PREFIX + message
        super().__init__(message)


@dataclass(frozen=True)
class LaunchEnv:
    launcher: str  # "torchrun" | "openmpi" | "mpich" | "slurm" | "explicit" | "single"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_id: str
    master_addr: str | None
    master_port: int | None


# --------------------------------------------------------------------------- helpers

_INT_RE = re.compile(r"^[+-]?\d+$")


def _kv(name: str, value) -> str:
    """``RANK=3`` for env variables, ``rank=3`` for keyword arguments (named ``"rank="``)."""
    return f"{name}{value}" if name.endswith("=") else f"{name}={value}"


def _parse_int(value, name: str) -> int:
    """Parse ``value`` (env string or kwarg) as a non-negative int; ``name`` goes in errors."""
    if isinstance(value, bool):
        raise LaunchEnvError(f"{name} must be an integer, got {value!r}")
    if isinstance(value, int):
        n = value
    else:
        s = str(value).strip()
        if not _INT_RE.match(s):
            raise LaunchEnvError(f"{name} must be an integer, got {value!r}")
        n = int(s)
    if n < 0:
        raise LaunchEnvError(f"{_kv(name, n)} must be >= 0")
    return n


def _env_str(env: Mapping[str, str], name: str) -> str | None:
    """String variable; unset or blank -> None."""
    v = env.get(name)
    if v is None or not v.strip():
        return None
    return v.strip()


def _require(env: Mapping[str, str], names, what: str, fix: str, markers=()) -> None:
    """Raise naming the missing variables when a launcher is only partially present."""
    missing = [n for n in names if n not in env]
    if missing:
        present = [n for n in (*names, *markers) if n in env and n not in missing]
        raise LaunchEnvError(
            f"incomplete {what} environment: {', '.join(dict.fromkeys(present))} set but "
            f"{', '.join(missing)} missing. Set {' and '.join(missing)} or {fix}, {_FIX_HINT}."
        )


def _first(env: Mapping[str, str], names) -> tuple[str | None, str | None]:
    """(name, value) of the first variable in ``names`` present in ``env``."""
    for n in names:
        if n in env:
            return n, env[n]
    return None, None


# ------------------------------------------------------------------ SLURM node lists

_BRACKET_RE = re.compile(r"\[([^\[\]]*)\]")


def _split_top_level(s: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in s:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise LaunchEnvError(f"malformed SLURM node list {s!r}: unbalanced ']'")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth != 0:
        raise LaunchEnvError(f"malformed SLURM node list {s!r}: unbalanced '['")
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def _expand_range_list(body: str, whole: str) -> list[str]:
    out: list[str] = []
    for item in body.split(","):
        item = item.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
        if not m:
            raise LaunchEnvError(f"malformed SLURM node list {whole!r}: bad range {item!r}")
        lo_s, hi_s = m.group(1), m.group(2)
        if hi_s is None:
            out.append(lo_s)
            continue
        lo, hi = int(lo_s), int(hi_s)
        if hi < lo:
            raise LaunchEnvError(f"malformed SLURM node list {whole!r}: range {item!r} is decreasing")
        width = len(lo_s)  # Slurm pads to the width of the first number ("008-010")
        out.extend(str(i).zfill(width) for i in range(lo, hi + 1))
    return out


def expand_slurm_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm hostlist: ``"gpu[01-03,07],login1"`` -> ``gpu01 gpu02 gpu03 gpu07 login1``.

    Keeps zero padding; several bracket groups in one name expand as a
    cartesian product (``"a[1-2]b[3-4]"`` -> ``a1b3 a1b4 a2b3 a2b4``).
    """
    hosts: list[str] = []
    for token in _split_top_level(nodelist.strip()):
        expansions = [""]
        pos = 0
        for m in _BRACKET_RE.finditer(token):
            literal = token[pos:m.start()]
            choices = _expand_range_list(m.group(1), nodelist)
            expansions = [e + literal + c for e in expansions for c in choices]
            pos = m.end()
        tail = token[pos:]
        if "[" in tail or "]" in tail:
            raise LaunchEnvError(f"malformed SLURM node list {nodelist!r}")
        hosts.extend(e + tail for e in expansions)
    return hosts


def _parse_tasks_per_node(value: str, name: str) -> list[int]:
    """``"4(x2),3"`` -> ``[4, 4, 3]``."""
    counts: list[int] = []
    for item in value.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:\(x(\d+)\))?\s*", item)
        if not m:
            raise LaunchEnvError(f"{name} must look like '4' or '4(x2),3', got {value!r}")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts


# ------------------------------------------------------------------ per-launcher

_TORCHRUN_MARKERS = ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "GROUP_RANK")
_TORCHRUN_LOCAL = ("LOCAL_RANK", "LOCAL_WORLD_SIZE")
_OMPI_VARS = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
              "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE")
_MPICH_VARS = ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
_SLURM_MARKERS = ("SLURM_PROCID", "SLURM_LOCALID")


def _is_srun_pmi(env) -> bool:
    """srun --mpi=pmi2 sets PMI_RANK/PMI_SIZE but not Hydra's local ids: that is SLURM, not MPICH."""
    return "SLURM_PROCID" in env and not any(n in env for n in ("MPI_LOCALRANKID", "MPI_LOCALNRANKS"))


def _master_from_env(env: Mapping[str, str]) -> tuple[str | None, int | None]:
    addr = _env_str(env, "MASTER_ADDR")
    port_s = _env_str(env, "MASTER_PORT")
    port = _parse_int(port_s, "MASTER_PORT") if port_s is not None else None
    return addr, port


def _detect_torchrun(env):
    _require(env, ("RANK", "WORLD_SIZE"), "torchrun-style", "launch with torchrun (launchers/torchrun.sh)",
             markers=_TORCHRUN_MARKERS + _TORCHRUN_LOCAL)
    rank = _parse_int(env["RANK"], "RANK")
    world = _parse_int(env["WORLD_SIZE"], "WORLD_SIZE")
    local_rank = _parse_int(env["LOCAL_RANK"], "LOCAL_RANK") if "LOCAL_RANK" in env else None
    local_world = (_parse_int(env["LOCAL_WORLD_SIZE"], "LOCAL_WORLD_SIZE")
                   if "LOCAL_WORLD_SIZE" in env else None)
    addr, port = _master_from_env(env)
    if addr is None and world > 1:
        raise LaunchEnvError(
            f"RANK/WORLD_SIZE are set (world size {world}) but MASTER_ADDR is missing. "
            f"Set MASTER_ADDR (and MASTER_PORT) or launch with torchrun, {_FIX_HINT}."
        )
    return dict(launcher="torchrun", rank=rank, world_size=world, local_rank=local_rank,
                local_world_size=local_world, master_addr=addr, master_port=port,
                names=("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"))


def _detect_mpi(env, launcher, names, what, fix):
    _require(env, names, what, fix)
    r, w, lr, lw = (_parse_int(env[n], n) for n in names)
    addr, port = _master_from_env(env)
    return dict(launcher=launcher, rank=r, world_size=w, local_rank=lr, local_world_size=lw,
                master_addr=addr, master_port=port, names=names)


def _detect_slurm(env):
    ntasks_name = "SLURM_NTASKS" if "SLURM_NTASKS" in env or "SLURM_NPROCS" not in env else "SLURM_NPROCS"
    _require(env, ("SLURM_PROCID", ntasks_name, "SLURM_LOCALID"), "SLURM",
             "launch the ranks with srun (launchers/srun.sh)", markers=_SLURM_MARKERS)
    rank = _parse_int(env["SLURM_PROCID"], "SLURM_PROCID")
    world = _parse_int(env[ntasks_name], ntasks_name)
    local_rank = _parse_int(env["SLURM_LOCALID"], "SLURM_LOCALID")
    node_index = _parse_int(env["SLURM_NODEID"], "SLURM_NODEID") if "SLURM_NODEID" in env else None

    # local world size: actual per-node distribution first, the requested value last
    tpn_name, tpn = _first(env, ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"))
    if tpn_name is not None:
        counts = _parse_tasks_per_node(tpn, tpn_name)
        if len(set(counts)) == 1:
            local_world = counts[0]
        elif node_index is None:
            raise LaunchEnvError(
                f"{tpn_name}={tpn!r} is not uniform, so SLURM_NODEID is needed to pick this "
                f"node's task count, but it is missing. Launch the ranks with srun, {_FIX_HINT}."
            )
        elif node_index >= len(counts):
            raise LaunchEnvError(
                f"SLURM_NODEID={node_index} is out of range for {tpn_name}={tpn!r} "
                f"({len(counts)} nodes)"
            )
        else:
            local_world = counts[node_index]
        lw_name = tpn_name
    elif "SLURM_NTASKS_PER_NODE" in env:
        local_world = _parse_int(env["SLURM_NTASKS_PER_NODE"], "SLURM_NTASKS_PER_NODE")
        lw_name = "SLURM_NTASKS_PER_NODE"
    elif _env_str(env, "SLURM_NNODES") == "1" or world == 1:
        local_world = world
        lw_name = ntasks_name
    else:
        raise LaunchEnvError(
            "SLURM environment has neither SLURM_TASKS_PER_NODE nor SLURM_NTASKS_PER_NODE, "
            f"so the local world size is unknown. Set SLURM_NTASKS_PER_NODE or launch with srun, "
            f"{_FIX_HINT}."
        )

    addr, port = _master_from_env(env)
    if addr is None:
        nl_name, nodelist = _first(env, ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"))
        hosts = expand_slurm_nodelist(nodelist) if nodelist else []
        if hosts:
            addr = hosts[0]
        elif world > 1:
            raise LaunchEnvError(
                "SLURM environment has no SLURM_JOB_NODELIST and MASTER_ADDR is not set. "
                f"Set MASTER_ADDR (and MASTER_PORT), {_FIX_HINT}."
            )
    if addr is not None and port is None and _env_str(env, "SLURM_JOB_ID") is not None:
        port = DEFAULT_MASTER_PORT + _parse_int(env["SLURM_JOB_ID"], "SLURM_JOB_ID") % 1000

    slurm_node = _env_str(env, "SLURM_NODEID")
    return dict(launcher="slurm", rank=rank, world_size=world, local_rank=local_rank,
                local_world_size=local_world, master_addr=addr, master_port=port,
                node_id=slurm_node, names=("SLURM_PROCID", ntasks_name, "SLURM_LOCALID", lw_name))


# ------------------------------------------------------------------ public entry point

def detect_launch_env(
    environ: Mapping[str, str] | None = None,
    *,
    rank=None,
    world_size=None,
    local_rank=None,
    local_world_size=None,
    master_addr=None,
    master_port=None,
    node_id=None,
) -> LaunchEnv:
    """Work out rank/world size/local rank/node/rendezvous address for this process.

    ``environ`` defaults to ``os.environ``.  Raises :class:`LaunchEnvError` (a
    ``ValueError`` whose message starts with ``"fusedist.init: "``) when a
    launcher's environment is incomplete or inconsistent.
    """
    env: Mapping[str, str] = os.environ if environ is None else environ

    if (rank is None) != (world_size is None):
        given, other = ("rank=", "world_size=") if rank is not None else ("world_size=", "rank=")
        raise LaunchEnvError(f"{given} was passed without {other}; pass both (or neither, to auto-detect)")

    # kwarg overrides, validated up front
    kw_local_rank = _parse_int(local_rank, "local_rank=") if local_rank is not None else None
    kw_local_world = (_parse_int(local_world_size, "local_world_size=")
                      if local_world_size is not None else None)
    kw_port = _parse_int(master_port, "master_port=") if master_port is not None else None

    if rank is not None:
        r = _parse_int(rank, "rank=")
        w = _parse_int(world_size, "world_size=")
        addr, port = _master_from_env(env)
        info = dict(launcher="explicit", rank=r, world_size=w, local_rank=None,
                    local_world_size=None, master_addr=addr, master_port=port,
                    names=("rank=", "world_size=", "local_rank=", "local_world_size="))
    elif any(n in env for n in _TORCHRUN_MARKERS):
        info = _detect_torchrun(env)
    elif any(n in env for n in _OMPI_VARS):
        info = _detect_mpi(env, "openmpi", _OMPI_VARS, "Open MPI",
                           "launch with mpirun (launchers/mpirun.sh)")
    elif any(n in env for n in _MPICH_VARS) and not _is_srun_pmi(env):
        info = _detect_mpi(env, "mpich", _MPICH_VARS, "MPICH/Hydra",
                           "launch with mpirun (launchers/mpirun.sh)")
    elif any(n in env for n in _SLURM_MARKERS):
        info = _detect_slurm(env)
    elif any(n in env for n in _TORCHRUN_LOCAL):
        present = [n for n in _TORCHRUN_LOCAL if n in env]
        raise LaunchEnvError(
            f"incomplete torchrun-style environment: {', '.join(present)} set but RANK, WORLD_SIZE "
            f"missing. Set RANK and WORLD_SIZE or launch with torchrun (launchers/torchrun.sh), "
            f"{_FIX_HINT}."
        )
    else:
        addr, port = _master_from_env(env)
        info = dict(launcher="single", rank=0, world_size=1, local_rank=0, local_world_size=1,
                    master_addr=addr, master_port=port,
                    names=("rank", "world_size", "local_rank", "local_world_size"))

    launcher = info["launcher"]
    n_rank, n_world, n_lrank, n_lworld = info["names"]
    r, w = info["rank"], info["world_size"]

    # local rank / local world size: kwarg > detected > defaults
    lw = kw_local_world if kw_local_world is not None else info["local_world_size"]
    lr = kw_local_rank if kw_local_rank is not None else info["local_rank"]
    if kw_local_world is not None:
        n_lworld = "local_world_size="
    if kw_local_rank is not None:
        n_lrank = "local_rank="
    if lw is None:
        lw = w  # no per-node information: assume a single node
    if lr is None:
        lr = r % lw if lw > 0 else r

    # consistency checks, naming the offending variable
    if w < 1:
        raise LaunchEnvError(f"{_kv(n_world, w)} must be >= 1")
    if r >= w:
        raise LaunchEnvError(f"{_kv(n_rank, r)} must be < {_kv(n_world, w)}")
    if lw < 1:
        raise LaunchEnvError(f"{_kv(n_lworld, lw)} must be >= 1")
    if lw > w:
        raise LaunchEnvError(f"{_kv(n_lworld, lw)} must be <= {_kv(n_world, w)}")
    if lr >= lw:
        raise LaunchEnvError(f"{_kv(n_lrank, lr)} must be < {_kv(n_lworld, lw)}")

    # rendezvous address
    addr = master_addr.strip() if isinstance(master_addr, str) and master_addr.strip() else info["master_addr"]
    port = kw_port if kw_port is not None else info["master_port"]
    if addr is None and launcher == "explicit" and w > 1:
        if lw == w:
            addr = "127.0.0.1"  # everything on this host
        else:
            raise LaunchEnvError(
                f"world_size={w} spans several nodes (local_world_size={lw}) but no rendezvous "
                "address is known. Set MASTER_ADDR or pass master_addr= to fusedist.init."
            )
    if addr is not None and port is None:
        port = DEFAULT_MASTER_PORT
    if port is not None and not 1 <= port <= 65535:
        raise LaunchEnvError(
            f"{_kv('master_port=' if kw_port is not None else 'MASTER_PORT', port)} is not a valid "
            "TCP port (1-65535)"
        )

    # node identity: kwarg > FUSEDIST_NODE_ID > launcher notion (SLURM_NODEID) > hostname
    if node_id is not None and str(node_id).strip():
        nid = str(node_id).strip()
    elif envs.get("FUSEDIST_NODE_ID", env) is not None:
        nid = envs.get("FUSEDIST_NODE_ID", env)
    elif info.get("node_id"):
        nid = info["node_id"]
    else:
        nid = socket.gethostname()

    return LaunchEnv(launcher=launcher, rank=r, world_size=w, local_rank=lr,
                     local_world_size=lw, node_id=nid, master_addr=addr, master_port=port)


# ------------------------------------------------------------------ this host's address

def _is_loopback(addr: str) -> bool:
    return addr.startswith("127.") or addr in ("::1", "0.0.0.0")


def _interface_ipv4(name: str) -> str | None:
    """The IPv4 address of network interface `name` (Linux SIOCGIFADDR), or None."""
    try:
        import fcntl
        import struct

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
        return socket.inet_ntoa(packed[20:24])
    except (OSError, ImportError, ValueError):
        return None


def host_address(environ: Mapping[str, str] | None = None) -> tuple[str | None, str]:
    """(an IPv4 address of this host that other nodes can reach, how it was found), or
    (None, why none was): the rendezvous address rank 0 offers under mpirun without
    MASTER_ADDR. In order: the interface GLOO_SOCKET_IFNAME or NCCL_SOCKET_IFNAME names (the
    one the job's traffic is meant to take); the hostname's addresses that are not loopback
    (many hosts map their name to 127.0.1.1); the interface of the default route (no packet
    is sent); any interface's non-loopback address."""
    env: Mapping[str, str] = os.environ if environ is None else environ
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        names = [n.strip() for n in (_env_str(env, var) or "").split(",") if n.strip()]
        for n in names:
            if n.startswith(("^", "=")):
                continue
            addr = _interface_ipv4(n)
            if addr and not _is_loopback(addr):
                return addr, f"interface {n} ({var})"
    name = socket.gethostname()
    try:
        resolved = socket.gethostbyname_ex(name)[2]
    except OSError:
        resolved = []
    for addr in resolved:
        if not _is_loopback(addr):
            return addr, f"hostname {name}"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))     # TEST-NET-1: only picks the route, sends nothing
            addr = s.getsockname()[0]
        if not _is_loopback(addr):
            return addr, "the default route's interface"
    except OSError:
        pass
    for _, n in socket.if_nameindex() if hasattr(socket, "if_nameindex") else ():
        addr = _interface_ipv4(n)
        if addr and not _is_loopback(addr):
            return addr, f"interface {n}"
    shown = ", ".join(resolved) or "nothing"
    return None, (f"hostname {name} resolves to {shown} (loopback), and no interface has "
                  "another IPv4 address")
