"""Paged split-KV decode attention (fusedist/ops/attention/_decode.py, csrc attention/decode)
against a float64 reference on the gathered cache: odd and mixed lengths in one batch, shuffled
page tables with every unused page and slot NaN-poisoned (and unread block-table entries out
of range), page sizes 16-256, head dims 64/128/256, GQA ratios 1/4/7/8/20, fp8 KV against the
dequantized values, NaN-poisoned outputs, graph replays with new lengths and tables, bitwise
determinism. The planner rule and the argument checks run on the CPU."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tolerances import GEMM_REL  # noqa: E402

from fusedist.ops.attention import _decode as ad  # noqa: E402

FP8 = getattr(torch, "float8_e4m3fn", None)


# ---- CPU: the planner ----------------------------------------------------------------------
def test_choose_num_splits_fills_the_sms_once_and_caps():
    # batch 1, 4 kv heads, 4K tokens: 132 // 4 = 33 CTAs a head, capped at 32 splits
    assert ad.choose_num_splits(1, 4, 1, 4096, 132) == 32
    # 8 kv heads: 16 splits, 128 CTAs
    assert ad.choose_num_splits(1, 8, 1, 4096, 132) == 16
    # short context: never fewer than 8 slabs (128 tokens) a split
    assert ad.choose_num_splits(1, 4, 1, 512, 132) == 4
    # batch 16 x 4 heads = 64 CTAs: 4 splits of 64 slabs (two CTAs per SM)
    assert ad.choose_num_splits(16, 4, 1, 4096, 132) == 4
    # 8 x 4 heads: 8 splits of 32 slabs; 4 x 4 heads at 4K: 32 splits would be 8 slabs each,
    # so one CTA per SM (8 splits)
    assert ad.choose_num_splits(8, 4, 1, 4096, 132) == 8
    assert ad.choose_num_splits(4, 4, 1, 4096, 132) == 8
    # batch 1 x 8 heads at 32K: 32 splits of 64 slabs
    assert ad.choose_num_splits(1, 8, 1, 32768, 132) == 32
    # a batch that fills the GPU on its own: no split, no merge
    assert ad.choose_num_splits(64, 4, 1, 4096, 132) == 1
    assert ad.choose_num_splits(256, 8, 1, 131072, 132) == 1
    assert ad.choose_num_splits(0, 4, 1, 0, 132) == 1


def test_cluster_merge_needs_a_cuda_device_and_at_most_16_splits():
    args = dict(batch=1, q_heads=16, kv_heads=4, head_dim=128, page_size=16, max_seq_len=4096,
                num_sms=132)
    with pytest.raises(ValueError, match="merge='cluster' needs a CUDA device"):
        ad.plan_kernel(**args, device="cpu", merge="cluster")
    with pytest.raises(ValueError, match="merge must be one of"):
        ad.plan_kernel(**args, device="cpu", merge="dsmem")
    cpu = ad.plan_kernel(**args, device="cpu")   # no clusters on the CPU: the workspace merge
    assert cpu.merge == "workspace" and cpu.num_splits == 32 and cpu.o_partial is not None
    two = ad.plan_kernel(**dict(args, batch=16), device="cpu", num_splits=2, merge="workspace")
    assert two.num_splits == 2 and two.merge == "workspace"


def test_plan_workspace_sized_from_the_plan():
    p = ad.plan_kernel(3, 32, 8, 128, 16, 8192, device="cpu", num_sms=132)
    assert p.num_splits == 11 and p.grid == (11, 8, 3)
    assert tuple(p.o_partial.shape) == (3, 32, 11, 128) and p.o_partial.dtype == torch.float32
    assert tuple(p.lse_partial.shape) == (3, 32, 11)
    assert tuple(p.counters.shape) == (3, 8) and int(p.counters.abs().sum()) == 0
    one = ad.plan_kernel(64, 32, 8, 128, 16, 8192, device="cpu", num_sms=132)
    assert one.num_splits == 1 and one.o_partial is None
    wide = ad.plan_kernel(1, 40, 2, 64, 32, 100, device="cpu", num_splits=3)
    assert wide.q_tiles == 3 and wide.grid == (3, 6, 1)


@pytest.mark.parametrize("kw, match", [
    (dict(head_dim=96), "head_dim"),
    (dict(q_heads=12, kv_heads=8), "multiple of kv_heads"),
    (dict(page_size=8), "page_size"),
    (dict(num_splits=129), "num_splits"),
    (dict(dtype=torch.float32), "q dtype"),
])
def test_plan_rejects_bad_arguments(kw, match):
    args = dict(batch=2, q_heads=16, kv_heads=4, head_dim=128, page_size=16, max_seq_len=64,
                device="cpu", num_sms=132)
    args.update(kw)
    with pytest.raises((ValueError, TypeError), match=match):
        ad.plan_kernel(**args)


# ---- GPU -----------------------------------------------------------------------------------
class Case:
    """A paged cache holding `lens` tokens per sequence in shuffled pages, every unused page,
    slot and block-table entry poisoned."""

    def __init__(self, lens, q_heads, kv_heads, head_dim, page_size, dtype, kv_dtype,
                 spare_pages=7, gen=None):
        dev = torch.device("cuda")
        self.lens, self.B = list(lens), len(lens)
        self.q_heads, self.kv_heads, self.D, self.P = q_heads, kv_heads, head_dim, page_size
        self.dtype, self.kv_dtype = dtype, kv_dtype
        pages = [math.ceil(n / page_size) for n in lens]
        self.max_pages = max(pages + [1]) + 2
        num_pages = sum(pages) + spare_pages
        perm = torch.randperm(num_pages, generator=gen).tolist()
        bt = torch.randint(2**28, 2**30, (self.B, self.max_pages), generator=gen,
                           dtype=torch.int32)  # unread entries: far out of range
        it = iter(perm)
        for b, n in enumerate(pages):
            for j in range(n):
                bt[b, j] = next(it)
        self.block_table = bt.to(dev)
        self.seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
        shape = (num_pages, page_size, kv_heads, head_dim)
        fp8 = kv_dtype != dtype
        if fp8:
            nan8 = torch.full(shape, 0x7F, dtype=torch.uint8, device=dev).view(FP8)
            self.k_cache, self.v_cache = nan8.clone(), nan8.clone()
            self.k_scale = torch.full(shape[:3], float("nan"), device=dev)
            self.v_scale = torch.full(shape[:3], float("nan"), device=dev)
        else:
            self.k_cache = torch.full(shape, float("nan"), dtype=dtype, device=dev)
            self.v_cache = torch.full(shape, float("nan"), dtype=dtype, device=dev)
            self.k_scale = self.v_scale = None
        self.k_ref, self.v_ref = [], []  # float64 [len, kv_heads, D] per sequence
        for b, n in enumerate(lens):
            tok = torch.arange(n, device=dev)
            pg = self.block_table[b, (tok // page_size)].long()
            slot = tok % page_size
            for cache, ref, scl in ((self.k_cache, self.k_ref, self.k_scale),
                                    (self.v_cache, self.v_ref, self.v_scale)):
                x = torch.randn((n, kv_heads, head_dim), device=dev)
                if fp8:
                    s = torch.rand((n, kv_heads), device=dev) * 0.02 + 0.005
                    q8 = (x / s[..., None]).clamp(-448, 448).to(FP8)
                    cache.view(torch.uint8)[pg, slot] = q8.view(torch.uint8)
                    scl[pg, slot] = s
                    ref.append(q8.float().double() * s.double()[..., None])
                else:
                    xc = x.to(dtype)
                    cache[pg, slot] = xc
                    ref.append(xc.double())
        self.q = torch.randn((self.B, q_heads, head_dim), device=dev).to(dtype)
        self.scale = head_dim ** -0.5

    def reference(self, q=None) -> torch.Tensor:
        q = self.q if q is None else q
        G = self.q_heads // self.kv_heads
        out = torch.zeros((self.B, self.q_heads, self.D), dtype=torch.float64, device=q.device)
        for b, n in enumerate(self.lens):
            if n <= 0:
                continue
            qb = q[b].double().view(self.kv_heads, G, self.D)
            s = torch.einsum("hgd,thd->hgt", qb, self.k_ref[b]) * self.scale
            out[b] = torch.einsum("hgt,thd->hgd", s.softmax(-1), self.v_ref[b]).reshape(
                self.q_heads, self.D)
        return out

    def plan(self, num_splits=None, max_seq_len=None, stages=0, fp8_direct=None, merge=None):
        return ad.plan_kernel(self.B, self.q_heads, self.kv_heads, self.D, self.P,
                              max(self.lens) if max_seq_len is None else max_seq_len,
                              num_splits=num_splits, dtype=self.dtype,
                              kv_dtype=self.kv_dtype, stages=stages, fp8_direct=fp8_direct,
                              merge=merge)

    def run(self, plan, out=None):
        out = torch.full_like(self.q, float("nan")) if out is None else out
        return ad.run_kernel(plan, self.q, self.k_cache, self.v_cache, self.block_table,
                             self.seq_lens, out, self.scale, self.k_scale, self.v_scale)


def check(case: Case, out: torch.Tensor, ref: torch.Tensor, what: str):
    tol = GEMM_REL[case.dtype]
    assert bool(torch.isfinite(out).all()), f"{what}: non-finite output"
    for b, n in enumerate(case.lens):
        if n <= 0:
            assert int((out[b] != 0).sum()) == 0, f"{what}: seq_len {n} must give zeros"
            continue
        o, r = out[b].double(), ref[b]
        err = float((o - r).norm() / r.norm())
        assert err < tol, f"{what}: sequence {b} (len {n}) rel err {err:.3e} >= {tol}"


CASES = [  # lens, q_heads, kv_heads, head_dim, page_size, dtype, fp8 kv
    ([1, 17, 4095, 4097, 32769], 16, 4, 128, 16, torch.bfloat16, False),
    ([17, 4095, 1, 300, 0], 8, 8, 64, 64, torch.float16, False),
    ([4097, 33, 1], 14, 2, 256, 256, torch.bfloat16, False),
    ([513, 1, 2049], 64, 8, 128, 16, torch.bfloat16, False),
    ([999, 31], 40, 2, 128, 32, torch.float16, False),           # 20 heads: three head tiles
    ([1, 4097, 700, 0], 32, 8, 128, 16, torch.bfloat16, True),
    ([4095, 17], 16, 4, 64, 64, torch.float16, True),
    ([2049, 1], 14, 2, 256, 256, torch.bfloat16, True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("lens, hq, hkv, d, ps, dtype, fp8", CASES)
def test_decode_matches_float64_reference(lens, hq, hkv, d, ps, dtype, fp8):
    if fp8 and FP8 is None:
        pytest.skip("torch without float8_e4m3fn")
    case = Case(lens, hq, hkv, d, ps, dtype, FP8 if fp8 else dtype)
    ref = case.reference()
    for splits in (None, 1, 7, 128):
        plan = case.plan(num_splits=splits)
        out = case.run(plan)
        torch.cuda.synchronize()
        check(case, out, ref, f"num_splits={plan.num_splits}")
        assert int(plan.counters.abs().sum()) == 0 if plan.counters is not None else True


def _need_cluster_merge():
    """The cluster merge must run on this GPU (tests/conftest.py's rule: a build without it
    fails; a GPU older than sm_90 skips). The tests ask for it by plan_kernel(merge="cluster"),
    whatever the tuning table's cluster_merge_max_splits makes the default."""
    from conftest import require_kernel
    require_kernel("attention_decode_cluster")
    assert ad.cluster_merge_available(torch.device("cuda")), \
        "the build has the cluster merge but fusedist.ops.attention does not take it"


