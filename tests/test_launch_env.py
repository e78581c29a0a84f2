"""CPU unit tests for fusedist.distributed.launch_env (fake environ dicts, no torch needed)."""

import importlib.util
import pathlib
import socket
import sys

import pytest

try:
    from fusedist.distributed.launch_env import (LaunchEnv, LaunchEnvError, detect_launch_env,
                                     expand_slurm_nodelist)
except ImportError:  # package __init__ may need torch; the module itself is stdlib-only
    _path = pathlib.Path(__file__).resolve().parents[1] / "fusedist" / "launch_env.py"
    _spec = importlib.util.spec_from_file_location("_fusedist_launch_env", _path)
    _mod = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = _mod
    _spec.loader.exec_module(_mod)
    LaunchEnv, LaunchEnvError = _mod.LaunchEnv, _mod.LaunchEnvError
    detect_launch_env, expand_slurm_nodelist = _mod.detect_launch_env, _mod.expand_slurm_nodelist

HOST = socket.gethostname()

TORCHRUN = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
            "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400", "GROUP_RANK": "1",
            "TORCHELASTIC_RUN_ID": "none"}
OMPI = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
MPICH = {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}
SLURM = {"SLURM_PROCID": "6", "SLURM_NTASKS": "8", "SLURM_LOCALID": "2", "SLURM_NODEID": "1",
         "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_TASKS_PER_NODE": "4(x2)",
         "SLURM_JOB_ID": "123456"}


# ------------------------------------------------------------------ launchers

def test_single_when_nothing_set():
    env = detect_launch_env({})
    assert env == LaunchEnv("single", 0, 1, 0, 1, HOST, None, None)


def test_single_reads_master_addr_and_defaults_port():
    env = detect_launch_env({"MASTER_ADDR": "h0"})
    assert (env.launcher, env.master_addr, env.master_port) == ("single", "h0", 29500)


def test_salloc_shell_without_procid_is_single():
    env = detect_launch_env({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "8", "SLURM_JOB_NODELIST": "n[1-2]"})
    assert env.launcher == "single" and env.world_size == 1


def test_torchrun():
    env = detect_launch_env(TORCHRUN)
    assert env == LaunchEnv("torchrun", 5, 8, 1, 4, HOST, "10.0.0.1", 29400)


def test_torchrun_minimal_rank_world_master():
    env = detect_launch_env({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "localhost"})
    assert env.launcher == "torchrun"
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (1, 2, 1, 2)
    assert (env.master_addr, env.master_port) == ("localhost", 29500)


def test_torchrun_world_one_needs_no_master():
    env = detect_launch_env({"RANK": "0", "WORLD_SIZE": "1"})
    assert env.launcher == "torchrun" and env.master_addr is None and env.master_port is None


def test_openmpi():
    env = detect_launch_env(OMPI)
    assert env == LaunchEnv("openmpi", 3, 4, 1, 2, HOST, None, None)


def test_openmpi_uses_master_env_if_set():
    env = detect_launch_env({**OMPI, "MASTER_ADDR": "m", "MASTER_PORT": "1234"})
    assert (env.master_addr, env.master_port) == ("m", 1234)


def test_mpich():
    env = detect_launch_env(MPICH)
    assert env == LaunchEnv("mpich", 2, 4, 0, 2, HOST, None, None)


def test_slurm():
    env = detect_launch_env(SLURM)
    assert env == LaunchEnv("slurm", 6, 8, 2, 4, "1", "gpu01", 29500 + 456)


def test_slurm_defaults_without_job_id():
    e = {k: v for k, v in SLURM.items() if k != "SLURM_JOB_ID"}
    assert detect_launch_env(e).master_port == 29500


def test_slurm_master_env_wins_over_nodelist():
    env = detect_launch_env({**SLURM, "MASTER_ADDR": "head", "MASTER_PORT": "4000"})
    assert (env.master_addr, env.master_port) == ("head", 4000)


