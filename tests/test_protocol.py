"""The symmetric protocol's host-side pieces: the epoch's generation arithmetic, the call
descriptors and error records the kernels write (layout.h), the messages built from them,
the cross-rank checks of calls and sizes, timeout validation, and the pending-async
bookkeeping across CUDA-graph capture. CPU tier, except the tests marked gpu."""

from __future__ import annotations

import ctypes
import math
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import fusedist
from fusedist.comm import symmetric
from fusedist.comm.communicator import Communicator, check_calls
from fusedist.errors import CollectiveMismatchError, CommunicatorTimeoutError
from fusedist.comm.streams import AsyncHandle
from launch import assert_passed, torchrun

sys.path.insert(0, str(Path(__file__).resolve().parent / "dist"))

ROOT = Path(__file__).resolve().parent.parent
LAYOUT = (ROOT / "csrc" / "include" / "fusedist" / "common" / "layout.h").read_text()
EMPTY_WORD = 0x80008000


def _layout_int(name: str) -> int:
    m = re.search(rf"constexpr (?:int|uint32_t|uint64_t) {name} = (0x[0-9a-fA-F]+|\d+)u?;",
                  LAYOUT)
    assert m, f"{name} not found in layout.h"
    return int(m.group(1), 0)


def _C_or_skip():
    import fusedist._ext as ext

    if not ext.available():
        pytest.skip("fusedist._C not built here")
    return ext.load()


# ---- epoch and generations ------------------------------------------------------------------

def test_generation_mirror_matches_layout_h():
    assert symmetric.GENERATIONS == _layout_int("kGenerations")
    assert re.search(r"kEpochPeriod = 0xFFFFFFFFu / kGenerations \* kGenerations;", LAYOUT)
    assert symmetric.EPOCH_PERIOD == 0xFFFFFFFF // symmetric.GENERATIONS * symmetric.GENERATIONS


def test_consecutive_epochs_never_share_a_generation_across_the_wrap():
    period = symmetric.EPOCH_PERIOD
    assert period % symmetric.GENERATIONS == 0 and period <= 2**32
    e, seen = period - 7, []
    for _ in range(20):
        n = symmetric.next_epoch(e)
        assert symmetric.generation_of(n) == (symmetric.generation_of(e) + 1) % \
            symmetric.GENERATIONS, (e, n)
        seen.append(n)
        e = n
    assert 0 in seen, "the epoch did not wrap"
    assert symmetric.next_epoch(period - 1) == 0


def test_generation_arithmetic_matches_the_extension():
    C = _C_or_skip()
    assert C.GENERATIONS == symmetric.GENERATIONS and C.EPOCH_PERIOD == symmetric.EPOCH_PERIOD
    for e in list(range(symmetric.EPOCH_PERIOD - 5, symmetric.EPOCH_PERIOD)) + [0, 1, 2, 3]:
        assert C.next_epoch(e) == symmetric.next_epoch(e)
        assert C.generation_of(e) == symmetric.generation_of(e)
    assert C.ERR_TIMEOUT == symmetric.ERR_TIMEOUT and C.ERR_MISMATCH == symmetric.ERR_MISMATCH
    assert C.DESC_BYTES == 16 * C.MAX_RANKS


# ---- call descriptors -----------------------------------------------------------------------

def _desc_words(op, dtype, flags, a, b, c, epoch):
    """layout.h desc_word, written out independently."""
    return [0xFD000000 | (flags & 0xFF) << 16 | (op & 0xFF) << 8 | (dtype & 0xFF),
            a & 0x7FFFFFFF, b & 0x7FFFFFFF, (c & 0x7FFFFF) << 8 | (epoch & 0xFF)]


def _layout_enum(name: str) -> int:
    m = re.search(rf"\b{name} = (\d+)", LAYOUT)
    assert m, f"{name} not found in layout.h"
    return int(m.group(1))