@pytest.mark.gpu
@pytest.mark.parametrize("lens, hq, hkv, d, ps, dtype, fp8", CASES)
def test_decode_cluster_merge(lens, hq, hkv, d, ps, dtype, fp8):
    """The cluster merge (splits combined through the cluster's shared memory) at 2 to 16
    splits: the reference's result, bitwise the same on a second run, no workspace allocated;
    the workspace merge at the same splits gives the reference's result too."""
    if fp8 and FP8 is None:
        pytest.skip("torch without float8_e4m3fn")
    _need_cluster_merge()
    case = Case(lens, hq, hkv, d, ps, dtype, FP8 if fp8 else dtype)
    ref = case.reference()
    for splits in (2, 5, 16):
        plan = case.plan(num_splits=splits, merge="cluster")
        assert plan.merge == "cluster" and plan.o_partial is None and plan.counters is None
        out = case.run(plan)
        check(case, out, ref, f"cluster merge, num_splits={splits}")
        assert torch.equal(out, case.run(plan)), f"cluster merge {splits}: not reproducible"
        ws = case.run(case.plan(num_splits=splits, merge="workspace"))
        check(case, ws, ref, f"workspace merge, num_splits={splits}")
    with pytest.raises(ValueError, match="takes 2 to 16 splits"):
        case.plan(num_splits=17, merge="cluster")


