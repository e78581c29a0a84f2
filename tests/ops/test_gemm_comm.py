"""ag_gemm / gemm_rs / gemm_ar and fusedist.nn linears (tests/dist/worker_gemm_comm.py)."""

from __future__ import annotations

import json

import pytest

from launch import assert_passed, mpirun, mpirun_available, torchrun

CPU_ENV = {"CUDA_VISIBLE_DEVICES": ""}


@pytest.mark.timeout(600)
def test_gemm_comm_cpu_torchrun():
    assert_passed(torchrun("worker_gemm_comm.py", 2, CPU_ENV), 2)


@pytest.mark.timeout(600)
def test_gemm_comm_cpu_torchrun_3_ranks():
    """A world size above 2 (and odd) over real gloo ranks: every engine's CPU path, the
    linears' shards and the mismatch checks at 3 ranks."""
    assert_passed(torchrun("worker_gemm_comm.py", 3, CPU_ENV), 3)


@pytest.mark.timeout(600)
@pytest.mark.skipif(not mpirun_available(), reason="mpirun not installed")
def test_gemm_comm_cpu_mpirun_3_ranks():
    """The 3-rank checks through mpirun's bootstrap (mpi4py), less the torch.compile one: what
    dynamo traces does not depend on the launcher, and the torchrun test above runs it at the
    same world size (it was a third of this run's CPU time)."""
    assert_passed(mpirun("worker_gemm_comm.py", 3,
                         {**CPU_ENV, "FUSEDIST_TEST_SKIP": "every_op_under_torch_compile"}), 3)


@pytest.mark.gpu2
@pytest.mark.timeout(900)
def test_gemm_comm_gpu2():
    assert_passed(torchrun("worker_gemm_comm.py", 2, timeout=850), 2)


@pytest.mark.gpu2
@pytest.mark.timeout(900)
def test_gemm_comm_call_mismatch_gpu2():
    """Only the checks of ranks calling differently (fused decode gemm_ar, copy-engine and
    fused Hopper engines) and of uneven K shards, which must not count as a mismatch."""
    assert_passed(torchrun("worker_gemm_comm.py", 2, {"FUSEDIST_TEST_ONLY": "mismatch"},
                           timeout=850), 2)


# ---- dispatch helpers (no processes) ---------------------------------------------------------
import importlib  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import torch  # noqa: E402

from fusedist import _ext  # noqa: E402
from fusedist.ops.gemm_comm import base as eb  # noqa: E402
from fusedist.ops.gemm_comm import copy_engine as ce  # noqa: E402
from fusedist.ops.gemm_comm import fused_sm90 as fz  # noqa: E402
from fusedist.comm.communicator import Communicator  # noqa: E402
from fusedist.ops import gemm_comm as gc  # noqa: E402

gm = importlib.import_module("fusedist.ops.gemm")  # the module; fusedist.ops.gemm is the function

TABLE = {"gemm_comm": {"gemm_ar": {"min_mnk": 1 << 38, "chunks": 2, "fused_max_m": 32},
                       "ag_gemm": {"min_mnk": 1 << 35}}}


def _comm(world=2, device="cuda", staging=0, symm=True):
    s = SimpleNamespace(staging_bytes=staging) if symm else None
    return SimpleNamespace(device=torch.device(device),
                           group=SimpleNamespace(size=world, name="tp"), table=TABLE, symm=s)


def test_weight_layouts():
    w = torch.empty(64, 40)
    assert gm.weight_layout(w) == (False, 40)                     # [K, N] row-major
    assert gm.weight_layout(torch.empty(40, 64).t()) == (True, 64)  # nn.Linear weight .t()
    assert gm.weight_layout(torch.empty(64, 80)[:, ::2]) is None   # strided columns
    assert gm.weight_layout(torch.empty(64, 44)[:, :40]) is None   # row stride not a multiple of 8


@pytest.mark.parametrize("m,why_not,engine", [
    (1, None, "fused"), (32, None, "fused"), (33, None, "unfused"), (1, "dtype", "unfused")])
def test_engine_auto_for_decode_gemm_ar(monkeypatch, m, why_not, engine):
    monkeypatch.delenv("FUSEDIST_GEMM_ENGINE", raising=False)
    assert gc.pick("gemm_ar", "auto", m, 8192, 4096, _comm(), why_not) == engine


def test_engine_env_fused_only_where_it_applies(monkeypatch):
    monkeypatch.setenv("FUSEDIST_GEMM_ENGINE", "fused")
    assert gc.pick("gemm_ar", "auto", 64, 8192, 4096, _comm(), None) == "fused"
    # Where the fused kernel does not take the call, the table decides (overlap from 2^35).
    assert gc.pick("ag_gemm", "auto", 8192, 8192, 8192, _comm(), "no staging") == "overlap"
    monkeypatch.setenv("FUSEDIST_GEMM_ENGINE", "unfused")
    assert gc.pick("gemm_ar", "auto", 1, 8192, 4096, _comm(), None) == "unfused"
    monkeypatch.setenv("FUSEDIST_GEMM_ENGINE", "warp-drive")
    with pytest.raises(ValueError, match="FUSEDIST_GEMM_ENGINE"):
        gc.pick("gemm_ar", "auto", 1, 8192, 4096, _comm(), None)