def test_op_codes_and_flags_mirror_layout_h():
    for py, cpp in ((symmetric.OP_ONE_SHOT, "kOpOneShot"), (symmetric.OP_TWO_SHOT, "kOpTwoShot"),
                    (symmetric.OP_RMSNORM, "kOpOneShotRmsNorm"),
                    (symmetric.OP_GEMM_AR, "kOpGemmAr"),
                    (symmetric.OP_AG_GEMM, "kOpAgGemm"), (symmetric.OP_GEMM_RS, "kOpGemmRs"),
                    (symmetric.OP_CALL_CHECK, "kOpCallCheck"),
                    (symmetric.OP_NCCL_ALL_REDUCE, "kOpNcclAllReduce"),
                    (symmetric.OP_NCCL_ALL_GATHER, "kOpNcclAllGather"),
                    (symmetric.OP_NCCL_REDUCE_SCATTER, "kOpNcclReduceScatter")):
        assert py == _layout_enum(cpp), cpp
    assert symmetric.DESC_FP8_OUT == _layout_int("kDescFp8Out")
    assert symmetric.DESC_ENGINE_COPY_ENGINE == _layout_int("kDescEngineCopyEngine")
    assert symmetric.DESC_ENGINE_FUSED == _layout_int("kDescEngineFused")


@pytest.mark.parametrize("desc,epoch", [
    ((1, 0, 0, 1, 0, 0), 0), ((2, 2, 0, 4099, 0, 0), 255),
    ((3, 1, 1, 0x7FFFFFFF, 0x7FFFFFFF, 16384), 7),
    ((4, 2, 8, EMPTY_WORD, EMPTY_WORD, EMPTY_WORD), EMPTY_WORD),  # the sentinel as every field
    ((6, 1, 255, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF), 0xFFFFFFFF)])
def test_descriptor_round_trip_and_never_empty(desc, epoch):
    words = symmetric.desc_words(desc, epoch)
    assert words == _desc_words(*desc, epoch)
    assert EMPTY_WORD not in words, "a descriptor word equal to the empty sentinel"
    d = symmetric.decode_desc(words)
    op, dtype, flags, a, b, c = desc
    assert (d["op"], d["dtype"], d["flags"], d["a"], d["b"], d["c"], d["epoch8"]) == \
        (op, dtype, flags, a & 0x7FFFFFFF, b & 0x7FFFFFFF, c & 0x7FFFFF, epoch & 0xFF)
    assert symmetric.decode_desc([EMPTY_WORD] * 4) is None
    assert symmetric.decode_desc(words[:1] + [EMPTY_WORD] + words[2:]) is None


def test_no_descriptor_word_is_ever_empty():
    """Every 32-bit value in every field (sampled densely): word 0 is tagged 0xFD, words 1-3
    keep bit 31 clear, and the sentinel is 0x80008000."""
    g = torch.Generator().manual_seed(0)
    vals = torch.randint(0, 2**32, (4096, 7), generator=g, dtype=torch.int64).tolist()
    vals += [[EMPTY_WORD] * 7, [0xFFFFFFFF] * 7, [0] * 7, [0x8000] * 7]
    for v in vals:
        assert EMPTY_WORD not in symmetric.desc_words(v[:6], v[6]), v


@pytest.mark.parametrize("numel", [0, 1, 2**31 - 1, 2**31, 2**31 + 5, 2**48 + 3, 2**62 - 1])
def test_collective_descriptor_carries_the_whole_element_count(numel):
    d = symmetric.decode_desc(symmetric.desc_words(
        symmetric.collective_desc(symmetric.OP_ONE_SHOT, 2, numel, c=1000), 9))
    assert d["numel"] == numel and d["c"] == 1000 and d["op"] == symmetric.OP_ONE_SHOT
    # Counts that differ anywhere in their 62 bits give different descriptors.
    other = symmetric.collective_desc(symmetric.OP_ONE_SHOT, 2, numel ^ (1 << 40), c=1000)
    assert symmetric.desc_words(other, 9) != symmetric.desc_words(
        symmetric.collective_desc(symmetric.OP_ONE_SHOT, 2, numel, c=1000), 9)


