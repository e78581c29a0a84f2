"""fusedist.init / fusedist.shutdown in one process (world size 1, CPU, gloo): lifecycle
errors, argument errors, and the world-size-1 collectives against plain torch.

Every test starts and ends with neither fusedist nor torch.distributed initialized (the
autouse fixture checks the start and cleans up after a failing test)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import fusedist
from fusedist.ops import rmsnorm_reference
from tolerances import TOL_EPILOGUE, count_bad

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LAUNCHER_VARS = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RUN_ID",
    "MASTER_ADDR", "MASTER_PORT",
    "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS",
    "SLURM_PROCID", "SLURM_NTASKS", "SLURM_NPROCS", "SLURM_LOCALID", "SLURM_NODEID",
)


def _teardown():
    fusedist.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def clean_state(monkeypatch):
    # A launcher's variables in the pytest process must not change what init() detects.
    for v in LAUNCHER_VARS:
        monkeypatch.delenv(v, raising=False)
    monkeypatch.delenv("FUSEDIST_ALLREDUCE_ALGO", raising=False)
    if fusedist.is_initialized() or dist.is_initialized():
        _teardown()
        pytest.fail("a previous test left fusedist or torch.distributed initialized")
    yield
    _teardown()


@pytest.fixture
def rt():
    runtime = fusedist.init(rank=0, world_size=1, backend="gloo")
    yield runtime
    fusedist.shutdown()


def poisoned_like(x):
    return torch.full_like(x, float("nan"))


# ------------------------------------------------------------------ lifecycle

def test_init_world1(rt):
    assert fusedist.is_initialized()
    assert fusedist.get_runtime() is rt
    assert rt.rank == 0 and rt.world_size == 1
    assert rt.backend == "gloo" and rt.device == torch.device("cpu")
    assert rt.owns_process_group
    assert rt.topology.num_nodes == 1 and rt.topology.ranks_per_node == 1
    for g in (rt.world, rt.tp, rt.dp, rt.intra_node, rt.inter_node):
        assert g.ranks == (0,) and g.rank == 0 and g.size == 1


def test_init_twice_raises(rt):
    with pytest.raises(RuntimeError, match="already initialized"):
        fusedist.init(rank=0, world_size=1, backend="gloo")
    assert fusedist.get_runtime() is rt  # the first runtime is untouched


def test_shutdown_destroys_owned_group_and_is_idempotent(rt):
    fusedist.shutdown()
    assert not fusedist.is_initialized()
    assert not dist.is_initialized()
    fusedist.shutdown()


def _gloo_threads() -> int:
    import os

    n = 0
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                n += "gloo" in f.read()
        except OSError:
            pass
    return n


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self/task"),
                    reason="counts threads through /proc")
def test_shutdown_frees_the_process_groups():
    """shutdown() releases the groups it destroyed (their Group.pg becomes None), so torch
    frees them at once and no gloo thread outlives it: one left for the interpreter's exit can
    abort the process (its work's tensors need the GIL while the interpreter finalizes)."""
    before = _gloo_threads()
    rt = fusedist.init(rank=0, world_size=1, backend="gloo")
    comm = fusedist.get_communicator()
    fusedist.all_reduce(torch.randn(5))
    # a new thread names itself once it runs: wait for the names, not a fixed time
    deadline = time.monotonic() + 30.0
    while _gloo_threads() <= before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _gloo_threads() > before, "no gloo thread after init and an all_reduce"
    fusedist.shutdown()
    deadline = time.monotonic() + 5.0   # a thread may take a moment to end on a loaded machine
    while _gloo_threads() != before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gloo_threads() == before, "gloo threads outlived fusedist.shutdown() by 5 s"
    assert rt.world.pg is None and rt.tp.pg is None and comm.group.pg is None
    released = fusedist.Group("tp0", (0, 1), None, torch.device("cpu"))
    with pytest.raises(fusedist.NotInitializedError, match="fusedist.shutdown.. released it"):
        released.all_gather_object(1)
    with pytest.raises(fusedist.NotInitializedError, match="group tp0 has no process group"):
        released.check_same({"a": "1"}, where="w", what="x", fix="")


def test_shutdown_registered_at_exit():
    """A gloo runtime still initialized when the interpreter exits is shut down by an atexit
    hook (the same release as shutdown(), while the interpreter is whole)."""
    import subprocess
    import sys

    code = ("import atexit, fusedist, torch\n"      # exit hooks run last-registered first
            "atexit.register(lambda: print('pg after exit hook:', rt.world.pg, "
            "fusedist.is_initialized(), flush=True))\n"
            "rt = fusedist.init(rank=0, world_size=1, backend='gloo')\n"
            "fusedist.all_reduce(torch.ones(3))\n")
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "pg after exit hook: None False" in out.stdout, out.stdout + out.stderr[-3000:]


def test_use_after_shutdown_raises_not_initialized(rt):
    fusedist.shutdown()
    with pytest.raises(fusedist.NotInitializedError, match="fusedist.init"):
        fusedist.get_runtime()
    with pytest.raises(fusedist.NotInitializedError):
        fusedist.all_reduce(torch.ones(4))
    with pytest.raises(fusedist.NotInitializedError):
        fusedist.all_reduce_(torch.ones(4))
    with pytest.raises(fusedist.NotInitializedError):
        fusedist.get_communicator()


def test_communicator_after_shutdown_raises_closed(rt):
    comm = fusedist.Communicator()
    default = fusedist.get_communicator()
    x = torch.randn(7)
    assert torch.equal(comm.all_reduce(x), x)
    fusedist.shutdown()
    assert comm.closed and default.closed
    for c in (comm, default):
        with pytest.raises(fusedist.CommunicatorClosedError, match="closed"):
            c.all_reduce(x)
    assert issubclass(fusedist.CommunicatorClosedError, fusedist.FusedistError)


def test_reinit_after_shutdown():
    for _ in range(3):
        rt = fusedist.init(rank=0, world_size=1, backend="gloo")
        assert rt.owns_process_group and dist.is_initialized()
        x = torch.randn(5)
        assert torch.equal(fusedist.all_reduce(x), x)
        fusedist.shutdown()
        assert not dist.is_initialized()


def test_init_with_no_launcher_env_is_single():
    rt = fusedist.init(backend="gloo")
    assert rt.env.launcher == "single" and rt.world_size == 1


# ------------------------------------------------------------------ argument errors

@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_backend_nccl_without_gpu():
    with pytest.raises(ValueError) as e:
        fusedist.init(rank=0, world_size=1, backend="nccl")
    assert "backend='nccl'" in str(e.value) and "gloo" in str(e.value)
    assert not fusedist.is_initialized() and not dist.is_initialized()


@pytest.mark.parametrize("backend", ["mpi", "NCCL", "ucc", ""])
def test_backend_unknown(backend):
    with pytest.raises(ValueError) as e:
        fusedist.init(rank=0, world_size=1, backend=backend)
    assert "backend" in str(e.value) and repr(backend) in str(e.value)
    assert not fusedist.is_initialized() and not dist.is_initialized()


def test_tp_size_not_dividing_world_leaves_nothing_initialized():
    with pytest.raises(ValueError, match="tp_size=3"):
        fusedist.init(rank=0, world_size=1, backend="gloo", tp_size=3)
    # The process group init() created must be gone, so the next init() owns a fresh one.
    assert not fusedist.is_initialized()
    assert not dist.is_initialized()
    rt = fusedist.init(rank=0, world_size=1, backend="gloo")
    assert rt.owns_process_group
    fusedist.shutdown()
    assert not dist.is_initialized()


def test_partial_launcher_env(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(fusedist.LaunchEnvError) as e:
        fusedist.init(backend="gloo")
    assert "WORLD_SIZE" in str(e.value)
    assert str(e.value).startswith("fusedist.init: ")
    assert isinstance(e.value, ValueError)
    assert not fusedist.is_initialized() and not dist.is_initialized()


# ------------------------------------------------------------------ world-size-1 collectives

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1,), (7,), (3, 65), (1023,)])
def test_all_reduce_world1_is_a_copy(rt, dtype, shape):
    x = torch.randn(shape, dtype=torch.float32).to(dtype)
    x_copy = x.clone()
    y = fusedist.all_reduce(x)
    assert y.data_ptr() != x.data_ptr()
    assert y.dtype == dtype and y.shape == x.shape
    assert torch.equal(y, x)
    assert torch.equal(x, x_copy)
    out = poisoned_like(x)
    assert fusedist.all_reduce(x, out=out) is out
    assert torch.equal(out, x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_reduce_inplace_world1(rt, dtype):
    x = torch.randn(3, 65, dtype=torch.float32).to(dtype)
    expected = x.clone()
    y = fusedist.all_reduce_(x)
    assert y.data_ptr() == x.data_ptr()
    assert torch.equal(x, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_reduce_async_on_cpu_is_complete(rt, dtype):
    x = torch.randn(33, dtype=torch.float32).to(dtype)
    h = fusedist.all_reduce(x, async_op=True)
    assert isinstance(h, fusedist.AsyncHandle)
    assert h.is_completed()
    assert torch.equal(h.wait(), x)
    assert h.synchronize() is h.result


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_reduce_add_rmsnorm_world1(rt, dtype):
    eps = 1e-6
    x = torch.randn(3, 64, dtype=torch.float32).to(dtype)
    residual = torch.randn(3, 64, dtype=torch.float32).to(dtype)
    weight = (1 + 0.1 * torch.randn(64, dtype=torch.float32)).to(dtype)
    x_in, res_in = x.clone(), residual.clone()

    normed, new_res = fusedist.all_reduce_add_rmsnorm(x, residual, weight, eps)

    # Reference kept here on purpose (not rmsnorm_reference): fp32 math, rounded like the op.
    h = (x.float() + residual.float()).to(dtype)
    hf = h.float()
    ref = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * weight.float())
    assert normed.dtype == dtype and new_res.dtype == dtype
    assert normed.shape == (3, 64) and new_res.shape == (3, 64)
    assert torch.equal(new_res, h)
    assert count_bad(normed, ref, dtype, TOL_EPILOGUE) == 0
    assert torch.equal(x, x_in) and torch.equal(residual, res_in)
    # And the library's own reference agrees with ours.
    lib, _ = rmsnorm_reference(h, weight, eps)
    assert count_bad(lib, ref, dtype, TOL_EPILOGUE) == 0


@pytest.mark.parametrize("kw,match", [
    ({"max_bytes": 0}, "max_bytes must be a positive int"),
    ({"max_bytes": True}, "max_bytes must be a positive int"),
    ({"one_shot_max_bytes": -1}, "one_shot_max_bytes must be a positive int"),
    ({"staging_bytes": -1}, "staging_bytes must be an int >= 0"),
    ({"staging_bytes": 1.5}, "staging_bytes must be an int >= 0"),
])
def test_communicator_rejects_bad_sizes(rt, kw, match):
    with pytest.raises(ValueError, match=match):
        fusedist.Communicator(**kw)


class _FakeMPI:
    """mpi4py's MPI.COMM_WORLD for one rank (bcast returns what rank 0 sent)."""

    class COMM_WORLD:
        @staticmethod
        def Get_rank():
            return 0

        @staticmethod
        def bcast(obj, root=0):
            return obj


def test_mpi_bootstrap_across_nodes_never_offers_loopback(monkeypatch):
    """mpirun across nodes without MASTER_ADDR: rank 0 offers an address other nodes reach,
    not the 127.0.1.1 its hostname resolves to; with none to offer, every rank gets one line
    saying what to set."""
    import socket
    import sys
    import types

    from fusedist.distributed import runtime
    from fusedist.distributed.launch_env import detect_launch_env

    monkeypatch.setitem(sys.modules, "mpi4py", types.SimpleNamespace(MPI=_FakeMPI))
    env = detect_launch_env({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4",
                             "OMPI_COMM_WORLD_LOCAL_RANK": "0",
                             "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})
    monkeypatch.setattr(socket, "gethostbyname_ex", lambda n: (n, [], ["127.0.1.1"]))
    monkeypatch.setattr(runtime, "host_address", lambda: ("10.4.5.6", "default route"))
    addr, port = runtime._mpi_bootstrap_address(env)
    assert addr == "10.4.5.6" and 0 < port < 65536
    monkeypatch.setattr(runtime, "host_address", lambda: (None, "hostname vm resolves to "
                                                                "127.0.1.1 (loopback)"))
    with pytest.raises(fusedist.RendezvousError, match="127.0.1.1.*export MASTER_ADDR="):
        runtime._mpi_bootstrap_address(env)
    one_node = detect_launch_env({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2",
                                  "OMPI_COMM_WORLD_LOCAL_RANK": "0",
                                  "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})
    assert runtime._mpi_bootstrap_address(one_node)[0] == "127.0.0.1"


def test_rank_error_on_one_rank_stops_init():
    with pytest.raises(fusedist.CollectiveMismatchError,
                       match=r"rank 0 of 1 stopped before starting \(rank 0: --page-size"):
        fusedist.init(backend="gloo", rank=0, world_size=1, rank_error="--page-size must be >= 1")
    assert not fusedist.is_initialized() and not dist.is_initialized()
    with pytest.raises(TypeError, match="rank_error must be a message"):
        fusedist.init(backend="gloo", rank=0, world_size=1, rank_error=3)