@pytest.mark.gpu
def test_decode_cluster_merge_poisons_a_bad_row():
    """A bad page id in one split of a cluster-merged sequence: that sequence's rows are NaN,
    the other sequence's are right, and the error is recorded."""
    _need_cluster_merge()
    import fusedist
    from fusedist.errors import MetadataError
    case = Case([4000, 3000], 16, 4, 128, 16, torch.bfloat16, torch.bfloat16)
    ref = case.reference()
    fusedist.clear_device_errors("all")
    case.block_table[0, 200] = 2**30   # a page read by a middle split of sequence 0
    out = case.run(case.plan(num_splits=8, merge="cluster"))
    torch.cuda.synchronize()
    assert bool(torch.isnan(out[0].float()).all()), "the bad sequence's rows must be NaN"
    assert bool(torch.isfinite(out[1].float()).all())
    err = float(((out[1].double() - ref[1]).norm() / ref[1].norm()))
    assert err < GEMM_REL[torch.bfloat16]
    with pytest.raises(MetadataError, match=r"block_table\[0, 200\]"):
        fusedist.check_device_errors()
    fusedist.clear_device_errors("all")


@pytest.mark.gpu
@pytest.mark.parametrize("lens, hq, hkv, d, ps, dtype, fp8", [c for c in CASES if c[-1]])
def test_decode_fp8_two_stage_ring(lens, hq, hkv, d, ps, dtype, fp8):
    """The FP8 cache's 2-stage instantiation: the reference's result, bitwise the default's
    (the ring depth changes when bytes arrive, not what is summed in which order)."""
    if FP8 is None:
        pytest.skip("torch without float8_e4m3fn")
    case = Case(lens, hq, hkv, d, ps, dtype, FP8)
    ref = case.reference()
    for splits in (None, 1, 7):
        out = case.run(case.plan(num_splits=splits, stages=2))
        check(case, out, ref, f"stages=2 num_splits={splits}")
        assert torch.equal(out, case.run(case.plan(num_splits=splits, fp8_direct=False)))