def test_gemm_descriptor_compares_what_ranks_must_agree_on():
    bf16 = 2
    ar = symmetric.gemm_desc("gemm_ar", bf16, symmetric.DESC_ENGINE_FUSED, 0, 4, 512, 256)
    # gemm_ar / gemm_rs sum [M, N] partials: M and N compared, each rank's K shard is not.
    assert ar == symmetric.gemm_desc("gemm_ar", bf16, symmetric.DESC_ENGINE_FUSED, 0, 4, 512, 300)
    assert ar != symmetric.gemm_desc("gemm_ar", bf16, symmetric.DESC_ENGINE_FUSED, 0, 4, 520, 256)
    assert ar != symmetric.gemm_desc("gemm_ar", bf16, symmetric.DESC_ENGINE_FUSED, 0, 5, 512, 256)
    assert ar != symmetric.gemm_desc("gemm_ar", 1, symmetric.DESC_ENGINE_FUSED, 0, 4, 512, 256)
    assert ar != symmetric.gemm_desc("gemm_ar", bf16, symmetric.DESC_ENGINE_COPY_ENGINE, 0, 4,
                                     512, 256)
    assert ar != symmetric.gemm_desc("gemm_rs", bf16, symmetric.DESC_ENGINE_FUSED, 0, 4, 512, 256)
    # ag_gemm gathers [m, K] shards: M and K compared, each rank's N (column shard) is not.
    ag = symmetric.gemm_desc("ag_gemm", bf16, symmetric.DESC_ENGINE_COPY_ENGINE, 0, 74, 136, 200)
    assert ag == symmetric.gemm_desc("ag_gemm", bf16, symmetric.DESC_ENGINE_COPY_ENGINE, 0, 74,
                                     40, 200)
    assert ag != symmetric.gemm_desc("ag_gemm", bf16, symmetric.DESC_ENGINE_COPY_ENGINE, 0, 74,
                                     136, 208)
    # The pipeline's chunks (or pieces) are compared, modulo 64.
    rs = [symmetric.gemm_desc("gemm_rs", bf16, symmetric.DESC_ENGINE_COPY_ENGINE, c, 64, 40, 8)
          for c in (1, 2, 3, 65)]
    assert len(set(rs[:3])) == 3 and rs[3] == rs[0]
    d = symmetric.decode_desc(symmetric.desc_words(rs[2], 0))
    assert d["flags"] == symmetric.DESC_ENGINE_COPY_ENGINE | 3 << 2


def test_nccl_descriptor():
    one = symmetric.nccl_desc("reduce_scatter", 2, 4096)
    assert one == symmetric.collective_desc(symmetric.OP_NCCL_REDUCE_SCATTER, 2, 4096)
    three = symmetric.nccl_desc("reduce_scatter", 2, 4096, calls=3)
    assert three != one and three[5] == 3
    assert symmetric.nccl_desc("all_gather", 2, 4096) != symmetric.nccl_desc("all_reduce", 2, 4096)


def test_descriptor_encoding_matches_the_extension():
    C = _C_or_skip()
    for desc, epoch in [((1, 0, 0, 1, 0, 0), 0), ((3, 2, 1, 12345, 2**20, 8192), 300),
                        (symmetric.gemm_desc("ag_gemm", 2, 2, 3, 74, 0, 200), 5)]:
        assert list(C.desc_words(desc, epoch)) == _desc_words(*desc, epoch)
    assert C.OP_CODES["call_check"] == symmetric.OP_CALL_CHECK
    assert C.OP_CODES["nccl_reduce_scatter"] == symmetric.OP_NCCL_REDUCE_SCATTER


_DESC_PROGRAM = r"""
#include <cstdio>
#include "fusedist/common/layout.h"
using namespace fusedist;
static void show(const CallDesc& d, uint32_t epoch) {
  std::printf("%u %u %u %u\n", desc_word(0, d, epoch), desc_word(1, d, epoch),
              desc_word(2, d, epoch), desc_word(3, d, epoch));
}
int main() {
  show(collective_desc(kOpOneShot, DType::kFloat32, 0, 4096, 0), 3);
  show(collective_desc(kOpOneShotRmsNorm, DType::kBFloat16, kDescFp8Out, (1ull << 40) + 77,
                       8192), 300);
  show(collective_desc(kOpNcclReduceScatter, DType::kFloat16, 0, 3ull << 33, 4), 0xFFFFFFFFu);
  show(gemm_desc(kOpGemmAr, DType::kBFloat16, kDescEngineFused, 0, 128, 8192, 0), 7);
  show(gemm_desc(kOpAgGemm, DType::kFloat16, kDescEngineCopyEngine, 67, 74, 0, 200), 255);
  return 0;
}
"""


