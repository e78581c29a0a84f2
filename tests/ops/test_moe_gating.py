"""fusedist.ops.moe gating: route (router logits -> top-k ids and weights), sort_by_expert (the
(token, slot) pairs laid out by expert) and route_and_sort.

CPU tier: the plain-torch references against independent definitions: a per-token float64
Python loop written the way the Hugging Face models route (Mixtral, Qwen2-MoE, Qwen3-MoE
norm_topk_prob, DeepSeek-V3's grouped sigmoid with its correction bias), and a brute-force
per-expert list for the layout; every bad input (each error names the argument); the
torch.library ops under torch.compile(fullgraph=True) and opcheck.

gpu tier: the kernels against the references on fresh random inputs with odd shapes, outputs
poisoned first. Ids must equal route_reference's on the same device exactly: the kernel's
scores are the reference's fp32 operations (sigmoid: torch's own formula, elementwise; softmax:
torch's warp-softmax order, and for the softmax cases the float32 logits lie on a 2^-6 grid so
that no two distinct logits give probabilities within rounding of each other, whatever the
summation order). Weights: within W_RTOL (below) of the reference and of float64. Layouts:
bitwise. Also ties, a NaN row, ids out of range (recorded, never an out-of-bounds access), CUDA
graph replays with new routings and torch.compile.

Weight error model (u = 2^-24, relative to each weight; an ulp is up to 2 u): an fp32 softmax
probability carries the exp's error (<= 2 ulp on CUDA, 1 on the CPU: 4 u), the sum of E
positive terms ((E - 1) u at worst) and a division (u); renormalizing divides by a sum of k of
them (the full sum's error cancels; the k exps' errors, k - 1 roundings and the divisions
remain); routed scaling is one more rounding. One implementation against float64:
(E + k + 16) u for softmax, (k + 16) u for sigmoid (1 / (1 + e^-x): the exp, an add and a
division, no E-term sum). Two implementations differ by at most twice that (W_RTOL).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fusedist  # noqa: E402,F401
from fusedist import _ext, tuning  # noqa: E402
from fusedist.errors import MetadataError  # noqa: E402
from fusedist.ops import device_errors  # noqa: E402
from fusedist.ops.moe import gating as G  # noqa: E402
from fusedist.ops.moe.gating import (MoeLayout, RouterSpec, capacity, route,  # noqa: E402
                                     route_and_sort, route_reference, sort_by_expert,
                                     sort_by_expert_reference)

U = 2.0 ** -24
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def w_rtol(spec: RouterSpec, E: int) -> float:
    """Two fp32 implementations' weights differ by at most this, relative; one against
    float64 by half of it (module docstring)."""
    if spec.scoring == "softmax":
        return 2 * (E + spec.top_k + 16) * U
    return 2 * (spec.top_k + 16) * U


def _gen(seed=None) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(int(torch.randint(1 << 30, ())) if seed is None else seed)
    return g


def _logits(T, E, dtype, device, gen, scale=2.0):
    """Fresh logits; float32 ones on a 2^-6 grid (distinct values differ by >= 2^-6, so their
    softmax probabilities never fall within rounding of each other)."""
    x = torch.randn(T, E, generator=gen) * scale
    if dtype == torch.float32:
        x = torch.round(x * 64) / 64
    return x.to(dtype).to(device)


def _bias(E, device, gen):
    return (torch.randn(E, generator=gen) * 0.25).to(device)


# (name, spec for (E, k), takes a bias): the routing schemes in use.
def _spec(scheme: str, E: int, k: int) -> RouterSpec:
    if scheme == "softmax":              # Qwen2-MoE (norm_topk_prob false)
        return RouterSpec(k, "softmax", False)
    if scheme == "softmax_renorm":       # Mixtral, Qwen3-MoE norm_topk_prob
        return RouterSpec(k, "softmax", True)
    if scheme == "sigmoid_bias":
        return RouterSpec(k, "sigmoid", True)
    if scheme == "deepseek":             # DeepSeek-V3: 8 groups, 4 kept, scaling 2.5
        return RouterSpec(k, "sigmoid", True, num_groups=8, topk_groups=4, routed_scaling=2.5)
    if scheme == "softmax_groups":
        return RouterSpec(k, "softmax", False, num_groups=4, topk_groups=2, routed_scaling=1.5)
    raise KeyError(scheme)


def _has_bias(scheme):
    return scheme in ("sigmoid_bias", "deepseek")


# ---- independent float64 definitions --------------------------------------------------------

def hf_route_token(x: list, spec: RouterSpec, bias=None):
    """One token routed in float64, written as the HF models do it (softmax or sigmoid scores;
    DeepSeek-V3: group score = sum of the two best biased scores, topk_group groups kept,
    experts chosen by biased score, weights = unbiased scores); ties to the lower index.
    Returns (ids, weights, margin): margin = the smallest relative nonzero gap between values
    whose order decided the result (groups and the first k + 1 experts)."""
    E, k = len(x), spec.top_k
    if spec.scoring == "softmax":
        m = max(x)
        e = [math.exp(v - m) for v in x]
        s = sum(e)
        scores = [v / s for v in e]
    else:
        scores = [1.0 / (1.0 + math.exp(-v)) for v in x]
    choice = [scores[i] + (bias[i] if bias is not None else 0.0) for i in range(E)]
    gaps = []

    def ranked(vals, n):
        order = sorted(range(len(vals)), key=lambda i: (-vals[i], i))
        top = [vals[i] for i in order[:n + 1]]
        gaps.extend(abs(a - b) / max(abs(a), abs(b), 1e-30) for a, b in zip(top, top[1:])
                    if a != b and math.isfinite(a) and math.isfinite(b))
        return order[:n]

    if spec.num_groups > 1:
        g = spec.num_groups
        size = E // g
        gscore = []
        for gi in range(g):
            vals = sorted(choice[gi * size:(gi + 1) * size], reverse=True)
            gscore.append(vals[0] + vals[1] if spec.scoring == "sigmoid" else vals[0])
        keep = set(ranked(gscore, spec.topk_groups))
        choice = [c if i // size in keep else -math.inf for i, c in enumerate(choice)]
    ids = ranked(choice, k)
    w = [scores[i] for i in ids]
    if spec.renormalize:
        s = sum(w)
        w = [v / s for v in w]
    w = [v * spec.routed_scaling for v in w]
    return ids, w, min(gaps, default=1.0)


def weights64(logits: torch.Tensor, ids: torch.Tensor, spec: RouterSpec) -> torch.Tensor:
    """The float64 weights of the given ids (the same formulas, vectorized)."""
    x = logits.double().cpu()
    s = torch.softmax(x, -1) if spec.scoring == "softmax" else torch.sigmoid(x)
    w = s.gather(1, ids.long().cpu())
    if spec.renormalize:
        w = w / w.sum(-1, keepdim=True)
    return w * spec.routed_scaling


def brute_layout(ids: torch.Tensor, E: int, align: int, rows=None):
    """Per-expert lists of the pairs, in ascending (token, slot) order."""
    flat = [int(v) for v in ids.reshape(-1).tolist()]
    per = [[] for _ in range(E)]
    for i, e in enumerate(flat):
        per[e].append(i)
    counts = [len(p) for p in per]
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + -(-c // align) * align)
    rows = capacity(ids.shape[0], E, ids.shape[1], align) if rows is None else rows
    src = [-1] * rows
    dest = [0] * len(flat)
    for e in range(E):
        for j, i in enumerate(per[e]):
            src[offsets[e] + j] = i
            dest[i] = offsets[e] + j
    i32 = torch.int32
    return (torch.tensor(counts, dtype=i32), torch.tensor(offsets, dtype=i32),
            torch.tensor(src, dtype=i32), torch.tensor(dest, dtype=i32))


def _same_layout(lay: MoeLayout, want, what=""):
    names = ("counts", "offsets", "src_index", "dest_index")
    got = (lay.counts, lay.offsets, lay.src_index, lay.dest_index)
    for n, a, b in zip(names, got, want):
        a = a.cpu()
        assert a.dtype == torch.int32, f"{n} dtype {a.dtype} {what}"
        assert a.shape == b.shape, f"{n} shape {tuple(a.shape)} != {tuple(b.shape)} {what}"
        b = b.cpu()
        bad = (a != b).nonzero()
        if bad.numel():
            i = tuple(bad[0])
            raise AssertionError(f"{n}: {bad.shape[0]} entries differ, first at "
                                 f"{bad[0].tolist()}: {a[i]} != {b[i]} {what}")


# ---- CPU tier: the references ---------------------------------------------------------------

CPU_CASES = [  # (scheme, T, E, k)
    ("softmax_renorm", 37, 8, 2),      # Mixtral-8x7B
    ("softmax_renorm", 23, 128, 8),    # Qwen3-MoE (norm_topk_prob)
    ("softmax", 29, 60, 4),            # Qwen2-MoE-A2.7B
    ("deepseek", 19, 256, 8),          # DeepSeek-V3
    ("sigmoid_bias", 31, 64, 6),
    ("softmax_groups", 17, 64, 6),
    ("softmax", 5, 7, 7),              # k = E
    ("softmax_renorm", 11, 32, 1),     # k = 1
]


@pytest.mark.parametrize("scheme,T,E,k", CPU_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_route_reference_against_float64_loop(scheme, T, E, k, dtype):
    gen = _gen()
    spec = _spec(scheme, E, k)
    x = _logits(T, E, dtype, "cpu", gen)
    bias = _bias(E, "cpu", gen) if _has_bias(scheme) else None
    bs = bias.double().tolist() if bias is not None else None
    # A token whose deciding scores lie within 1e-4 (relative) of each other is routed by
    # fp32 rounding in an order float64 does not share: not comparable. Such tokens (about 3%
    # under DeepSeek-V3's and 1% under sigmoid_bias's scheme, none under the others) get fresh
    # logits, so every one of the T tokens is compared; exact ties have their own test.
    for t in range(T):
        for _ in range(50):
            if hf_route_token(x[t].double().tolist(), spec, bs)[2] >= 1e-4:
                break
            x[t] = _logits(1, E, dtype, "cpu", gen)[0]
        else:
            raise AssertionError(f"token {t}: 50 draws of logits, each a near tie")
    ids, w = route_reference(x, spec, bias)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert ids.shape == (T, k) and w.shape == (T, k)
    xs = x.double().tolist()
    for t in range(T):
        want_ids, want_w, _ = hf_route_token(xs[t], spec, bs)
        assert ids[t].tolist() == want_ids, f"token {t}: {ids[t].tolist()} != {want_ids}"
        err = (w[t].double() - torch.tensor(want_w)).abs()
        assert bool((err <= w_rtol(spec, E) / 2 * torch.tensor(want_w).abs()).all()), \
            f"token {t}: weights {w[t].tolist()} vs {want_w}"


def test_route_reference_ties_go_to_the_lower_index():
    E, k = 16, 4
    x = torch.zeros(3, E)
    x[1, [3, 9, 12]] = 1.0                        # three tied leaders, then 13 tied zeros
    x[2, [15, 2]] = 2.0
    x[2, [7, 4]] = 1.0
    ids, w = route_reference(x, RouterSpec(k, "softmax", True))
    assert ids[0].tolist() == [0, 1, 2, 3]
    assert torch.equal(w[0], torch.full((k,), 0.25))
    assert ids[1].tolist() == [3, 9, 12, 0]
    assert ids[2].tolist() == [2, 15, 4, 7]
    # groups tied: the lower group index is kept
    spec = RouterSpec(2, "sigmoid", False, num_groups=4, topk_groups=1)
    ids, _ = route_reference(torch.zeros(2, E), spec)
    assert ids.tolist() == [[0, 1], [0, 1]]
    # a bias decides the choice, the unbiased score the weight
    bias = torch.zeros(E)
    bias[5] = 1.0
    ids, w = route_reference(torch.zeros(1, E), RouterSpec(1, "sigmoid"), bias)
    assert ids.tolist() == [[5]] and w.tolist() == [[0.5]]


def test_route_reference_ids_in_descending_score_order():
    gen = _gen()
    x = _logits(50, 64, torch.float32, "cpu", gen)
    for spec, bias in ((RouterSpec(8, "softmax"), None),
                       (_spec("deepseek", 64, 8), _bias(64, "cpu", gen))):
        ids, _ = route_reference(x, spec, bias)
        s = torch.softmax(x, -1) if spec.scoring == "softmax" else torch.sigmoid(x)
        choice = s + (bias if bias is not None else 0)
        c = choice.gather(1, ids.long())
        assert bool((c[:, :-1] >= c[:, 1:]).all())


@pytest.mark.parametrize("T,k,E,align", [(1, 1, 8, 1), (3, 2, 8, 4), (17, 6, 60, 1),
                                         (100, 8, 128, 8), (37, 8, 256, 128), (0, 2, 8, 4)])
@pytest.mark.parametrize("idtype", (torch.int32, torch.int64))
def test_sort_reference_against_brute_force(T, k, E, align, idtype):
    gen = _gen()
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]) if T else \
        torch.zeros(0, k, dtype=torch.long)
    ids = ids.to(idtype)
    lay = sort_by_expert(ids, E, align)
    assert lay.rows == capacity(T, E, k, align) and lay.top_k == k and lay.align == align
    _same_layout(lay, brute_layout(ids, E, align), f"T={T}")
    _same_layout(sort_by_expert_reference(ids, E, align), brute_layout(ids, E, align))
    if T:
        more = lay.rows + 5
        _same_layout(sort_by_expert(ids, E, align, rows=more), brute_layout(ids, E, align, more))


def test_sort_reference_skewed_routings():
    """One expert takes every pair; most experts get none; an expert list with repeats."""
    E = 16
    one = torch.full((9, 1), 11, dtype=torch.int32)
    for align in (1, 8):
        _same_layout(sort_by_expert(one, E, align), brute_layout(one, E, align))
    few = torch.tensor([[3, 7], [7, 3], [3, 7], [7, 3]], dtype=torch.int32)
    lay = sort_by_expert(few, E, 4)
    _same_layout(lay, brute_layout(few, E, 4))
    assert lay.counts.tolist() == [0, 0, 0, 4] + [0] * 3 + [4] + [0] * 8
    rep = torch.tensor([[1, 1, 1]], dtype=torch.int32)   # not route's output, still a layout
    _same_layout(sort_by_expert(rep, 4, 2), brute_layout(rep, 4, 2))


def test_route_and_sort_is_route_then_sort():
    gen = _gen()
    x = _logits(13, 60, torch.bfloat16, "cpu", gen)
    spec = RouterSpec(4, "softmax", True)
    ids, w, lay = route_and_sort(x, spec, align=8)
    ids2, w2 = route(x, spec)
    assert torch.equal(ids, ids2) and torch.equal(w, w2)
    _same_layout(lay, brute_layout(ids2, 60, 8))
    assert lay.align == 8 and lay.top_k == 4


def test_capacity_bound_holds_for_worst_routings():
    """capacity() rows hold any routing: every expert non-empty, or one expert holding all."""
    for T, E, k, align in [(1, 8, 2, 128), (5, 8, 2, 16), (64, 256, 8, 128), (3, 4, 4, 3)]:
        worst = torch.arange(T * k).remainder(E).view(T, k)
        lay = sort_by_expert_reference(worst, E, align)
        assert int(lay.offsets[-1]) <= capacity(T, E, k, align)


def test_shipped_knob_section():
    kn = tuning.section_values(tuning.gpu_table(), "moe_gating")
    assert set(kn) == {"fused_max_tokens", "sort_one_cta_max_pairs", "sort_chunk_pairs"}
    assert kn["sort_chunk_pairs"] % 512 == 0
    assert "benchmarks/moe.py" in tuning.gpu_table()["moe_gating"]["benchmark"]


def test_cpu_tensors_plan_the_reference():
    x = torch.randn(2, 8)
    assert G.plan(x, RouterSpec(2)).path == "reference"
    assert "cpu" in G.plan(x, RouterSpec(2)).why
    assert G.sort_plan(torch.zeros(2, 2, dtype=torch.int32), 8).path == "reference"


# ---- CPU tier: bad input --------------------------------------------------------------------

def _bad_route_cases():
    x = torch.randn(4, 8)
    return [
        (lambda: route(x.long(), RouterSpec(2)), "logits must be a 2-D"),
        (lambda: route(x[0], RouterSpec(2)), "logits must be a 2-D"),
        (lambda: route(torch.randn(4, 0), RouterSpec(1)), "logits has no experts"),
        (lambda: route(x, "top2"), "spec must be a fusedist.ops.moe.RouterSpec"),
        (lambda: route(x, RouterSpec(0)), "top_k must be an int in"),
        (lambda: route(x, RouterSpec(9)), "top_k must be an int in"),
        (lambda: route(x, RouterSpec(True)), "top_k must be an int in"),
        (lambda: route(x, RouterSpec(2, "relu")), "scoring must be one of"),
        (lambda: route(x, RouterSpec(2, num_groups=3)), "num_groups must be a positive divisor"),
        (lambda: route(x, RouterSpec(2, num_groups=4, topk_groups=5)), "topk_groups must be"),
        (lambda: route(x, RouterSpec(4, num_groups=4, topk_groups=1)), "top_k=4 exceeds"),
        (lambda: route(x, RouterSpec(1, "sigmoid", num_groups=8)), "each group needs >= 2"),
        (lambda: route(x, RouterSpec(2, routed_scaling=0.0)), "routed_scaling must be"),
        (lambda: route(x, RouterSpec(2, routed_scaling=float("inf"))), "routed_scaling must be"),
        (lambda: route(x, RouterSpec(2), torch.zeros(8)), "bias .* goes with scoring='sigmoid'"),
        (lambda: route(x, RouterSpec(2, "sigmoid"), torch.zeros(7)), "bias must be a float"),
        (lambda: route(x, RouterSpec(2, "sigmoid"), torch.zeros(8, dtype=torch.long)),
         "bias must be a float"),
        (lambda: route_and_sort(x, RouterSpec(2), align=0), "align must be a positive int"),
        (lambda: route_and_sort(x, RouterSpec(2), rows=7), "rows=7 cannot hold"),
    ]


def _bad_sort_cases():
    ids = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    return [
        (lambda: sort_by_expert(ids, 0), "num_experts must be a positive int"),
        (lambda: sort_by_expert(ids, True), "num_experts must be a positive int"),
        (lambda: sort_by_expert(ids.float(), 4), "ids must be a 2-D"),
        (lambda: sort_by_expert(ids[0], 4), "ids must be a 2-D"),
        (lambda: sort_by_expert(ids[:, :0], 4), "ids has top_k = 0"),
        (lambda: sort_by_expert(ids, 4, align=0), "align must be a positive int"),
        (lambda: sort_by_expert(ids, 4, align=2.0), "align must be a positive int"),
        (lambda: sort_by_expert(ids, 4, rows=3), r"rows=3 cannot hold .* rows >= 4"),
        (lambda: sort_by_expert(ids, 4, 2, rows=7), r"rows >= 8"),
        (lambda: sort_by_expert(ids, 3), r"ids must be expert indices in \[0, 3\), got values "
                                         r"in \[0, 3\]"),
        (lambda: sort_by_expert(ids - 1, 4), r"in \[-1, 2\]"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_route_cases())))
def test_route_rejects_bad_input(case):
    fn, match = _bad_route_cases()[case]
    with pytest.raises((ValueError, TypeError), match=match):
        fn()


@pytest.mark.parametrize("case", range(len(_bad_sort_cases())))
def test_sort_rejects_bad_input(case):
    fn, match = _bad_sort_cases()[case]
    with pytest.raises(ValueError, match=match):
        fn()


def test_bad_input_errors_name_the_function():
    with pytest.raises(ValueError, match=r"^fusedist\.ops\.moe: top_k"):
        route(torch.randn(2, 4), RouterSpec(5))


# ---- CPU tier: torch.library ----------------------------------------------------------------

def test_ops_registered_and_opcheck():
    gen = _gen()
    x = _logits(5, 16, torch.float32, "cpu", gen)
    b = _bias(16, "cpu", gen)
    args = (x, b, 4, "sigmoid", True, 4, 2, 2.5)
    torch.library.opcheck(torch.ops.fusedist.moe_route.default, args)
    ids, _ = torch.ops.fusedist.moe_route(*args)
    torch.library.opcheck(torch.ops.fusedist.moe_sort_by_expert.default, (ids, 16, 8, 140))
    torch.library.opcheck(torch.ops.fusedist.moe_route_sort.default, (*args, 8, 140))
    got = torch.ops.fusedist.moe_route_sort(*args, 8, 140)
    lay = sort_by_expert(ids, 16, 8, rows=140)
    for a, e in zip(got[2:], (lay.counts, lay.offsets, lay.src_index, lay.dest_index)):
        assert torch.equal(a, e)


def _pipeline(x, b):
    spec = RouterSpec(4, "sigmoid", True, num_groups=4, topk_groups=2, routed_scaling=2.5)
    ids, w = route(x, spec, b)
    lay = sort_by_expert(ids, x.shape[1], align=4)
    ids2, w2, lay2 = route_and_sort(x, spec, b, align=4)
    return ids, w, lay.counts, lay.offsets, lay.src_index, lay.dest_index, ids2, w2, \
        lay2.src_index


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_under_torch_compile_fullgraph(backend):
    torch._dynamo.reset()
    gen = _gen()
    x = _logits(7, 16, torch.float32, "cpu", gen)
    b = _bias(16, "cpu", gen)
    want = _pipeline(x, b)
    got = torch.compile(_pipeline, fullgraph=True, backend=backend)(x, b)
    for a, e in zip(got, want):
        assert torch.equal(a, e)
    torch._dynamo.reset()


# ---- gpu tier --------------------------------------------------------------------------------

def _need_kernel():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    why = _ext.why_not("moe_gating", "cuda")
    if why:
        pytest.fail(f"the gpu tier needs the moe_gating kernel: {why}")


@pytest.fixture
def clean_record():
    """The device error record clear before and after (a test that records one resets it)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        device_errors.clear_device_errors("all")
    yield
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        device_errors.clear_device_errors("all")