@pytest.mark.gpu
@pytest.mark.parametrize("lens, hq, hkv, d, ps, dtype, fp8", [c for c in CASES if c[-1]])
def test_decode_fp8_direct_fragments(lens, hq, hkv, d, ps, dtype, fp8):
    """The FP8 cache's two stage-0 paths, direct fragments (e4m3 -> fp16 in registers,
    permuted k order and O rows; the default) and the fp16 slab: the float64 reference's
    result at every split count, reproducible bitwise."""
    if FP8 is None:
        pytest.skip("torch without float8_e4m3fn")
    case = Case(lens, hq, hkv, d, ps, dtype, FP8)
    ref = case.reference()
    assert case.plan().fp8_direct and not case.plan(stages=2).fp8_direct
    for direct in (True, False):
        for splits in (None, 1, 7, 128):
            plan = case.plan(num_splits=splits, fp8_direct=direct)
            out = case.run(plan)
            check(case, out, ref, f"fp8_direct={direct} num_splits={splits}")
            assert torch.equal(out, case.run(plan))


def test_decode_stages_argument():
    with pytest.raises(ValueError, match="stages must be 0 .* or 2 .FP8 caches only."):
        ad.plan_kernel(1, 8, 2, 128, 16, 64, device="cpu", stages=2)
    with pytest.raises(ValueError, match="stages must be 0"):
        ad.plan_kernel(1, 8, 2, 128, 16, 64, device="cpu", stages=3, kv_dtype=FP8)
    with pytest.raises(ValueError, match="fp8_direct is a variant of the default ring"):
        ad.plan_kernel(1, 8, 2, 128, 16, 64, device="cpu", fp8_direct=True)
    with pytest.raises(ValueError, match="fp8_direct is a variant of the default ring"):
        ad.plan_kernel(1, 8, 2, 128, 16, 64, device="cpu", kv_dtype=FP8, stages=2,
                       fp8_direct=True)