def test_descriptor_encoding_matches_layout_h_compiled(tmp_path):
    """layout.h's desc_word and descriptor builders, compiled for the host, against the Python
    mirror (what the kernels send against what the host decodes and sends)."""
    import shutil
    import subprocess

    cxx = shutil.which("g++") or shutil.which("c++")
    cuda = next((Path(p) for p in ("/usr/local/cuda/include", "/usr/include")
                 if (Path(p) / "cuda_runtime.h").exists()), None)
    if cxx is None or cuda is None:
        pytest.skip("needs a C++ compiler and the CUDA headers")
    src = tmp_path / "desc.cpp"
    src.write_text(_DESC_PROGRAM)
    exe = tmp_path / "desc"
    subprocess.run([cxx, "-std=c++17", "-I", str(ROOT / "csrc" / "include"), "-I", str(cuda),
                    str(src), "-o", str(exe)], check=True, capture_output=True)
    got = [list(map(int, line.split())) for line in
           subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split("\n")
           if line]
    sd = symmetric
    want = [sd.desc_words(sd.collective_desc(sd.OP_ONE_SHOT, 0, 4096), 3),
            sd.desc_words(sd.collective_desc(sd.OP_RMSNORM, 2, (1 << 40) + 77,
                                             flags=sd.DESC_FP8_OUT, c=8192), 300),
            sd.desc_words(sd.nccl_desc("reduce_scatter", 1, 3 << 33, calls=4), 0xFFFFFFFF),
            sd.desc_words(sd.gemm_desc("gemm_ar", 2, sd.DESC_ENGINE_FUSED, 0, 128, 8192, 0), 7),
            sd.desc_words(sd.gemm_desc("ag_gemm", 1, sd.DESC_ENGINE_COPY_ENGINE, 67, 74, 0, 200),
                          255)]
    assert got == want


def test_descriptor_text():
    sd = symmetric
    d = sd.decode_desc(_desc_words(3, 2, 1, 33 * 8192, 0, 8192, 0))
    assert sd.describe_desc(d) == ("all_reduce_add_rmsnorm of 270336 bfloat16 elements "
                                   "(rows of 8192) with float8_e4m3fn output")
    d = sd.decode_desc(_desc_words(1, 0, 0, 4096, 0, 0, 0))
    assert sd.describe_desc(d) == "one_shot all_reduce of 4096 float32 elements"
    d = sd.decode_desc(sd.desc_words(sd.collective_desc(sd.OP_TWO_SHOT, 0, 2**33 + 1), 0))
    assert sd.describe_desc(d) == "two_shot all_reduce of 8589934593 float32 elements"
    text = {
        sd.gemm_desc("gemm_ar", 2, sd.DESC_ENGINE_FUSED, 0, 4, 512, 256):
            "gemm_ar (the fused kernel) with M = 4, N = 512, bfloat16",
        sd.gemm_desc("gemm_rs", 1, sd.DESC_ENGINE_COPY_ENGINE, 3, 128, 776, 1000):
            "gemm_rs (the copy-engine overlap, 3 chunks) with M = 128, N = 776, float16",
        sd.gemm_desc("ag_gemm", 2, sd.DESC_ENGINE_FUSED, 1, 74, 136, 200):
            "ag_gemm (the fused kernel, 1 piece) with M = 74, K = 200, bfloat16",
        sd.nccl_desc("all_reduce", 0, 1 << 20):
            "all_reduce through NCCL of 1048576 float32 elements",
        sd.nccl_desc("reduce_scatter", 2, 4096, calls=3):
            "reduce_scatter through NCCL of 4096 bfloat16 elements in 3 NCCL calls",
    }
    for desc, want in text.items():
        assert sd.describe_desc(sd.decode_desc(sd.desc_words(desc, 11))) == want
    assert sd.describe_desc(None) == "an unreadable call"


# ---- error records and their messages -------------------------------------------------------

class _FakeGroup:
    name = "tp0"
    ranks = (4, 5)


def _symm_with_record(words) -> symmetric.SymmetricMemory:
    """A SymmetricMemory whose error record is `words` (16 uint32) in host memory."""
    buf = (ctypes.c_uint32 * 16)(*([int(w) & 0xFFFFFFFF for w in words] + [0] * 16)[:16])
    s = symmetric.SymmetricMemory.__new__(symmetric.SymmetricMemory)
    s._buf = buf  # keeps the memory alive
    s._err_host = ctypes.addressof(buf)
    s._closed = False
    s.group = _FakeGroup()
    s.timeout_s = 2.0
    return s