def test_engine_auto_warns_once_at_an_unmeasured_world_size(monkeypatch, recwarn):
    monkeypatch.delenv("FUSEDIST_GEMM_ENGINE", raising=False)
    comm = _comm(world=8)
    comm.name = "tp/0"
    comm.table = {"gemm_comm": {**TABLE["gemm_comm"], "measured_worlds": [2]}}
    for m in (1, 2, 4096):
        gc.pick("gemm_ar", "auto", m, 8192, 4096, comm, None)
    got = [str(w.message) for w in recwarn if "measured at world size 2, not 8" in str(w.message)]
    assert len(got) == 1 and got[0].startswith("fusedist (tp/0):")
    ok = _comm(world=2)
    ok.table = comm.table
    gc.pick("gemm_ar", "auto", 1, 8192, 4096, ok, None)
    gc.pick("gemm_ar", "unfused", 1, 8192, 4096, comm, None)  # no table consulted
    assert len(recwarn) == 1


def test_engine_fused_forced_names_the_reason():
    with pytest.raises(ValueError, match="M = 200 rows"):
        gc.pick("gemm_ar", "fused", 200, 8192, 4096, _comm(), "M = 200 rows (at most 128)")
    with pytest.raises(ValueError, match="create fusedist.Communicator.staging_bytes"):
        gc.pick("gemm_rs", "fused", 8192, 8192, 8192, _comm(),
                   "the partial products live in symmetric staging; create "
                   "fusedist.Communicator(staging_bytes>=134217728)")


def test_engine_single_rank_or_cpu_is_unfused():
    assert gc.pick("gemm_ar", "fused", 1, 8192, 4096, _comm(world=1), None) == "unfused"
    assert gc.pick("gemm_ar", "auto", 1, 8192, 4096, _comm(device="cpu"), None) == "unfused"


def test_fused_kernels_do_not_take_an_empty_problem():
    """An empty batch never reaches a fused kernel (gemm_ar's auto picked it at M = 0)."""
    bf = torch.bfloat16
    for x, w in ((torch.empty(0, 64, dtype=bf), torch.empty(64, 48, dtype=bf)),
                 (torch.empty(4, 0, dtype=bf), torch.empty(0, 48, dtype=bf)),
                 (torch.empty(4, 64, dtype=bf), torch.empty(64, 0, dtype=bf))):
        why = eb.fused_common_why_not(_comm(), x, w)
        assert why is not None and "empty problem" in why, (x.shape, w.shape, why)


def test_ag_transport_choice():
    x = torch.empty(128, 64, dtype=torch.bfloat16)  # 16 KiB shard
    need = eb.staging_need("ag_gemm", x, 8)
    assert need == 16384
    assert eb.resolve_transport("ag_gemm", _comm(staging=16384), need, "auto") == "copy_engine"
    assert eb.resolve_transport("ag_gemm", _comm(staging=16383), need, "auto") == "collective"
    assert eb.resolve_transport("ag_gemm", _comm(symm=False), need, "auto") == "collective"
    for name in ("nccl", "collective"):  # "nccl" names ag_gemm's collective too
        assert eb.resolve_transport("ag_gemm", _comm(staging=1 << 20), need, name) == \
            "collective"
    with pytest.raises(ValueError, match=r"staging_bytes>=16384"):
        eb.resolve_transport("ag_gemm", _comm(staging=0), need, "copy_engine")


def test_rs_transport_choice():
    assert eb.resolve_transport("gemm_rs", _comm(staging=1 << 20), 1 << 20, "auto") == "copy_engine"
    assert eb.resolve_transport("gemm_rs", _comm(staging=1 << 20), (1 << 20) + 1, "auto") == \
        "collective"
    with pytest.raises(ValueError, match="gemm_rs: transport='copy_engine' needs"):
        eb.resolve_transport("gemm_rs", _comm(staging=0), 64, "copy_engine")


def test_ar_transport_choice_falls_back_to_the_collective():
    assert eb.resolve_transport("gemm_ar", _comm(staging=64), 64, "auto") == "copy_engine"
    assert eb.resolve_transport("gemm_ar", _comm(staging=63), 64, "auto") == "collective"
    assert eb.resolve_transport("gemm_ar", _comm(staging=64), 64, "collective") == \
        "collective"


@pytest.mark.parametrize("chunks,rows,want", [(3, 10, 3), (3, 2, 2), (3, 0, 1), (5, None, 5)])
def test_explicit_chunks_are_clamped_to_the_rows(chunks, rows, want):
    assert eb.depth("gemm_rs", chunks, _comm(), 64, 64, 64, rows=rows) == want


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "2"])
def test_bad_chunks_are_rejected(bad):
    with pytest.raises(ValueError, match="chunks must be a positive int"):
        eb.depth("gemm_rs", bad, _comm(), 64, 64, 64)


def test_chunks_as_row_counts_only_for_the_copy_engine():
    with pytest.raises(ValueError, match="copy-engine overlap only"):
        eb.depth("gemm_rs", [2, 2], _comm(), 64, 64, 64)


@pytest.mark.parametrize("chunks", [[3, 4], [8, 0], [4, True, 3], [], (2.0, 6)])
def test_bad_row_counts_name_the_sum(chunks):
    with pytest.raises(ValueError, match=r"sum to M / world \(8\)"):
        eb.row_bounds("gemm_rs", chunks, _comm(), 16, 64, 64, 8, "M / world")