@pytest.mark.gpu
def test_decode_bitwise_deterministic():
    case = Case([32769, 4097, 5], 32, 8, 128, 16, torch.bfloat16, torch.bfloat16)
    plan = case.plan(num_splits=32)
    a = case.run(plan)
    b = case.run(plan)
    torch.cuda.synchronize()
    assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_decode_graph_replays_with_new_lengths_and_tables(fp8):
    if fp8 and FP8 is None:
        pytest.skip("torch without float8_e4m3fn")
    kvd = FP8 if fp8 else torch.bfloat16
    gen = torch.Generator().manual_seed(1234)
    sets = [Case(lens, 16, 4, 128, 16, torch.bfloat16, kvd, gen=gen)
            for lens in ([4097, 1, 17, 300], [1, 5000, 64, 0], [2500, 2500, 3, 4095])]
    # one static cache big enough for every set; each set's pages copied into it
    num_pages = max(c.k_cache.shape[0] for c in sets)
    max_pages = max(c.max_pages for c in sets)
    st = sets[0]
    k = torch.empty((num_pages,) + tuple(st.k_cache.shape[1:]), dtype=st.k_cache.dtype,
                    device="cuda")
    v = torch.empty_like(k)
    ks = vs = None
    if fp8:
        ks = torch.empty((num_pages,) + tuple(st.k_scale.shape[1:]), device="cuda")
        vs = torch.empty_like(ks)
    q = torch.empty_like(st.q)
    bt = torch.empty((4, max_pages), dtype=torch.int32, device="cuda")
    lens = torch.empty(4, dtype=torch.int32, device="cuda")
    out = torch.empty_like(st.q)

    def load(c):
        k.view(torch.uint8).fill_(0x7F) if fp8 else k.fill_(float("nan"))
        v.copy_(k)
        k[: c.k_cache.shape[0]] = c.k_cache
        v[: c.v_cache.shape[0]] = c.v_cache
        if fp8:
            ks.fill_(float("nan")), vs.fill_(float("nan"))
            ks[: c.k_scale.shape[0]] = c.k_scale
            vs[: c.v_scale.shape[0]] = c.v_scale
        bt.fill_(2**30)
        bt[:, : c.max_pages] = c.block_table
        lens.copy_(c.seq_lens)
        q.copy_(c.q)

    plan = ad.plan_kernel(4, 16, 4, 128, 16, 5000, dtype=torch.bfloat16, kv_dtype=kvd)
    assert plan.num_splits > 1
    load(sets[0])
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        ad.run_kernel(plan, q, k, v, bt, lens, out, st.scale, ks, vs)  # warm-up
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ad.run_kernel(plan, q, k, v, bt, lens, out, st.scale, ks, vs)
    for c in sets + sets[:1]:
        load(c)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        check(c, out, c.reference(), "graph replay")
        replayed = out.clone()
        out.fill_(float("nan"))
        ad.run_kernel(plan, q, k, v, bt, lens, out, st.scale, ks, vs)
        torch.cuda.synchronize()
        assert torch.equal(out, replayed), "graph replay differs from eager"