@pytest.mark.parametrize("op,undefined", [(1, False), (2, False), (3, False), (4, False),
                                          (5, True), (6, True), (7, True)])
def test_timeout_message_says_what_is_true_per_op(op, undefined):
    s = _symm_with_record([1, 0, 1, 77, op])
    with pytest.raises(CommunicatorTimeoutError) as e:
        s.check()
    msg = str(e.value)
    assert "rank 4 waited more than 2 s for rank 5" in msg and "call #77" in msg
    name = {1: "one_shot all_reduce", 2: "two_shot all_reduce", 3: "all_reduce_add_rmsnorm",
            4: "gemm_ar", 5: "ag_gemm", 6: "gemm_rs", 7: "call check"}[op]
    assert msg.startswith(f"fusedist: {name}"), msg
    if undefined:  # the fused GEMM engines leave whatever the GEMM computed
        assert "undefined" in msg and "NaN" not in msg, msg
    else:
        assert "NaN where a peer's data did not arrive" in msg or \
            "miss a peer's data are NaN" in msg, msg


def test_mismatch_record_names_both_calls():
    mine = _desc_words(1, 0, 0, 4096, 0, 0, 3)
    theirs = _desc_words(1, 0, 0, 4104, 0, 0, 3)
    s = _symm_with_record([2, 1, 0, 3, 1, 0, 0, 0] + mine + theirs)
    with pytest.raises(CollectiveMismatchError) as e:
        s.check()
    msg = str(e.value)
    assert "rank 5 called one_shot all_reduce of 4096 float32 elements" in msg, msg
    assert "rank 4 called one_shot all_reduce of 4104 float32 elements" in msg, msg
    assert "unusable" in msg
    assert s.error_code() == symmetric.ERR_MISMATCH


@pytest.mark.parametrize("kernel,mine,theirs,says", [
    (symmetric.OP_GEMM_AR,  # the fused decode kernel, another N on the peer
     symmetric.gemm_desc("gemm_ar", 2, symmetric.DESC_ENGINE_FUSED, 0, 4, 512, 256),
     symmetric.gemm_desc("gemm_ar", 2, symmetric.DESC_ENGINE_FUSED, 0, 4, 520, 256),
     ("gemm_ar (fused) on group tp0",
      "rank 4 called gemm_ar (the fused kernel) with M = 4, N = 512",
      "rank 5 called gemm_ar (the fused kernel) with M = 4, N = 520")),
    (symmetric.OP_CALL_CHECK,  # a copy-engine pipeline's barrier: ag_gemm against gemm_rs
     symmetric.gemm_desc("ag_gemm", 2, symmetric.DESC_ENGINE_COPY_ENGINE, 0, 64, 0, 256),
     symmetric.gemm_desc("gemm_rs", 2, symmetric.DESC_ENGINE_COPY_ENGINE, 1, 64, 512, 0),
     ("call check", "rank 4 called ag_gemm (the copy-engine overlap) with M = 64, K = 256",
      "rank 5 called gemm_rs (the copy-engine overlap, 1 chunk) with M = 64, N = 512")),
    (symmetric.OP_CALL_CHECK,  # before NCCL: another size
     symmetric.nccl_desc("all_reduce", 0, 1 << 20),
     symmetric.nccl_desc("all_reduce", 0, (1 << 20) + 8),
     ("call check", "rank 4 called all_reduce through NCCL of 1048576 float32 elements",
      "rank 5 called all_reduce through NCCL of 1048584 float32 elements")),
    (symmetric.OP_ONE_SHOT,  # a one-shot all-reduce met a peer's call check before NCCL
     symmetric.collective_desc(symmetric.OP_ONE_SHOT, 0, 4096),
     symmetric.nccl_desc("all_reduce", 0, 4096),
     ("one_shot all_reduce on group tp0", "rank 4 called one_shot all_reduce of 4096 float32",
      "rank 5 called all_reduce through NCCL of 4096 float32")),
])
def test_mismatch_messages_name_both_calls_on_every_path(kernel, mine, theirs, says):
    s = _symm_with_record([2, 0, 1, 9, kernel, 0, 0, 0] + symmetric.desc_words(mine, 9)
                          + symmetric.desc_words(theirs, 9))
    with pytest.raises(CollectiveMismatchError) as e:
        s.check()
    for part in says:
        assert part in str(e.value), (part, str(e.value))