def _poisoned_route_out(T, k):
    return (torch.full((T, k), -7, dtype=torch.int32, device="cuda"),
            torch.full((T, k), float("nan"), device="cuda"))


def _poisoned_layout_out(T, k, E, rows):
    return tuple(torch.full((n,), -7, dtype=torch.int32, device="cuda")
                 for n in (E, E + 1, rows, T * k))


def _check_route(ids, w, x, spec, bias, what):
    """ids exactly the reference's on the same device (and on the CPU where the comparison is
    well defined: softmax on grid logits); weights within W_RTOL of it and of float64."""
    ref_ids, ref_w = route_reference(x, spec, bias)
    assert ids.shape == ref_ids.shape and w.shape == ref_w.shape, what
    bad = (ids != ref_ids).any(-1).nonzero().flatten()
    assert bad.numel() == 0, f"{what}: {bad.numel()} tokens choose other experts, first " \
                             f"{int(bad[0])}: {ids[bad[0]].tolist()} vs {ref_ids[bad[0]].tolist()}"
    assert bool(((ids >= 0) & (ids < x.shape[1])).all()), what
    if spec.scoring == "softmax":
        cpu_ids, _ = route_reference(x.cpu(), spec, None if bias is None else bias.cpu())
        assert torch.equal(ids.cpu(), cpu_ids), f"{what}: ids differ from the CPU reference"
    tol = w_rtol(spec, x.shape[1])
    assert bool(torch.isfinite(w).all()), f"{what}: weights not finite"
    err = (w.double() - ref_w.double()).abs()
    assert bool((err <= tol * ref_w.double().abs()).all()), \
        f"{what}: weights off the reference by {float((err / ref_w.double().abs()).max()):.3g} rel"
    w64 = weights64(x, ids, spec).to(w.device)
    err = (w.double() - w64).abs()
    assert bool((err <= tol / 2 * w64.abs() + 1e-300).all()), \
        f"{what}: weights off float64 by {float((err / w64.abs()).max()):.3g} rel"