def test_slurm_step_nodelist_preferred():
    env = detect_launch_env({**SLURM, "SLURM_STEP_NODELIST": "gpu[05-06]"})
    assert env.master_addr == "gpu05"


def test_slurm_ntasks_per_node():
    e = {k: v for k, v in SLURM.items() if k != "SLURM_TASKS_PER_NODE"}
    assert detect_launch_env({**e, "SLURM_NTASKS_PER_NODE": "4"}).local_world_size == 4


def test_slurm_single_node_without_per_node_info():
    env = detect_launch_env({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1",
                             "SLURM_NNODES": "1", "SLURM_JOB_NODELIST": "n1"})
    assert (env.local_world_size, env.master_addr) == (2, "n1")


@pytest.mark.parametrize("tpn, nodeid, expected", [
    ("4(x2)", "0", 4), ("4(x2)", "1", 4), ("2,1", "0", 2), ("2,1", "1", 1),
    ("3(x2),2", "2", 2), ("3(x2),2", "1", 3), ("1,3(x2)", "2", 3),
])
def test_slurm_tasks_per_node_picks_by_node(tpn, nodeid, expected):
    counts = {"4(x2)": 8, "2,1": 3, "3(x2),2": 8, "1,3(x2)": 7}[tpn]
    e = {"SLURM_PROCID": "0", "SLURM_NTASKS": str(counts), "SLURM_LOCALID": "0",
         "SLURM_NODEID": nodeid, "SLURM_TASKS_PER_NODE": tpn, "SLURM_JOB_NODELIST": "n[0-3]"}
    assert detect_launch_env(e).local_world_size == expected


def test_slurm_step_tasks_per_node_preferred():
    env = detect_launch_env({**SLURM, "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_NTASKS": "4",
                             "SLURM_PROCID": "3", "SLURM_LOCALID": "1"})
    assert env.local_world_size == 2


def test_srun_pmi2_is_slurm_not_mpich():
    env = detect_launch_env({**SLURM, "PMI_RANK": "6", "PMI_SIZE": "8"})
    assert env.launcher == "slurm"


# ------------------------------------------------------------------ precedence

def test_openmpi_wins_over_slurm():
    env = detect_launch_env({**SLURM, **OMPI})
    assert env.launcher == "openmpi" and env.rank == 3 and env.node_id == HOST
    assert env.master_addr is None


def test_mpich_wins_over_slurm():
    assert detect_launch_env({**SLURM, **MPICH}).launcher == "mpich"


def test_torchrun_wins_over_slurm_and_mpi():
    env = detect_launch_env({**SLURM, **OMPI, **TORCHRUN})
    assert env.launcher == "torchrun" and env.rank == 5 and env.node_id == HOST


def test_explicit_wins_over_everything():
    env = detect_launch_env({**SLURM, **OMPI, **TORCHRUN}, rank=1, world_size=2)
    assert env.launcher == "explicit"
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (1, 2, 1, 2)
    assert (env.master_addr, env.master_port) == ("10.0.0.1", 29400)  # from MASTER_* env


def test_explicit_defaults():
    env = detect_launch_env({}, rank=0, world_size=2)
    assert env == LaunchEnv("explicit", 0, 2, 0, 2, HOST, "127.0.0.1", 29500)
    env = detect_launch_env({}, rank=0, world_size=1)
    assert (env.master_addr, env.master_port) == (None, None)


def test_explicit_multi_node():
    env = detect_launch_env({}, rank=5, world_size=8, local_world_size=4, master_addr="h0",
                            master_port=1111, node_id="n1")
    assert env == LaunchEnv("explicit", 5, 8, 1, 4, "n1", "h0", 1111)


def test_kwargs_override_detected_values():
    env = detect_launch_env(OMPI, master_addr="x", master_port=9000, local_rank=0)
    assert (env.launcher, env.master_addr, env.master_port, env.local_rank) == ("openmpi", "x", 9000, 0)