def test_no_record_no_error():
    assert _symm_with_record([0] * 16).error() is None


# ---- cross-rank checks ----------------------------------------------------------------------

def test_same_config_passes_and_different_config_names_ranks_and_values():
    a = {"max_bytes": 1 << 20, "one_shot_max_bytes": 1 << 16, "staging_bytes": 0,
         "timeout_s": 30.0}
    symmetric.check_same_config("tp0", (0, 1), [a, dict(a)])
    b = dict(a, max_bytes=2 << 20, timeout_s=5.0)
    with pytest.raises(CollectiveMismatchError) as e:
        symmetric.check_same_config("tp0", (2, 3), [a, b])
    msg = str(e.value)
    assert "max_bytes (rank 2: 1048576, rank 3: 2097152)" in msg, msg
    assert "timeout_s (rank 2: 30.0, rank 3: 5.0)" in msg, msg
    assert "staging_bytes" not in msg.split("memory:")[1].split(". Create")[0]


@pytest.fixture
def fake_device(monkeypatch):
    from _fake_device import fake_device as fake

    with fake(monkeypatch.setattr) as C:
        yield C


def test_symmetric_sizes_checked_across_real_ranks():
    """tests/dist/worker_protocol.py on 2 CPU ranks over gloo: matching ranks agree on the
    layout; a size or timeout that differs on one rank raises CollectiveMismatchError naming
    both values on every rank, after one gather and before any allocation."""
    assert_passed(torchrun("worker_protocol.py", 2, {"CUDA_VISIBLE_DEVICES": ""},
                           timeout=240), 2)


def test_symmetric_memory_rejects_a_timeout_without_meaning(fake_device, world1):
    for bad in (0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="timeout_s"):
            symmetric.SymmetricMemory(world1.tp, 1 << 20, 1 << 16, timeout_s=bad)
    assert fake_device.allocs == []


def test_check_calls():
    check_calls("tp0", (0, 1, 2), [(0, 100, 0)] * 3)
    with pytest.raises(CollectiveMismatchError) as e:
        check_calls("tp0", (0, 1, 2), [(0, 100, 0), (0, 101, 0), (0, 100, 2)])
    msg = str(e.value)
    for part in ("rank 0 called all_reduce of 100 float32 elements",
                 "rank 1 called all_reduce of 101 float32 elements",
                 "rank 2 called all_reduce of 100 bfloat16 elements"):
        assert part in msg, msg


# ---- the call check before NCCL calls, and NCCL's abort after a mismatch -------------------

class _RecNccl:
    """A NcclComm stand-in that records what is called on it, in order, into `log`."""

    def __init__(self, log):
        self.log = log

    def all_reduce(self, x, out):
        self.log.append(("nccl all_reduce", x.numel()))
        return out.copy_(x)

    def abort(self):
        self.log.append("abort")


def _nccl_comm(monkeypatch, log, *, check=True, size=2, symm=True):
    c = Communicator.__new__(Communicator)
    c._pending_async = None
    c.closed = False
    c._nccl_aborted = False
    c.nccl_call_check = check and symm
    c.group = SimpleNamespace(size=size, rank=0, name="tp0", ranks=tuple(range(size)),
                              _communicator=None)
    c.device = torch.device("cpu")
    c.symm = SimpleNamespace(check=lambda: None, handle="h", before_launch=lambda: None) \
        if symm else None
    c.nccl = c.nccl_overlap = _RecNccl(log)
    c.device_barrier = lambda desc: log.append(("call check", tuple(desc)))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: SimpleNamespace(cuda_stream=0))
    return c


@pytest.mark.parametrize("check,size,symm,checked", [(True, 2, True, True), (False, 2, True, False),
                                                     (True, 1, True, False),
                                                     (True, 2, False, False)])