GPU_CASES = [  # (scheme, T, E, k)
    ("softmax_renorm", 1, 8, 2),        # Mixtral, decode
    ("softmax", 3, 8, 1),
    ("softmax", 17, 60, 4),             # Qwen2-MoE
    ("softmax_renorm", 1000, 128, 8),   # Qwen3-MoE
    ("softmax_renorm", 4097, 128, 8),
    ("softmax", 3, 64, 6),
    ("deepseek", 1, 256, 8),
    ("deepseek", 17, 256, 8),
    ("deepseek", 4097, 256, 8),
    ("deepseek", 3, 256, 1),
    ("sigmoid_bias", 1000, 64, 6),
    ("softmax_groups", 17, 64, 6),
    ("softmax_renorm", 33, 512, 10),    # Qwen3-Next's 512 experts
    ("softmax", 5, 1024, 32),           # the kernel's limits
    ("softmax", 9, 32, 32),             # k = E
    ("sigmoid_bias", 7, 31, 3),         # E not a power of two below a warp
]


@pytest.mark.gpu
@pytest.mark.parametrize("scheme,T,E,k", GPU_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_route_kernel_matches_reference(scheme, T, E, k, dtype):
    _need_kernel()
    gen = _gen()
    spec = _spec(scheme, E, k)
    x = _logits(T, E, dtype, "cuda", gen)
    bias = _bias(E, "cuda", gen) if _has_bias(scheme) else None
    assert G.plan(x, spec).path == "kernel", G.plan(x, spec).why
    out = _poisoned_route_out(T, k)
    ids, w = G._route_kernel(x, spec, bias, out)
    assert ids is out[0] and w is out[1]
    _check_route(ids, w, x, spec, bias, f"{scheme} T={T} E={E} k={k} {dtype}")
    ids2, w2 = route(x, spec, bias)            # the public path: the same kernel, same bits
    assert torch.equal(ids2, ids) and torch.equal(w2, w)


@pytest.mark.gpu
def test_route_kernel_strided_logits_and_ties():
    _need_kernel()
    gen = _gen()
    wide = _logits(40, 80, torch.bfloat16, "cuda", gen)
    x = wide[:, 3:67]                                        # row stride 80, offset 3
    spec = RouterSpec(6, "softmax", True)
    _check_route(*route(x, spec), x, spec, None, "strided")
    t = torch.zeros(4, 64, device="cuda")
    t[1, [60, 7, 33]] = 3.0
    t[2] = float("-inf")                                     # -inf but one expert: ties at 0
    t[2, 40] = 0.0
    t[3] = float("nan")
    ids, w = route(t, RouterSpec(4, "softmax", True))
    ref_ids, _ = route_reference(t, RouterSpec(4, "softmax", True))
    assert ids[0].tolist() == [0, 1, 2, 3] and ids[1].tolist() == [7, 33, 60, 0]
    assert torch.equal(ids[:3], ref_ids[:3])
    assert ids[3].tolist() == [0, 1, 2, 3]                   # NaN row: ids still in range
    assert torch.equal(w[0], torch.full((4,), 0.25, device="cuda"))
    spec = RouterSpec(2, "sigmoid", False, num_groups=8, topk_groups=3)
    z = torch.zeros(2, 64, device="cuda")
    assert torch.equal(route(z, spec)[0], route_reference(z, spec)[0])


@pytest.mark.gpu
@pytest.mark.parametrize("T,k,E", [(1, 1, 8), (3, 2, 8), (17, 6, 60), (1000, 8, 128),
                                   (4097, 8, 128), (16384, 8, 128), (1000, 8, 256),
                                   (333, 4, 1024), (0, 8, 64)])
@pytest.mark.parametrize("align", (1, 8, 128))
@pytest.mark.parametrize("chunk", ("plan", "one_cta", 512, 4096))
def test_sort_kernel_matches_reference(T, k, E, align, chunk):
    _need_kernel()
    pairs = T * k
    if chunk == "one_cta" and pairs > _ext.load().MOE_SORT_SMALL_MAX_PAIRS:
        pytest.skip("more pairs than one CTA sorts")
    gen = _gen()
    # fresh routings: uniform, skewed (a quarter of the experts take everything) and the ids
    # of real routings
    ids = torch.randint(0, E, (T, k), generator=gen, dtype=torch.int32)
    if T % 2:
        ids = ids % max(1, E // 4)
    ids = ids.cuda()
    rows = capacity(T, E, k, align) + (3 if T % 3 == 0 else 0)
    p = G.sort_plan(ids, E, None if chunk == "plan" else (0 if chunk == "one_cta" else chunk))
    assert p.path == "kernel", p.why
    out = _poisoned_layout_out(T, k, E, rows)
    got = G._sort_impl(ids, E, align, rows, p, out)
    _same_layout(MoeLayout(*got, k, align), brute_layout(ids.cpu(), E, align, rows),
                 f"T={T} k={k} E={E} align={align} {chunk}")
    lay = sort_by_expert(ids.long(), E, align, rows)        # int64 ids, the public path
    _same_layout(lay, brute_layout(ids.cpu(), E, align, rows), "int64")


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", ("one_cta", 512))
def test_sort_kernel_one_expert_takes_all_and_empty_experts(chunk):
    _need_kernel()
    for T, k, E, val in [(2000, 1, 64, 63), (500, 4, 256, 0)]:
        ids = torch.full((T, k), val, dtype=torch.int32, device="cuda")
        if k > 1:
            ids[:, 1:] = torch.arange(1, k, device="cuda", dtype=torch.int32)
        p = G.sort_plan(ids, E, 0 if chunk == "one_cta" else chunk)
        got = G._sort_impl(ids, E, 16, capacity(T, E, k, 16), p)
        _same_layout(MoeLayout(*got, k, 16), brute_layout(ids.cpu(), E, 16), f"{T} {val}")


@pytest.mark.gpu
@pytest.mark.parametrize("scheme,T,E,k", [("softmax_renorm", 1, 128, 8),
                                          ("softmax_renorm", 16, 128, 8),
                                          ("deepseek", 64, 256, 8), ("softmax", 7, 8, 2),
                                          ("softmax_renorm", 300, 512, 10),
                                          ("softmax", 200, 1024, 32)])
@pytest.mark.parametrize("fused", (True, False))
@pytest.mark.parametrize("align", (1, 128))
def test_route_and_sort_kernel(scheme, T, E, k, fused, align):
    _need_kernel()
    if fused and T * k > _ext.load().MOE_SORT_SMALL_MAX_PAIRS:
        pytest.skip("more pairs than the fused kernel takes")
    gen = _gen()
    spec = _spec(scheme, E, k)
    x = _logits(T, E, torch.bfloat16, "cuda", gen)
    bias = _bias(E, "cuda", gen) if _has_bias(scheme) else None
    rows = capacity(T, E, k, align)
    out = _poisoned_route_out(T, k) + _poisoned_layout_out(T, k, E, rows)
    got = G._route_sort_impl(x, spec, bias, align, rows, fused=fused, out=out)
    ids, w = got[0], got[1]
    _check_route(ids, w, x, spec, bias, f"{scheme} T={T} fused={fused}")
    _same_layout(MoeLayout(*got[2:], k, align), brute_layout(ids.cpu(), E, align, rows),
                 f"{scheme} T={T} fused={fused}")
    ids2, w2, lay2 = route_and_sort(x, spec, bias, align=align)   # the planner's choice
    assert torch.equal(ids2, ids) and torch.equal(w2, w)
    _same_layout(lay2, got[2:])


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", ("one_cta", 512))
def test_sort_kernel_records_ids_out_of_range(chunk, clean_record):
    """An id outside [0, E): recorded (MetadataError names it), its pair left out of the layout
    (dest_index -1, not counted), every other pair placed as the reference places the valid
    ones; nothing outside the tensors is touched (the poison around the layout stays)."""
    _need_kernel()
    E, T, k = 16, 600, 2
    ids = torch.randint(0, E, (T, k), dtype=torch.int32, device="cuda")
    ids[37, 1] = 300
    ids[500, 0] = -2
    rows = capacity(T, E, k, 1)
    big = torch.full((rows + 64,), -7, dtype=torch.int32, device="cuda")
    src = big[32:32 + rows]
    out = (torch.empty(E, dtype=torch.int32, device="cuda"),
           torch.empty(E + 1, dtype=torch.int32, device="cuda"), src,
           torch.full((T * k,), -7, dtype=torch.int32, device="cuda"))
    got = G._sort_impl(ids, E, 1, rows, G.sort_plan(ids, E, 0 if chunk == "one_cta" else chunk),
                       out)
    torch.cuda.synchronize()
    with pytest.raises(MetadataError, match=r"sort_by_expert: ids\[(37, 1\] = 300|500, 0\] = -2)"
                                            r".* outside the 16 experts"):
        fusedist.check_device_errors()
    dest = got[3].cpu()
    assert dest[37 * k + 1] == -1 and dest[500 * k] == -1
    valid = ids.clone().cpu()
    keep = torch.ones(T * k, dtype=torch.bool)
    keep[[37 * k + 1, 500 * k]] = False
    assert int(got[0].sum()) == T * k - 2
    # the valid pairs: each in its expert's segment, in ascending order, rows distinct
    src_cpu = got[2].cpu()
    placed = dest[keep]
    assert len(set(placed.tolist())) == placed.numel()
    assert torch.equal(src_cpu[placed.long()], torch.arange(T * k)[keep].int())
    assert bool((big[:32] == -7).all()) and bool((big[32 + rows:] == -7).all())
    flat = valid.view(-1)
    offs = got[1].cpu()
    for i in torch.arange(T * k)[keep].tolist():
        e = int(flat[i])
        assert offs[e] <= dest[i] < offs[e + 1]


@pytest.mark.gpu
def test_route_and_sort_in_a_cuda_graph_replays_new_routings(clean_record):
    """One capture of route_and_sort (fused at decode size) and of the chunked path; replays
    with new logits equal eager calls bitwise."""
    _need_kernel()
    gen = _gen()
    cases = [(16, RouterSpec(8, "softmax", True), 128, None, 1),
             (3000, _spec("deepseek", 256, 8), 256, _bias(256, "cuda", gen), 128)]
    for T, spec, E, bias, align in cases:
        x = _logits(T, E, torch.bfloat16, "cuda", gen)
        route_and_sort(x, spec, bias, align=align)                     # warm-up
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            ids, w, lay = route_and_sort(x, spec, bias, align=align)
        for _ in range(3):
            x.copy_(_logits(T, E, torch.bfloat16, "cuda", gen))
            for t in (ids, lay.counts, lay.offsets, lay.src_index, lay.dest_index):
                t.fill_(-7)
            w.fill_(float("nan"))
            g.replay()
            e_ids, e_w, e_lay = route_and_sort(x.clone(), spec, bias, align=align)
            assert torch.equal(ids, e_ids) and torch.equal(w, e_w)
            _same_layout(lay, (e_lay.counts, e_lay.offsets, e_lay.src_index, e_lay.dest_index))
            _check_route(ids, w, x, spec, bias, f"graph T={T}")


@pytest.mark.gpu
def test_route_and_sort_under_torch_compile_cuda():
    _need_kernel()
    torch._dynamo.reset()
    gen = _gen()
    x = _logits(9, 64, torch.bfloat16, "cuda", gen)
    b = _bias(64, "cuda", gen)
    want = _pipeline(x, b)
    got = torch.compile(_pipeline, fullgraph=True)(x, b)
    for a, e in zip(got, want):
        assert torch.equal(a, e)
    torch._dynamo.reset()