def test_fusedist_node_id_env_overrides():
    for e in (TORCHRUN, OMPI, MPICH, SLURM, {}):
        assert detect_launch_env({**e, "FUSEDIST_NODE_ID": "fake-node-3"}).node_id == "fake-node-3"
    env = detect_launch_env({"FUSEDIST_NODE_ID": "a"}, rank=0, world_size=1)
    assert env.node_id == "a"


def test_node_id_kwarg_beats_env():
    assert detect_launch_env({**SLURM, "FUSEDIST_NODE_ID": "env"}, node_id="kw").node_id == "kw"


def test_blank_node_id_env_ignored():
    assert detect_launch_env({"FUSEDIST_NODE_ID": "  "}).node_id == HOST


def test_defaults_to_os_environ(monkeypatch):
    for k in list(__import__("os").environ):
        if k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "OMPI_", "PMI_", "MPI_LOCAL", "SLURM_",
                         "TORCHELASTIC", "GROUP_RANK", "MASTER_", "FUSEDIST_")):
            monkeypatch.delenv(k)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert detect_launch_env().launcher == "torchrun"


# ------------------------------------------------------------------ node lists

@pytest.mark.parametrize("nodelist, expected", [
    ("n[1-3]", ["n1", "n2", "n3"]),
    ("gpu[01-02,10]", ["gpu01", "gpu02", "gpu10"]),
    ("a,b", ["a", "b"]),
    ("node[008-010]", ["node008", "node009", "node010"]),
    ("x[1-2],y5", ["x1", "x2", "y5"]),
    ("gpu[01-03,07],login1", ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]),
    ("single", ["single"]),
    ("rack1-n[9-11]", ["rack1-n9", "rack1-n10", "rack1-n11"]),
    ("a[1-2]b[3-4]", ["a1b3", "a1b4", "a2b3", "a2b4"]),
    ("n[1-2]-ib", ["n1-ib", "n2-ib"]),
    ("", []),
])
def test_expand_slurm_nodelist(nodelist, expected):
    assert expand_slurm_nodelist(nodelist) == expected


@pytest.mark.parametrize("bad", ["n[1-3", "n1-3]", "n[3-1]", "n[a-b]", "n[]"])
def test_expand_slurm_nodelist_malformed(bad):
    with pytest.raises(LaunchEnvError, match=r"^fusedist\.init: malformed SLURM node list"):
        expand_slurm_nodelist(bad)


# ------------------------------------------------------------------ errors

def _raises(env, match, **kw):
    with pytest.raises(LaunchEnvError, match=match) as ei:
        detect_launch_env(env, **kw)
    assert str(ei.value).startswith("fusedist.init: ")
    assert isinstance(ei.value, ValueError)
    return str(ei.value)


def test_partial_torchrun_rank_without_world_size():
    msg = _raises({"RANK": "0", "MASTER_ADDR": "h"}, r"WORLD_SIZE missing")
    assert "Set WORLD_SIZE or launch with torchrun" in msg
    assert "pass rank=/world_size= to fusedist.init" in msg


def test_partial_torchrun_markers_only():
    _raises({"GROUP_RANK": "0"}, r"GROUP_RANK set but RANK, WORLD_SIZE missing")


def test_local_rank_alone_is_partial():
    _raises({"LOCAL_RANK": "0"}, r"LOCAL_RANK set but RANK, WORLD_SIZE missing")


def test_torchrun_missing_master_addr():
    _raises({"RANK": "0", "WORLD_SIZE": "2"}, r"MASTER_ADDR is missing")


def test_partial_openmpi():
    msg = _raises({"OMPI_COMM_WORLD_RANK": "0"}, r"OMPI_COMM_WORLD_SIZE")
    assert "mpirun" in msg and "rank=/world_size=" in msg