def test_nccl_all_reduce_is_checked_before_nccl(monkeypatch, check, size, symm, checked):
    """An all_reduce routed to NCCL: the call check (what NCCL is about to be asked) goes on the
    same stream right before it, unless the check is off, the group has one rank, or there is
    no symmetric memory (no descriptor slots)."""
    log = []
    comm = _nccl_comm(monkeypatch, log, check=check, size=size, symm=symm)
    x = torch.ones(1000, dtype=torch.bfloat16)
    comm._launch(x, torch.empty_like(x), "nccl")
    want = [("nccl all_reduce", 1000)]
    if checked:
        want.insert(0, ("call check", symmetric.nccl_desc("all_reduce", 2, 1000)))
    assert log == want


class _FailingSymm:
    def __init__(self, exc):
        self.exc, self.closed = exc, False

    def check(self):
        raise self.exc("fusedist: recorded")

    def error_code(self):
        return symmetric.ERR_MISMATCH if self.exc is CollectiveMismatchError else \
            symmetric.ERR_TIMEOUT

    def close(self):
        self.closed = True


def test_a_mismatch_aborts_nccl_once_and_stays_sticky(monkeypatch):
    log = []
    comm = _nccl_comm(monkeypatch, log)
    comm.symm = _FailingSymm(CollectiveMismatchError)
    for _ in range(3):
        with pytest.raises(CollectiveMismatchError):
            comm.check()
    assert log == ["abort"], "NCCL must be aborted exactly once after a mismatch"


def test_a_timeout_leaves_nccl_alone(monkeypatch):
    # Only a mismatch is seen by every rank of the exchange (so all of them abort; an NCCL
    # destroy on one rank against an abort on another could hang).
    log = []
    comm = _nccl_comm(monkeypatch, log)
    comm.symm = _FailingSymm(CommunicatorTimeoutError)
    with pytest.raises(CommunicatorTimeoutError):
        comm.check()
    assert log == []


def test_close_aborts_nccl_before_it_synchronizes_after_a_mismatch(monkeypatch):
    log = []
    comm = _nccl_comm(monkeypatch, log)
    symm = _FailingSymm(CollectiveMismatchError)
    symm.close = lambda: log.append("symm close")
    comm.symm = symm
    comm.name = "tp0/0"
    comm.nccl.close = lambda: log.append("nccl close")
    monkeypatch.setattr("fusedist.comm.communicator.get_runtime",
                        lambda: SimpleNamespace(communicators=[]))
    comm.close()
    assert log[:2] == ["abort", "symm close"], log


def test_aborted_nccl_refuses_calls_and_close_does_not_destroy():
    from fusedist.errors import CommunicatorClosedError
    from fusedist.comm.nccl import NcclComm

    calls = []
    nc = NcclComm.__new__(NcclComm)
    nc.group = SimpleNamespace(size=2, name="tp0")
    nc.aborted = False
    nc._comm = SimpleNamespace(abort=lambda: calls.append("abort"),
                               destroy=lambda: calls.append("destroy"))
    nc.abort()
    nc.abort()
    nc.close()
    assert calls == ["abort"]
    x = torch.ones(4)
    for fn in (nc.all_reduce, nc.all_gather, nc.reduce_scatter):
        with pytest.raises(CommunicatorClosedError, match="aborted"):
            fn(x, x)


# ---- timeouts -------------------------------------------------------------------------------

@pytest.fixture
def world1():
    if fusedist.is_initialized():
        fusedist.shutdown()
    rt = fusedist.init(rank=0, world_size=1, backend="gloo")
    yield rt
    fusedist.shutdown()


@pytest.mark.parametrize("bad", [0, 0.0, -1, -0.5, math.inf, math.nan, "5", True])
def test_communicator_rejects_a_timeout_without_meaning(world1, bad):
    with pytest.raises(ValueError, match="timeout_s must be a finite number of seconds > 0"):
        Communicator(timeout_s=bad)
    Communicator(timeout_s=0.25).close()  # a positive one is fine


def test_timeout_from_the_environment_is_validated(monkeypatch):
    monkeypatch.setenv("FUSEDIST_TIMEOUT_S", "0")
    with pytest.raises(ValueError, match="FUSEDIST_TIMEOUT_S"):
        symmetric.default_timeout_s()
    monkeypatch.setenv("FUSEDIST_TIMEOUT_S", "7")
    assert symmetric.default_timeout_s() == 7.0