@pytest.mark.gpu
def test_run_kernel_rejects_bad_arguments():
    case = Case([40, 3], 16, 4, 64, 16, torch.bfloat16, torch.bfloat16)
    plan = case.plan()
    out = torch.empty_like(case.q)
    with pytest.raises(ValueError, match="q is non-contiguous"):
        ad.run_kernel(plan, case.q.transpose(0, 1).contiguous().transpose(0, 1), case.k_cache,
                      case.v_cache, case.block_table, case.seq_lens, out, 1.0)
    with pytest.raises(ValueError, match="block_table must be int32"):
        ad.run_kernel(plan, case.q, case.k_cache, case.v_cache, case.block_table.long(),
                      case.seq_lens, out, 1.0)
    with pytest.raises(ValueError, match="plan was made for"):
        big = torch.zeros((3, 16, 64), dtype=torch.bfloat16, device="cuda")
        ad.run_kernel(plan, big, case.k_cache, case.v_cache, case.block_table,
                      case.seq_lens, torch.empty_like(big), 1.0)


@pytest.mark.gpu
@pytest.mark.skipif(FP8 is None, reason="torch without float8_e4m3fn")
def test_fp8_kv_long_context_accuracy():
    """FP8 e4m3 KV with per token-head scales (amax / 448, as rope_append writes them) at 4K,
    32K and 128K tokens, 32 / 8 heads, head_dim 128, one plan of the planner's splits and one
    of a single split: against float64 on the dequantized cache the error is the kernel's own
    arithmetic (fp32 accumulation) and stays within the bf16 bound at every length, not growing
    with the context; against float64 on the unquantized cache it is what FP8 KV costs. Both
    are printed (FP8KV lines, pytest -rP)."""
    from fusedist.ops.attention.rope import quantize_fp8_reference
    dev = torch.device("cuda")
    hq, hkv, d, ps = 32, 8, 128, 16
    own = {}
    for n in (4096, 32768, 131072):
        gen = torch.Generator(device=dev).manual_seed(n)
        pages = n // ps
        k32 = torch.randn((n, hkv, d), device=dev, generator=gen)
        v32 = torch.randn((n, hkv, d), device=dev, generator=gen)
        k8, ks = quantize_fp8_reference(k32)
        v8, vs = quantize_fp8_reference(v32)
        kc, vc = k8.view(pages, ps, hkv, d), v8.view(pages, ps, hkv, d)
        ksc, vsc = ks.view(pages, ps, hkv), vs.view(pages, ps, hkv)
        bt = torch.arange(pages, dtype=torch.int32, device=dev).view(1, pages)
        lens = torch.tensor([n], dtype=torch.int32, device=dev)
        q = torch.randn((1, hq, d), device=dev, generator=gen).to(torch.bfloat16)
        scale = d ** -0.5

        def ref(k, v):
            qb = q[0].double().view(hkv, hq // hkv, d)
            s = torch.einsum("hgd,thd->hgt", qb, k.double()) * scale
            return torch.einsum("hgt,thd->hgd", s.softmax(-1), v.double()).reshape(hq, d)
        r_deq = ref(k8.double() * ks.double()[..., None], v8.double() * vs.double()[..., None])
        r_f32 = ref(k32, v32)
        for splits in (None, 1):
            plan = ad.plan_kernel(1, hq, hkv, d, ps, n, num_splits=splits,
                                  dtype=torch.bfloat16, kv_dtype=FP8)
            out = torch.full_like(q, float("nan"))
            ad.run_kernel(plan, q, kc, vc, bt, lens, out, scale, ksc, vsc)
            torch.cuda.synchronize()
            o = out[0].double()
            assert bool(torch.isfinite(o).all()), f"n={n} splits={plan.num_splits}: non-finite"
            e_own = float((o - r_deq).norm() / r_deq.norm())
            e_fp8 = float((o - r_f32).norm() / r_f32.norm())
            e_kv = float((r_deq - r_f32).norm() / r_f32.norm())
            print(f"FP8KV n={n} splits={plan.num_splits}: kernel vs dequantized {e_own:.2e}, "
                  f"kernel vs fp32 KV {e_fp8:.2e}, exact attention on FP8 KV vs fp32 KV "
                  f"{e_kv:.2e}")
            assert e_own < GEMM_REL[torch.bfloat16], f"n={n}: {e_own:.3e}"
            own[(n, splits)] = e_own
    for splits in (None, 1):   # the kernel's own error does not grow with the context
        assert own[(131072, splits)] <= 2 * own[(4096, splits)] + 1e-3, own