def test_partial_mpich():
    _raises({"PMI_RANK": "0", "PMI_SIZE": "2"}, r"MPI_LOCALRANKID, MPI_LOCALNRANKS missing")


def test_partial_slurm():
    _raises({"SLURM_PROCID": "0", "SLURM_LOCALID": "0"}, r"SLURM_NTASKS missing")


def test_slurm_non_uniform_tasks_needs_nodeid():
    e = {k: v for k, v in SLURM.items() if k != "SLURM_NODEID"}
    _raises({**e, "SLURM_TASKS_PER_NODE": "5,3"}, r"SLURM_NODEID")


def test_slurm_nodeid_out_of_range():
    _raises({**SLURM, "SLURM_TASKS_PER_NODE": "5,3", "SLURM_NODEID": "2"}, r"SLURM_NODEID=2 is out of range")


def test_slurm_bad_tasks_per_node():
    _raises({**SLURM, "SLURM_TASKS_PER_NODE": "4(2)"}, r"SLURM_TASKS_PER_NODE must look like")


def test_slurm_multi_node_without_per_node_info():
    e = {k: v for k, v in SLURM.items() if k != "SLURM_TASKS_PER_NODE"}
    _raises(e, r"SLURM_NTASKS_PER_NODE")


def test_slurm_bad_job_id():
    _raises({**SLURM, "SLURM_JOB_ID": "12_a"}, r"SLURM_JOB_ID must be an integer")