def test_row_counts_are_taken_as_given_and_ints_cut_by_the_wave_model():
    assert eb.row_bounds("gemm_ar", (5, 1, 2), _comm(), 8, 64, 64, 8, "M") == [0, 5, 6, 8]
    comm = _comm()
    comm.table = {"gemm_comm": {"waves": {"tile_m": 128, "tile_n": 256, "sms": 132},
                                "gemm_rs": {"ce_chunks": 2, "ce_min_piece_rows": 256}}}
    assert eb.row_bounds("gemm_rs", None, comm, 4096, 14336, 8192, 2048, "M / world",
                         wave_cols=14336) == [0, 896, 2048]
    assert eb.row_bounds("gemm_rs", None, comm, 4096, 14336, 8192, 2048, "M / world") == \
        [0, 1024, 2048]  # no wave_cols: even
    assert eb.row_bounds("gemm_rs", 2, comm, 4096, 8192, 8192, 2048, "M / world",
                         wave_cols=8192) == [0, 1024, 2048]


@pytest.mark.parametrize("w_nk", [False, True])
def test_misaligned_weight_gets_an_aligned_copy_in_its_layout(w_nk):
    base = torch.randn(64 * 48 + 1, dtype=torch.bfloat16)[1:]  # starts 2 bytes off
    w = base.view(48, 64).t() if w_nk else base.view(64, 48)   # [K=64, N=48] either way
    assert w.data_ptr() % 16 and gm.weight_layout(w)[0] == w_nk
    a = gm.aligned_weight(w, w_nk)
    assert a.data_ptr() % 16 == 0 and torch.equal(a, w)
    assert gm.weight_layout(a) == gm.weight_layout(w)


@pytest.mark.parametrize("n,parts", [(10, 3), (2, 4), (0, 2), (601, 2), (7, 1)])
def test_split_covers_the_range_in_order(n, parts):
    b = eb.split(n, parts)
    assert len(b) == parts + 1 and b[0] == 0 and b[-1] == n
    sizes = [b[i + 1] - b[i] for i in range(parts)]
    assert min(sizes) >= 0 and max(sizes) - min(sizes) <= 1


def test_gemm_ar_transport_is_validated_before_anything_else():
    x = torch.empty(4, 8)
    with pytest.raises(ValueError, match=r"gemm_ar: transport must be one of .*collective"):
        gc.gemm_ar(x, torch.empty(8, 8), transport="nccl")


def test_copy_engine_pipeline_depth_comes_from_ce_chunks():
    table = {"gemm_comm": {"gemm_ar": {"chunks": 3, "ce_chunks": 5}}}
    assert gc.tuning.gemm_chunks(table, "gemm_ar", 4096, 8192, 4096, 2) == 3
    assert gc.tuning.gemm_chunks(table, "gemm_ar", 4096, 8192, 4096, 2, copy_engine=True) == 5
    assert gc.tuning.gemm_chunks({}, "gemm_rs", 4096, 8192, 4096, 2, copy_engine=True) == 2


@pytest.mark.parametrize("m,world,chunks", [(4096, 2, 2), (1024, 2, 2), (1023, 2, 1), (512, 2, 1),
                                            (8, 2, 1), (4096, 8, 2), (2048, 8, 1)])
def test_copy_engine_chunks_keep_pieces_of_256_rows(m, world, chunks):
    """Each chunk is `world` GEMM pieces; none below 256 rows (weight-bandwidth bound)."""
    assert gc.tuning.gemm_chunks({}, "gemm_ar", m, 8192, 4096, world, copy_engine=True) == chunks


@pytest.mark.parametrize("m,chunks", [(2048, 2), (3072, 3), (4096, 4), (8192, 4)])
def test_shipped_table_gemm_ar_copy_engine_chunks(m, chunks):
    """The H200 x2 table: 4 chunks for gemm_ar's copy-engine pipeline, but no GEMM piece below
    512 rows (one wave of the N = 8192 GEMM), so 2 chunks at M = 2048."""
    table = json.loads(gc.tuning._DEFAULT.read_text())
    assert gc.tuning.gemm_chunks(table, "gemm_ar", m, 8192, 4096, 2, copy_engine=True) == chunks