@pytest.mark.parametrize("bad", [0, -3, math.nan])
def test_init_rejects_a_timeout_without_meaning(bad):
    if fusedist.is_initialized():
        fusedist.shutdown()
    with pytest.raises(ValueError, match="timeout_s must be a finite number"):
        fusedist.init(rank=0, world_size=1, backend="gloo", timeout_s=bad)
    assert not fusedist.is_initialized()


# ---- pending async call across eager and capture --------------------------------------------

class _Stream:
    def __init__(self):
        self.waited = []

    def wait_event(self, e):
        self.waited.append(e)


def _comm() -> Communicator:
    c = Communicator.__new__(Communicator)
    c._pending_async = None
    return c


@pytest.fixture
def fake_cuda(monkeypatch):
    state = {"capturing": False, "stream": _Stream()}
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state["capturing"])
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: state["stream"])
    return state


def test_wait_orders_the_callers_stream_once(fake_cuda):
    comm, ev = _comm(), object()
    h = AsyncHandle("r", ev)
    comm.set_pending(h)
    assert h.wait() == "r" and fake_cuda["stream"].waited == [ev]
    comm.order_after_pending(fake_cuda["stream"])
    assert fake_cuda["stream"].waited == [ev], "the stream that waited was made to wait again"
    assert comm._pending_async is None


def test_wait_on_one_stream_still_orders_a_call_on_another(fake_cuda):
    comm, ev = _comm(), object()
    h = AsyncHandle("r", ev)
    comm.set_pending(h)
    h.wait()
    other = _Stream()
    comm.order_after_pending(other)
    assert other.waited == [ev]


def test_unwaited_eager_call_orders_the_next_eager_call(fake_cuda):
    comm, ev = _comm(), object()
    comm.set_pending(AsyncHandle("r", ev))
    s = _Stream()
    comm.order_after_pending(s)
    assert s.waited == [ev]
    comm.order_after_pending(s)
    assert s.waited == [ev], "ordered twice after one call"


def test_capture_never_waits_on_an_eager_event(fake_cuda):
    comm = _comm()
    comm.set_pending(AsyncHandle("r", object()))  # eager, never waited
    fake_cuda["capturing"] = True
    s = _Stream()
    comm.order_after_pending(s)
    assert s.waited == [], "a capture waited on an event recorded outside it"


def test_eager_call_never_waits_on_a_captured_event(fake_cuda):
    comm = _comm()
    fake_cuda["capturing"] = True
    h = AsyncHandle("r", object())
    assert h.captured
    comm.set_pending(h)
    fake_cuda["capturing"] = False
    s = _Stream()
    comm.order_after_pending(s)
    assert s.waited == [], "an eager stream waited on an event recorded in a capture"


@pytest.mark.gpu
def test_async_calls_mixed_with_capture_on_one_gpu():
    """Eager async + wait, then a captured sync call; a captured async call, then eager
    calls; an unwaited eager async call, then a capture. One rank: the same bookkeeping as
    every world size (the collective itself is a copy)."""
    if fusedist.is_initialized():
        fusedist.shutdown()
    fusedist.init(rank=0, world_size=1)
    try:
        comm = fusedist.get_communicator()
        x = torch.randn(4099, device="cuda")
        y = comm.all_reduce(x, async_op=True).wait()
        torch.cuda.synchronize()
        assert torch.equal(y, x)
        g = torch.cuda.CUDAGraph()
        out = torch.full_like(x, float("nan"))
        with torch.cuda.graph(g):
            comm.all_reduce(x, out=out)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, x)

        g2 = torch.cuda.CUDAGraph()
        out2 = torch.full_like(x, float("nan"))
        with torch.cuda.graph(g2):
            comm.all_reduce(x, out=out2, async_op=True).wait()
        y = comm.all_reduce(x)  # eager, after a captured async call
        g2.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, x) and torch.equal(out2, x)

        h = comm.all_reduce(x, async_op=True)  # not waited before the capture
        g3 = torch.cuda.CUDAGraph()
        out3 = torch.full_like(x, float("nan"))
        with torch.cuda.graph(g3):
            comm.all_reduce(x, out=out3)
        assert torch.equal(h.wait(), x)
        g3.replay()
        torch.cuda.synchronize()
        assert torch.equal(out3, x)
    finally:
        fusedist.shutdown()