@pytest.mark.parametrize("env, var", [
    ({**TORCHRUN, "RANK": "zero"}, "RANK"),
    ({**TORCHRUN, "WORLD_SIZE": "8.0"}, "WORLD_SIZE"),
    ({**TORCHRUN, "LOCAL_RANK": ""}, "LOCAL_RANK"),
    ({**TORCHRUN, "MASTER_PORT": "http"}, "MASTER_PORT"),
    ({**OMPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "two"}, "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ({**MPICH, "PMI_SIZE": "4x"}, "PMI_SIZE"),
    ({**SLURM, "SLURM_PROCID": "1e3"}, "SLURM_PROCID"),
])
def test_non_integer(env, var):
    _raises(env, rf"fusedist\.init: {var} must be an integer")


@pytest.mark.parametrize("env, var", [
    ({**TORCHRUN, "RANK": "-1"}, "RANK"),
    ({**OMPI, "OMPI_COMM_WORLD_LOCAL_RANK": "-2"}, "OMPI_COMM_WORLD_LOCAL_RANK"),
    ({**SLURM, "SLURM_LOCALID": "-1"}, "SLURM_LOCALID"),
])
def test_negative(env, var):
    _raises(env, rf"{var}=-\d must be >= 0")


@pytest.mark.parametrize("env, msg", [
    ({**TORCHRUN, "RANK": "8"}, r"RANK=8 must be < WORLD_SIZE=8"),
    ({**OMPI, "OMPI_COMM_WORLD_RANK": "9"}, r"OMPI_COMM_WORLD_RANK=9 must be < OMPI_COMM_WORLD_SIZE=4"),
    ({**MPICH, "PMI_RANK": "4"}, r"PMI_RANK=4 must be < PMI_SIZE=4"),
    ({**SLURM, "SLURM_PROCID": "8"}, r"SLURM_PROCID=8 must be < SLURM_NTASKS=8"),
    ({**TORCHRUN, "LOCAL_RANK": "4"}, r"LOCAL_RANK=4 must be < LOCAL_WORLD_SIZE=4"),
    ({**OMPI, "OMPI_COMM_WORLD_LOCAL_RANK": "2"}, r"OMPI_COMM_WORLD_LOCAL_RANK=2 must be < OMPI_COMM_WORLD_LOCAL_SIZE=2"),
    ({**MPICH, "MPI_LOCALRANKID": "3"}, r"MPI_LOCALRANKID=3 must be < MPI_LOCALNRANKS=2"),
    ({**SLURM, "SLURM_LOCALID": "4"}, r"SLURM_LOCALID=4 must be < SLURM_TASKS_PER_NODE=4"),
    ({**TORCHRUN, "WORLD_SIZE": "0", "RANK": "0"}, r"WORLD_SIZE=0 must be >= 1"),
    ({**TORCHRUN, "LOCAL_WORLD_SIZE": "16"}, r"LOCAL_WORLD_SIZE=16 must be <= WORLD_SIZE=8"),
    ({**TORCHRUN, "MASTER_PORT": "70000"}, r"MASTER_PORT=70000 is not a valid TCP port"),
])
def test_inconsistent(env, msg):
    _raises(env, msg)


def test_explicit_errors():
    _raises({}, r"rank= was passed without world_size=", rank=0)
    _raises({}, r"world_size= was passed without rank=", world_size=2)
    _raises({}, r"rank=2 must be < world_size=2", rank=2, world_size=2)
    _raises({}, r"rank=-1 must be >= 0", rank=-1, world_size=2)
    _raises({}, r"world_size= must be an integer", rank=0, world_size="two")
    _raises({}, r"local_rank=2 must be < local_world_size=2", rank=0, world_size=4,
            local_rank=2, local_world_size=2, master_addr="h")
    _raises({}, r"master_port=0 is not a valid TCP port", rank=0, world_size=2, master_port=0)
    _raises({}, r"MASTER_ADDR or pass master_addr=", rank=0, world_size=8, local_world_size=4)


# ---- this host's address for an MPI rendezvous ------------------------------------------------
def test_host_address_skips_a_hostname_that_resolves_to_loopback(monkeypatch):
    """Many hosts map their hostname to 127.0.1.1: the address offered to other nodes comes
    from the default route's interface instead, or the interface GLOO_SOCKET_IFNAME names."""
    from fusedist.distributed import launch_env

    monkeypatch.setattr(socket, "gethostbyname_ex", lambda n: (n, [], ["127.0.1.1"]))

    class Route:
        def __init__(self, *a):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def connect(self, addr):
            pass

        def getsockname(self):
            return ("10.1.2.3", 40000)

    monkeypatch.setattr(socket, "socket", Route)
    addr, how = launch_env.host_address({})
    assert addr == "10.1.2.3" and "default route" in how
    monkeypatch.setattr(launch_env, "_interface_ipv4",
                        lambda n: {"ib0": "10.9.9.9", "lo": "127.0.0.1"}.get(n))
    assert launch_env.host_address({"GLOO_SOCKET_IFNAME": "ib0"}) == \
        ("10.9.9.9", "interface ib0 (GLOO_SOCKET_IFNAME)")
    assert launch_env.host_address({"NCCL_SOCKET_IFNAME": "^docker,lo"})[0] == "10.1.2.3"
    # a hostname with a real address keeps it
    monkeypatch.setattr(socket, "gethostbyname_ex",
                        lambda n: (n, [], ["127.0.1.1", "172.16.0.7"]))
    assert launch_env.host_address({}) == ("172.16.0.7", f"hostname {HOST}")


def test_host_address_none_says_why(monkeypatch):
    from fusedist.distributed import launch_env

    monkeypatch.setattr(socket, "gethostbyname_ex", lambda n: (n, [], ["127.0.1.1"]))

    class NoRoute:
        def __init__(self, *a):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def connect(self, addr):
            raise OSError("Network is unreachable")

    monkeypatch.setattr(socket, "socket", NoRoute)
    monkeypatch.setattr(socket, "if_nameindex", lambda: [(1, "lo")])
    monkeypatch.setattr(launch_env, "_interface_ipv4", lambda n: "127.0.0.1")
    addr, why = launch_env.host_address({})
    assert addr is None and "resolves to 127.0.1.1 (loopback)" in why