# ---- fused gemm_rs: the counts the comm stream waits for ---------------------------------------
def _kernel_signals(W, m, n, pieces, bm=128, bn=256):
    """What the peer-block GEMMs of every rank signal (ChunkSignal in gemm_sm90.cuh, launched by
    _rs_fused), walked row by row: {(owner block, source rank, piece): count}."""
    M, pr = W * m, -(-m // pieces)
    counts = {}
    for s in range(W):
        for a, b in (((s + 1) * m, M), (0, s * m)):
            for t in range(-(-(b - a) // bm) if b > a else 0):
                r0, r1 = a + t * bm, min(a + (t + 1) * bm, b)
                for key in {(row // m, s, (row % m) // pr) for row in range(r0, r1)}:
                    counts[key] = counts.get(key, 0) + -(-n // bn)
    return counts


@pytest.mark.parametrize("W", [2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 5, 37, 127, 128, 129, 300, 1031])
@pytest.mark.parametrize("pieces", [1, 2, 3, 4])
def test_rs_fused_expected_counts_match_the_kernels_signals(W, m, pieces):
    if pieces > m:
        pytest.skip("pieces are at most the block's rows")
    C = SimpleNamespace(GEMM_SM90_BLOCK_M=128, GEMM_SM90_BLOCK_N=256)
    n = 520  # 3 N tiles, the last partial
    got = _kernel_signals(W, m, n, pieces)
    assert all(owner != src for owner, src, _ in got), "a rank signalled its own block"
    pr = -(-m // pieces)
    for r in range(W):
        for s in range(W):
            if s == r:
                continue
            for p in range(pieces):
                lo, hi = min(p * pr, m), min((p + 1) * pr, m)
                want = fz._rs_signal_expected(C, r, s, m, W * m, n, r * m + lo, r * m + hi) \
                    if hi > lo else 0
                assert got.get((r, s, p), 0) == want, (r, s, p)


def test_rs_fused_default_pieces_follow_the_gemm_waves():
    assert [fz._rs_fused_pieces(m) for m in (1, 1024, 2048, 4096, 8192, 1 << 16)] == \
        [1, 1, 1, 2, 4, 8]


def test_extension_exports_the_tile_the_counts_assume():
    C = pytest.importorskip("fusedist._C")
    assert (C.GEMM_SM90_BLOCK_M, C.GEMM_SM90_BLOCK_N) == (128, 256)
    assert C.MAX_SIGNAL_PIECES >= 8


def test_fused_prefill_engines_name_what_they_lack(monkeypatch):
    """ag_gemm and gemm_rs engine='fused': each reason names the fix (shapes only, so every
    rank gets the same answer)."""
    monkeypatch.setattr(fz, "sm90_available", lambda device: True)
    x = torch.empty(256, 64, dtype=torch.bfloat16)
    w = torch.empty(64, 32, dtype=torch.bfloat16)
    need = 256 * 32 * 2  # gemm_rs: the [M, N] partials
    assert fz._fused_rs_why_not(_comm(staging=need), x, w) is None
    why = fz._fused_rs_why_not(_comm(staging=need - 1), x, w)
    assert f"staging_bytes>={need}" in why and "M x N" in why
    assert fz._fused_ag_why_not(_comm(staging=2 * 256 * 64 * 2), x, w) is None
    assert "staging_bytes>=65536" in fz._fused_ag_why_not(_comm(staging=65535), x, w)
    assert "symmetric memory" in fz._fused_rs_why_not(_comm(symm=False), x, w)
    assert "bfloat16 or float16" in fz._fused_rs_why_not(_comm(staging=1 << 30), x.float(),
                                                         w.float())
    assert "empty problem" in fz._fused_rs_why_not(_comm(staging=1 << 30), x[:0], w)
    monkeypatch.setattr(fz, "sm90_available", lambda device: False)
    assert "not a Hopper" in fz._fused_rs_why_not(_comm(staging=1 << 30), x, w)


# ---- the copy-engine pipelines for 2..8 ranks, emulated on the CPU --------------------------
# Each rank is a thread running the real pipeline code (_rs_copy_engine, _ar_copy_engine) with
# host buffers as its symmetric staging. Copy-engine copies are memmoves between real
# addresses, device barriers are a thread barrier, and gemm_ar's closing kernel is emulated
# step for step (push, tokens, copy). Every stream runs in program order, which is stronger
# than CUDA's ordering: this checks the dataflow (which rows go where, offsets, the W - 1
# partial sums), not the concurrency or the CUDA kernel. Only 2 GPUs were ever available, so
# these are the only runs of the W > 2 paths.
import contextlib  # noqa: E402
import ctypes  # noqa: E402
import threading  # noqa: E402

from fusedist.comm import symmetric  # noqa: E402
from fusedist.errors import CollectiveMismatchError  # noqa: E402

from tolerances import GEMM_REL, gemm_err  # noqa: E402


class _Stream:
    cuda_stream = 0
    device = torch.device("cpu")

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass


class _Event:
    def record(self, stream=None):
        pass


class _World:
    """W ranks' staging buffers and the barrier their device barriers meet at. A device
    barrier is a call check: every rank posts its call descriptor and compares every peer's
    with its own, as call_check.cuh does, raising CollectiveMismatchError on a difference.
    `checks[r]` lists rank r's descriptors in order, `pulls[r]` its reads of a peer's buffer
    (with the number of call checks passed before each)."""

    def __init__(self, W, staging_bytes, offset=64):
        self.W = W
        self.offset = offset  # staging starts this far into each rank's buffer
        self.bufs = [torch.zeros(offset + staging_bytes, dtype=torch.uint8) for _ in range(W)]
        self.bases = [b.data_ptr() for b in self.bufs]
        self.barrier = threading.Barrier(W, timeout=20)
        self.checks = [[] for _ in range(W)]
        self.pulls = [[] for _ in range(W)]
        self._posted = [None] * W

    def call_check(self, rank, desc):
        self.checks[rank].append(tuple(desc))
        self._posted[rank] = tuple(desc)
        self.barrier.wait()
        seen = list(self._posted)
        self.barrier.wait()  # every rank read every descriptor before the next check posts
        for p, theirs in enumerate(seen):
            if theirs != tuple(desc):
                raise CollectiveMismatchError(
                    f"rank {rank} called {symmetric.describe_desc(_decoded(desc))}, rank {p} "
                    f"called {symmetric.describe_desc(_decoded(theirs))}")

    def owner(self, addr):
        for r, b in enumerate(self.bufs):
            if b.data_ptr() <= addr < b.data_ptr() + b.numel():
                return r
        return None


def _decoded(desc):
    return symmetric.decode_desc(symmetric.desc_words(desc, 0))


class _Symm:
    def __init__(self, world, rank):
        self.world, self.rank = world, rank
        self.bases = world.bases
        self.staging_offset = world.offset
        self.handle = rank

    def before_launch(self):
        pass

    def staging(self, dtype, shape, offset=0):
        n = 1
        for s in shape:
            n *= s
        es = torch.empty((), dtype=dtype).element_size()
        lo = self.staging_offset + offset
        return self.world.bufs[self.rank][lo:lo + n * es].view(dtype).view(shape)


class _C:
    """The extension calls the pipelines make, on host memory."""

    def __init__(self, world):
        self.world = world

    def memcpy_async(self, dst, src, nbytes, stream):
        w = self.world
        me, frm = w.owner(dst), w.owner(src)
        if frm is not None and me is not None and frm != me:
            w.pulls[me].append((frm, len(w.checks[me])))
        ctypes.memmove(dst, src, nbytes)

    def gemm_ar_staging_gather(self, rank, staging_offset, bounds, row_bytes, out, desc,
                               stream):
        # staging_gather_kernel: push own rows to out and every peer's staging, meet (block 0
        # also compares the call descriptors), copy the peers' rows from local staging to out.
        w = self.world
        lo, hi = bounds[rank], bounds[rank + 1]
        n = (hi - lo) * row_bytes
        if n:
            src = w.bases[rank] + staging_offset + lo * row_bytes
            ctypes.memmove(out + lo * row_bytes, src, n)
            for p in range(w.W):
                if p != rank:
                    ctypes.memmove(w.bases[p] + staging_offset + lo * row_bytes, src, n)
        w.call_check(rank, desc)  # the tokens, and block 0's descriptor check
        for q in range(w.W):
            a, b = bounds[q], bounds[q + 1]
            if q != rank and b > a:
                ctypes.memmove(out + a * row_bytes,
                               w.bases[rank] + staging_offset + a * row_bytes,
                               (b - a) * row_bytes)
        w.barrier.wait()  # nobody starts a later call before every copy is done


@pytest.fixture
def emulated(monkeypatch):
    """Patches the CUDA stream / event plumbing gemm_comm uses, and yields a function that
    runs fn(comm, rank) on W threads and returns their results."""
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    for mod in (eb, ce):
        monkeypatch.setattr(mod, "comm_stream", lambda device=None, index=0: _Stream())

    def run(W, staging_bytes, fn, c_class=None, world_out=None):
        """fn(comm, rank) on W threads; their results. With world_out (a list), the _World is
        appended to it and exceptions are returned per rank instead of failing the test."""
        world = _World(W, staging_bytes)
        ext = (c_class or _C)(world)
        monkeypatch.setattr(_ext, "load", lambda: ext)
        results, errors = [None] * W, []

        def one(r):
            comm = Communicator.__new__(Communicator)
            comm.group = type("G", (), {"size": W, "rank": r})()
            comm.symm = _Symm(world, r)
            comm.device_barrier = lambda desc: world.call_check(r, desc)
            try:
                results[r] = fn(comm, r)
            except CollectiveMismatchError as e:
                results[r] = e
                if world_out is None:
                    errors.append(e)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)
                world.barrier.abort()

        threads = [threading.Thread(target=one, args=(r,)) for r in range(W)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        if world_out is not None:
            world_out.append(world)
        else:
            # Matched calls: every rank passed the same call checks, in the same order.
            assert all(c == world.checks[0] for c in world.checks), world.checks
        return results

    return run


def _inputs(W, M, k, n, seed):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(M, k, generator=g) for _ in range(W)]
    ws = [torch.randn(k, n, generator=g) for _ in range(W)]
    return xs, ws, sum(x.double() @ w.double() for x, w in zip(xs, ws))


def _bounds(rows, chunks):
    """Even bounds for an int, the running sum of row counts for a list (uneven chunks)."""
    if isinstance(chunks, int):
        return eb.split(rows, chunks)
    return [sum(chunks[:i]) for i in range(len(chunks) + 1)]


@pytest.mark.parametrize("W", [2, 3, 4, 8])
@pytest.mark.parametrize("M,chunks", [(1, 1), (7, 3), (37, 2), (64, 4), (101, 5),
                                      (37, [30, 7]), (64, [9, 40, 15])])
@pytest.mark.parametrize("n", [12, 10])  # 48-byte rows: closing kernel; 40-byte: copy engine
def test_gemm_ar_copy_engine_pipeline(emulated, W, M, chunks, n):
    k = 9
    xs, ws, ref = _inputs(W, M, k, n, seed=W * 1000 + M * 10 + len(str(chunks)))

    def fn(comm, r):
        out = torch.full((M, n), float("nan"))
        return ce._ar_copy_engine(comm, xs[r], ws[r], out, _Stream(), _bounds(M, chunks))

    outs = emulated(W, M * n * 4, fn)
    for r, y in enumerate(outs):
        assert torch.equal(y, outs[0]), f"rank {r} differs from rank 0"
    err = gemm_err(outs[0], ref)
    assert err < GEMM_REL[torch.float32], err


@pytest.mark.parametrize("W", [2, 3, 4, 8])
@pytest.mark.parametrize("m,chunks", [(1, 1), (5, 2), (16, 3), (33, 7), (33, [20, 13]),
                                      (16, [1, 10, 5])])
def test_gemm_rs_copy_engine_pipeline(emulated, W, m, chunks):
    k, n = 11, 6
    xs, ws, ref = _inputs(W, W * m, k, n, seed=W * 100 + m + len(str(chunks)))

    def fn(comm, r):
        out = torch.full((m, n), float("nan"))
        return ce._rs_copy_engine(comm, xs[r], ws[r], out, _Stream(),
                                  _bounds(m, min(chunks, m) if isinstance(chunks, int) else chunks))

    outs = emulated(W, W * m * n * 4, fn)
    for r, y in enumerate(outs):
        block = ref[r * m:(r + 1) * m]
        err = gemm_err(y, block)
        assert err < GEMM_REL[torch.float32], (r, err)


@pytest.mark.parametrize("W", [2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 5, 33])
def test_ag_copy_engine_pull(emulated, W, m):
    """ag_gemm's copy-engine all-gather: every rank's gathered input holds every shard in rank
    order (its own rows are multiplied from x_shard directly, so they stay untouched here)."""
    k = 7
    g = torch.Generator().manual_seed(W * 10 + m)
    shards = [torch.randn(m, k, generator=g) for _ in range(W)]

    def fn(comm, r):
        gathered = torch.full((W * m, k), float("nan"))
        gathered[r * m:(r + 1) * m] = shards[r]
        events = ce._ag_pull(comm, shards[r], gathered, _Stream())
        assert sorted(j for j, _ in events) == [j for j in range(W) if j != r]
        return gathered

    for r, got in enumerate(emulated(W, m * k * 4, fn)):
        assert torch.equal(got, torch.cat(shards)), f"rank {r}"


@pytest.mark.parametrize("W", [2, 3, 8])
def test_ag_copy_engine_pull_staged_by_the_caller(emulated, W):
    """ag_gemm stages the shard on its own stream (_ag_stage) and forks the pull after it
    (stage=False): every rank still gathers every shard."""
    m, k = 5, 7
    g = torch.Generator().manual_seed(W)
    shards = [torch.randn(m, k, generator=g) for _ in range(W)]

    def fn(comm, r):
        gathered = torch.full((W * m, k), float("nan"))
        gathered[r * m:(r + 1) * m] = shards[r]
        ce._ag_stage(comm, shards[r], _Stream())
        ce._ag_pull(comm, shards[r], gathered, _Stream(), stage=False)
        return gathered

    for r, got in enumerate(emulated(W, m * k * 4, fn)):
        assert torch.equal(got, torch.cat(shards)), f"rank {r}"


def _mismatch_cases():
    """(what, a function of rank -> the pipeline call) for calls that differ across ranks."""
    k, n = 9, 12

    def rs(m, chunks=1):
        def go(comm, r, W):
            x = torch.randn(W * m, k)
            return ce._rs_copy_engine(comm, x, torch.randn(k, n), torch.empty(m, n), _Stream(),
                                      eb.split(m, chunks))
        return go

    def ar(M, n_=n, chunks=1):
        def go(comm, r, W):
            return ce._ar_copy_engine(comm, torch.randn(M, k), torch.randn(k, n_),
                                      torch.empty(M, n_), _Stream(), eb.split(M, chunks))
        return go

    def ag(m):
        def go(comm, r, W):
            x = torch.randn(m, k)
            return ce._ag_pull(comm, x, torch.empty(W * m, k), _Stream())
        return go

    return {
        "gemm_rs, another M": lambda r: rs(8 + r),
        "gemm_rs, other chunks": lambda r: rs(8, 1 + r),
        "gemm_ar, another N": lambda r: ar(16, n + 4 * r),
        "gemm_ar, other chunks": lambda r: ar(16, chunks=2 + r),
        "ag_gemm, another shard": lambda r: ag(5 + r),
        "ag_gemm against gemm_rs": lambda r: ag(8) if r == 0 else rs(8),
        "gemm_ar against ag_gemm": lambda r: ar(16) if r == 0 else ag(8),
    }


@pytest.mark.parametrize("W", [2, 3])
@pytest.mark.parametrize("case", list(_mismatch_cases()))
def test_copy_engine_pipelines_check_the_call_before_any_pull(emulated, W, case):
    """Ranks in different copy-engine calls (another shape, other chunks, another op): the
    first call check carries each rank's descriptor, every rank raises CollectiveMismatchError
    there, naming both calls, and no rank has read a peer's staging yet."""
    make = _mismatch_cases()[case]
    worlds = []
    outs = emulated(W, 1 << 16, lambda comm, r: make(r)(comm, r, W), world_out=worlds)
    world = worlds[0]
    for r, y in enumerate(outs):
        assert isinstance(y, CollectiveMismatchError), (r, y)
        assert len(world.checks[r]) == 1, f"rank {r} passed {len(world.checks[r])} checks"
        assert world.pulls[r] == [], f"rank {r} pulled before the check: {world.pulls[r]}"
    assert "called" in str(outs[0])


class _NcclLog:
    """A NcclComm stand-in for one rank of W: records each call in `log` (after whatever the
    call check recorded there) and fills the output as rank 0 of identical ranks would."""

    def __init__(self, log, W):
        self.log, self.W = log, W

    def all_gather(self, x, out):
        self.log.append(("nccl all_gather", x.numel()))
        return out.copy_(x.reshape(1, -1).expand(self.W, -1).reshape(out.shape))

    def reduce_scatter(self, x, out):
        self.log.append(("nccl reduce_scatter", x.numel()))
        return out.copy_(x.reshape(self.W, -1)[0].reshape(out.shape) * self.W)


@pytest.mark.parametrize("engine", ["unfused", "overlap"])
@pytest.mark.parametrize("op", ["ag_gemm", "gemm_rs"])
def test_nccl_collectives_of_the_gemm_ops_are_checked_first(emulated, monkeypatch, engine, op):
    """ag_gemm / gemm_rs through NCCL (unfused, overlap): a call check carrying what NCCL is
    about to be asked (collective, input elements, the overlap engine's NCCL calls) comes
    before the first NCCL call, once per op call."""
    from fusedist.ops.gemm_comm import overlap as ov
    from fusedist.ops.gemm_comm import unfused as uf

    W, m, k, n, chunks = 2, 6, 8, 5, 3
    log = []
    comm = Communicator.__new__(Communicator)
    comm.group = SimpleNamespace(size=W, rank=0, name="tp")
    comm.device = torch.device("cuda")  # the GPU paths, run on CPU tensors with fake streams
    comm.nccl = comm.nccl_overlap = _NcclLog(log, W)
    comm.check_nccl_call = lambda coll, dtype, numel, calls=1: log.append(
        ("call check", symmetric.nccl_desc(coll, _dtypes_code(dtype), numel, calls)))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: _Stream())
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: None)
    monkeypatch.setattr(ov, "split", eb.split)
    x = torch.randn(m if op == "ag_gemm" else W * m, k, dtype=torch.bfloat16)
    w = torch.randn(k, n, dtype=torch.bfloat16)
    out = torch.empty((W * m if op == "ag_gemm" else m), n, dtype=torch.bfloat16)
    call = eb.Call(op, comm, x, w, None, out, chunks if op == "gemm_rs" else None, "collective")
    (uf.ENGINE if engine == "unfused" else ov.ENGINE).run(call)
    if op == "ag_gemm":
        want = [("call check", symmetric.nccl_desc("all_gather", 2, m * k)),
                ("nccl all_gather", m * k)]
    elif engine == "unfused":
        want = [("call check", symmetric.nccl_desc("reduce_scatter", 2, W * m * n)),
                ("nccl reduce_scatter", W * m * n)]
    else:  # one check for the three chunks' reduce-scatters
        want = [("call check", symmetric.nccl_desc("reduce_scatter", 2, W * m * n, calls=3))] + \
            [("nccl reduce_scatter", W * 2 * n)] * 3
    assert log == want


def _dtypes_code(dtype):
    from fusedist import _dtypes

    return _dtypes.code(dtype)


class _Signals:
    """The fused gemm_rs's per-rank counters [owner][src][piece], signalled the way the
    sm90 GEMM's tiles do (one add per N tile of every BLOCK_M row tile, per piece it touches)
    and waited for / cleared by the owner's comm stream."""

    def __init__(self, bm, bn):
        self.bm, self.bn = bm, bn
        self.count = {}
        self.cv = threading.Condition()

    def signal(self, src, row0, rows, n, m, pieces):
        pr = -(-m // pieces)
        with self.cv:
            for t0 in range(0, rows, self.bm):
                touched = {((row0 + i) // m, ((row0 + i) % m) // pr)
                           for i in range(t0, min(t0 + self.bm, rows))}
                for owner, piece in touched:
                    key = (owner, src, piece)
                    self.count[key] = self.count.get(key, 0) + -(-n // self.bn)
            self.cv.notify_all()

    def wait_clear(self, owner, src, piece, expected):
        key = (owner, src, piece)
        with self.cv:
            assert self.cv.wait_for(lambda: self.count.get(key, 0) >= expected, timeout=20), \
                f"counter {key} reached {self.count.get(key, 0)} of {expected}"
            assert self.count[key] == expected, (key, self.count[key], expected)
            self.count[key] = 0


@pytest.mark.parametrize("W", [2, 3, 4, 8])
@pytest.mark.parametrize("m,pieces", [(1, 1), (5, 2), (37, 3), (300, 4)])
def test_gemm_rs_fused_orchestration(emulated, monkeypatch, W, m, pieces):
    """_rs_fused's host side for 2..8 ranks: the peer-block GEMMs (emulated, signalling per
    tile like the kernel), the comm stream's counter waits with _rs_signal_expected's counts,
    the pulls, and the own block's GEMM with the pulled partials as C. Afterwards every counter
    is back to zero."""
    bm, bn = 128, 256
    k, n = 9, 300  # two N tiles, the second partial
    sig = _Signals(bm, bn)

    def fake_sm90(x, w, bias, out, stream, accumulate=False, comm=None, flags=None,
                  block_rows=0, pieces=1, wait_on_c=False, wait_peer=-1, signal_row0=None,
                  signal_block_rows=0, signal_pieces=0):
        if wait_on_c:
            assert bool((flags == 1).all()), "C read before every piece was flagged"
        y = x @ w + (out if accumulate else 0) + (bias if bias is not None else 0)
        out.copy_(y)
        if signal_row0 is not None:
            sig.signal(comm.group.rank, signal_row0, x.shape[0], w.shape[1], signal_block_rows,
                       signal_pieces)
        return out

    class _CF(_C):
        GEMM_SM90_BLOCK_M, GEMM_SM90_BLOCK_N, MAX_SIGNAL_PIECES = bm, bn, 64

        def gemm_rs_counter_wait(self, rank, offset, src, piece, expected, stream):
            sig.wait_clear(rank, src, piece, expected)

        def stream_write_u32(self, ptr, value, stream):
            ctypes.c_uint32.from_address(ptr).value = value

    monkeypatch.setattr(fz, "launch_sm90", fake_sm90)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: None)
    xs, ws, ref = _inputs(W, W * m, k, n, seed=W * 7 + m + pieces)
    b = torch.randn(n, generator=torch.Generator().manual_seed(5))

    def fn(comm, r):
        comm.launch_stream = lambda: _Stream()
        comm.symm.signal_offset = 0
        out = torch.full((m, n), float("nan"))
        return fz._rs_fused(comm, xs[r], ws[r], b, out, pieces)

    outs = emulated(W, W * m * n * 4, fn, c_class=_CF)
    for r, y in enumerate(outs):
        block = ref[r * m:(r + 1) * m] + b.double()
        err = gemm_err(y, block)
        assert err < GEMM_REL[torch.float32], (r, err)
    assert all(v == 0 for v in sig.count.values()), sig.count


@pytest.mark.parametrize("W", [2, 3, 4, 8])
@pytest.mark.parametrize("m,pieces", [(1, 1), (5, 2), (37, 3)])
def test_ag_gemm_fused_orchestration(emulated, monkeypatch, W, m, pieces):
    """_ag_fused's host side for 2..8 ranks: every rank's block staged at the same rows, the
    peers' blocks pulled piece by piece into this rank's staging with a flag each, and the GEMM
    (emulated) over the gathered rows once every flag is set."""
    k, n = 9, 5
    g = torch.Generator().manual_seed(W * 3 + m + pieces)
    shards = [torch.randn(m, k, generator=g) for _ in range(W)]
    w = torch.randn(k, n, generator=g)
    b = torch.randn(n, generator=g)

    def fake_sm90(x, w_, bias, out, stream, accumulate=False, comm=None, flags=None,
                  block_rows=0, pieces=1, **kw):
        assert flags is not None and bool((flags == 1).all()), "a piece was never flagged"
        return out.copy_(x @ w_ + bias)

    class _CF(_C):
        def stream_write_u32(self, ptr, value, stream):
            ctypes.c_uint32.from_address(ptr).value = value

    monkeypatch.setattr(fz, "launch_sm90", fake_sm90)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: None)

    def fn(comm, r):
        comm.launch_stream = lambda: _Stream()
        out = torch.full((W * m, n), float("nan"))
        return fz._ag_fused(comm, shards[r], w, b, out, pieces)

    ref = torch.cat(shards).double() @ w.double() + b.double()
    for r, y in enumerate(emulated(W, W * m * k * 4, fn, c_class=_CF)):
        assert gemm_err(y, ref) < GEMM_REL[torch.float32], r


# ---- the hierarchical engine's dispatch (groups that span nodes) ------------------------------
from fusedist.ops.gemm_comm import dispatch as gd  # noqa: E402
from fusedist.ops.gemm_comm import hierarchical as gh  # noqa: E402


def _call(device="cpu", hier=True, symm=False, chunks=None, transport="collective"):
    from fusedist.distributed.groups import Group
    from fusedist.distributed.topology import Topology

    nodes = ("a", "a", "b", "b") if hier else ("a",) * 4
    group = Group("tp", (0, 1, 2, 3), None, torch.device(device), Topology(4, 0, nodes))
    comm = SimpleNamespace(device=torch.device(device), group=group, table=TABLE,
                           symm=SimpleNamespace(staging_bytes=0) if symm else None, name="tp/0")
    x, w = torch.empty(8, 16), torch.empty(16, 24)
    return eb.Call("gemm_ar", comm, x, w, None, torch.empty(8, 24), chunks, transport,
                   object() if hier else None)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_auto_takes_the_hierarchical_engine_on_a_group_that_spans_nodes(device):
    assert gd.choose(_call(device), "auto") is gh.ENGINE
    assert gd.choose(_call(device), "hierarchical") is gh.ENGINE
    assert gd.choose(_call("cpu"), "unfused").name == "unfused"   # the flat reference path


def test_hierarchical_engine_needs_two_levels():
    with pytest.raises(ValueError, match="engine='hierarchical' does not take this call: it runs "
                                         "on groups that span nodes, and group tp is on one node"):
        gd.choose(_call(hier=False), "hierarchical")
    assert gd.choose(_call(hier=False), "auto").name == "unfused"


@pytest.mark.parametrize("kwargs,match", [
    (dict(chunks=[4, 4]), "chunks as a list of row counts applies to the copy-engine overlap"),
    (dict(device="cuda", transport="copy_engine"), "transport='copy_engine' moves data"),
])
def test_hierarchical_engine_names_what_it_does_not_take(kwargs, match):
    with pytest.raises(ValueError, match=match):
        gd.choose(_call(**kwargs), "auto")


def test_nvlink_peers_across_emulated_nodes_keep_the_one_level_table(monkeypatch):
    """Symmetric memory over the whole group (every rank an NVLink peer: nodes emulated on one
    host): engine='auto' is the one-level table's choice, engine='hierarchical' still forces."""
    monkeypatch.delenv("FUSEDIST_GEMM_ENGINE", raising=False)
    monkeypatch.setattr(gd.fused_ar.ENGINE, "why_not", lambda call: "no kernel here")
    call = _call("cuda", symm=True)
    assert gd.choose(call, "auto").name in ("unfused", "overlap")
    assert gd.choose(call, "hierarchical") is gh.ENGINE


def test_the_engine_variable_still_forces_a_one_level_engine(monkeypatch):
    monkeypatch.setenv("FUSEDIST_GEMM_ENGINE", "unfused")
    assert gd.choose(_call("cpu"), "auto").name == "unfused"
    monkeypatch.setenv("FUSEDIST_GEMM_ENGINE", "auto")
    assert gd.choose(_call("cpu"), "auto") is gh.ENGINE
