"""Peer processes: who they are, whether they are still there, and the error that names the
ones a failed collective lost.

init() all-gathers every rank's process identity (process_identity(): host key, pid, start
time). When a torch.distributed collective fails (gloo: "Connection reset by peer",
"Connection closed by peer", a timeout), peer_lost_error() looks at the group's peers on this
host: a process that no longer exists (or is a zombie, or whose pid now belongs to another
process) is lost. Ranks on other hosts cannot be looked at from here; the message lists them
as unchecked. Host key: hostname, boot id and pid namespace, so pids are compared only where
they mean the same process.

collective_timeout(group, seconds) bounds a gloo group's collectives for a while (a peer that
stops answering fails the call within that time instead of the process group's long
bootstrap timeout) and restores the group's timeout afterwards.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import time
from typing import Optional, Sequence

import torch.distributed as dist

from ..errors import FusedistError, PeerLostError


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _start_time(pid: int) -> Optional[int]:
    """The process's start time (clock ticks after boot, /proc/<pid>/stat field 22), or None."""
    stat = _read(f"/proc/{pid}/stat")
    if not stat:
        return None
    try:
        return int(stat[stat.rindex(")") + 2:].split()[19])
    except (ValueError, IndexError):
        return None


def process_identity() -> tuple[str, int, Optional[int]]:
    """(host key, pid, start time) of this process; gathered by init()."""
    try:
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        pidns = 0
    host = f"{socket.gethostname()}/{_read('/proc/sys/kernel/random/boot_id')}/{pidns}"
    pid = os.getpid()
    return host, pid, _start_time(pid)


def process_state(pid: int, start: Optional[int]) -> str:
    """'running', or why the process with this pid and start time is gone: 'exited' (no such
    process, or the pid is another process's now) or 'zombie' (exited, not reaped); 'unknown'
    without /proc."""
    if not os.path.isdir("/proc/self"):
        return "unknown"
    stat = _read(f"/proc/{pid}/stat")
    if not stat:
        return "exited"
    try:
        fields = stat[stat.rindex(")") + 2:].split()
        state, started = fields[0], int(fields[19])
    except (ValueError, IndexError):
        return "unknown"
    if start is not None and started != start:
        return "exited"
    return "zombie" if state in ("Z", "X") else "running"


def is_peer_failure(exc: BaseException) -> bool:
    """True for errors of a torch.distributed collective whose peers broke away (gloo's
    connection errors and timeouts, torch's DistError), not for fusedist's own errors."""
    if isinstance(exc, FusedistError):
        return False
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    return isinstance(exc, RuntimeError) and "gloo" in str(exc).lower()


def lost_peers(peers: Sequence, ranks: Sequence[int], me: int, wait_s: float = 2.0
               ) -> tuple[list, list]:
    """([(rank, state, pid)] of `ranks` whose process on this host is gone, [ranks on other
    hosts]). peers[r] is rank r's process_identity(). A peer that is still running is looked
    at again for up to wait_s: a killed process closes its sockets before it is gone."""
    host = peers[me][0]
    local = [r for r in ranks if r != me and peers[r][0] == host]
    remote = [r for r in ranks if r != me and peers[r][0] != host]
    deadline = time.monotonic() + wait_s
    while True:
        lost = [(r, st, peers[r][1]) for r in local
                for st in (process_state(peers[r][1], peers[r][2]),) if st in ("exited", "zombie")]
        if lost or time.monotonic() >= deadline or not local:
            return lost, remote
        time.sleep(0.05)


def peer_lost_error(where: str, group, peers: Optional[Sequence], me: int,
                    exc: BaseException) -> PeerLostError:
    """The PeerLostError for collective failure `exc` of `group` (a fusedist Group) on rank
    `me`: it names the group's ranks whose processes are gone, or says that none on this host
    is and which ranks could not be checked."""
    cause = " ".join(str(exc).split())
    if len(cause) > 300:
        cause = cause[:300] + " ..."
    ranks = list(group.ranks)
    if peers is None or len(peers) <= max(ranks + [me]):
        what = f"a peer of group {group.name} (ranks {ranks}) was lost or stopped answering"
    else:
        lost, remote = lost_peers(peers, ranks, me)
        if lost:
            what = "; ".join(f"rank {r} of group {group.name} is lost: its process (pid {pid} "
                             "on this host) has exited" for r, _, pid in lost)
            if remote:
                what += f" (ranks {remote} on other hosts were not checked)"
        elif remote:
            what = (f"a peer of group {group.name} was lost or stopped answering: no rank of it "
                    f"on this host has exited; ranks {remote} on other hosts could not be "
                    "checked")
        else:
            what = (f"a peer of group {group.name} stopped answering: every rank of it is still "
                    "running on this host (stuck, or slower than the timeout)")
    return PeerLostError(f"{where}: {what}. The group cannot continue: end every rank and "
                         f"start the job again. (collective error: {cause})")


@contextlib.contextmanager
def collective_timeout(group, seconds: Optional[float], restore_s: Optional[float]):
    """Bound the collectives of `group` (a fusedist Group on gloo) by `seconds` inside the
    block, then set them back to `restore_s`. Does nothing when either is None, on other
    backends, or when the process group cannot set its timeout."""
    pg = getattr(group, "pg", None)
    set_timeout = getattr(pg, "set_timeout", None)
    if seconds is None or restore_s is None or set_timeout is None or group.size == 1 or \
            group.backend != "gloo":
        yield
        return
    set_timeout(datetime.timedelta(seconds=seconds))
    try:
        yield
    finally:
        if group.pg is pg:               # not released by a shutdown() meanwhile
            set_timeout(datetime.timedelta(seconds=restore_s))
