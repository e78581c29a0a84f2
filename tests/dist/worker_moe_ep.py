"""Expert parallelism in fusedist.nn.MoE and the MoE models (MoE(ep=True), build_model(ep=True)),
run on every rank: gloo on CPUs (tests/models/test_moe_ep.py at 2 and 4 ranks), and the checks
marked @emulated on ranks emulated on one GPU (the Buffer's low-latency kernels).

Every rank rebuilds the whole layer from the run's seed and holds it at EP 1 too (one rank
with every expert), so each checks its own partial: its balanced share of the tokens bitwise
equal to EP 1's rows (float32; bfloat16 where both sides run the same grouped GEMM per expert
segment), every other row exactly zero (the model's all-reduce then sums exact zeros with one
nonzero partial per row). Uneven shares: 1, 3 and 13 tokens (a rank with no tokens below the
world size). Also: a step in pieces (a Buffer smaller than the step), the shared expert,
bfloat16 against the float64 loop beside tensor parallelism over the intermediate, FP8
experts, the tiny models' greedy ids against transformers, FP8 checkpoints read expert by
expert (each rank only its experts' tensors).

    torchrun --nproc-per-node 2 tests/dist/worker_moe_ep.py
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "models"))
from _checks import CPU_ONLY, check, emulated, main, not_emulated, rank_seed, skip  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from fusedist.distributed.groups import Group  # noqa: E402
from fusedist.nn import MoE  # noqa: E402
from fusedist.nn.moe import token_share  # noqa: E402
from fusedist.nn.quant import FP8, quantize_fp8  # noqa: E402
from fusedist.ops.moe import RouterSpec  # noqa: E402
from tolerances import GEMM_REL, count_bad_gemm, gemm_rel_err  # noqa: E402

# {kind: dir}: tiny Mixtral / Qwen3-MoE / Qwen2-MoE checkpoints whose experts split over the
# ranks; {"bf16": dir, "hf-block": dir}: a tiny Qwen3-MoE and its block-scaled FP8 form.
CKPTS = json.loads(os.environ.get("FUSEDIST_MOE_EP_CKPTS", "{}"))
FP8_CKPTS = json.loads(os.environ.get("FUSEDIST_MOE_EP_FP8_CKPTS", "{}"))


@dataclass
class _Solo(Group):
    """A group of this rank alone (EP 1: the layer holding every expert)."""

    @property
    def rank(self) -> int:
        return 0


def solo(rt) -> Group:
    return _Solo(name=f"solo{rt.tp.rank}", ranks=(rt.tp.ranks[rt.tp.rank],), pg=None,
                 device=rt.device)


def weights(seed, *parts, E, H, I, S=0):
    """Full random weights every rank rebuilds (float32, CPU)."""
    g = torch.Generator().manual_seed(rank_seed(seed, *parts) % (1 << 62))
    rnd = lambda *s: torch.randn(*s, generator=g) * 0.2   # noqa: E731
    return {"router": rnd(E, H) * 8, "experts": [(rnd(I, H), rnd(I, H), rnd(H, I))
                                                 for _ in range(E)],
            "shared": (rnd(S, H), rnd(S, H), rnd(H, S), rnd(1, H) * 5) if S else None,
            "x": lambda T: (torch.randn(T, H, generator=g) * 2)}


def layer(w, spec, dtype, group, device, ep=False, fp8_layout=None) -> MoE:
    E, H = w["router"].shape
    I = w["experts"][0][0].shape[0]
    S = w["shared"][0].shape[0] if w["shared"] else 0
    m = MoE(H, E, I, spec, shared_intermediate_size=S, group=group, dtype=dtype, device=device,
            fp8_layout=fp8_layout, ep=ep)
    W, r = group.size, group.rank
    split = 1 if ep else W
    i, s = I // split, S // W
    rows = slice(0, I) if ep else slice(r * i, (r + 1) * i)
    cast = (lambda t: quantize_fp8(t.to(device), fp8_layout)) if fp8_layout else \
        (lambda t: t.to(device=device, dtype=dtype))
    m.load_router(w["router"].to(device))
    for e in m.experts:
        gw, uw, dw = w["experts"][e]
        m.load_expert(e, cast(gw[rows]), cast(uw[rows]), cast(dw[:, rows]))
    if S:
        gw, uw, dw, gate = w["shared"]
        sr = slice(r * s, (r + 1) * s)
        m.load_shared(cast(gw[sr]), cast(uw[sr]), cast(dw[:, sr]), gate.to(device))
    return m


def share_errors(rt, got, want, T, what, exact=True) -> list:
    """What is wrong with this rank's partial (empty when nothing): its share's rows must
    equal EP 1's (bitwise, or within float32 GEMM rounding), every other row exactly zero.
    Returned, not raised: a check asserts after its last collective, so a rank that fails
    does not leave its peers waiting in one."""
    lo, hi = token_share(T, rt.tp.size, rt.tp.rank)
    if got.shape != want.shape or got.dtype != want.dtype:
        return [f"{what}: got {got.dtype} {tuple(got.shape)}, EP 1 {want.dtype} "
                f"{tuple(want.shape)}"]
    errs = []
    rest = torch.cat([got[:lo], got[hi:]])
    if not bool((rest == 0).all()):
        errs.append(f"{what}: rows outside this rank's share [{lo}, {hi}) are not zero")
    a, b = got[lo:hi], want[lo:hi]
    if exact:
        bits = torch.int16 if a.element_size() == 2 else torch.int32
        bad = int((a.view(bits) != b.view(bits)).sum())
        if bad:
            errs.append(f"{what}: {bad} elements of rows [{lo}, {hi}) differ from EP 1 (max "
                        f"|diff| {float((a.double() - b.double()).abs().max()):.3e})")
    else:
        err = gemm_rel_err(a, b) if hi > lo else 0.0
        if not err <= GEMM_REL[torch.float32]:
            errs.append(f"{what}: rel err {err:.2e} against EP 1")
    return errs


def summed(rt, part):
    """The partials summed over the group (float32: one nonzero partial per row, exact)."""
    out = part.float().clone()
    dist.all_reduce(out, group=rt.tp.pg)
    return out


def float64_loop(w, x, spec, dtype, fp8_layout=None):
    """Each token's top-k experts' SwiGLU outputs weighted (+ the shared expert) in float64,
    from the weights as the layer holds them (in its dtype, or FP8-quantized)."""
    held = (lambda t: quantize_fp8(t, fp8_layout).dequantize(torch.float64)) if fp8_layout \
        else (lambda t: t.to(dtype).double())
    xd = x.double().cpu()
    probs = torch.softmax((x.float().cpu() @ w["router"].t()).double(), -1)
    top, ids = probs.topk(spec.top_k, -1)
    if spec.renormalize:
        top = top / top.sum(-1, keepdim=True)
    experts = [tuple(held(t) for t in ws) for ws in w["experts"]]
    out = torch.zeros(xd.shape, dtype=torch.float64)
    for t in range(xd.shape[0]):
        for j in range(spec.top_k):
            gw, uw, dw = experts[int(ids[t, j])]
            out[t] += top[t, j] * (dw @ (F.silu(gw @ xd[t]) * (uw @ xd[t])))
        if w["shared"] is not None:
            gw, uw, dw = (held(t) for t in w["shared"][:3])
            out[t] += torch.sigmoid(w["shared"][3].double() @ xd[t]) * \
                (dw @ (F.silu(gw @ xd[t]) * (uw @ xd[t])))
    return out


# ---- the layer ---------------------------------------------------------------------------------
@check
@not_emulated("float32 rows: the low-latency kernels move bfloat16, and emulated ranks have no "
              "all-to-all (NCCL runs one rank per GPU and process)")
def layer_fp32_ep_equals_ep1_bitwise(rt, seed):
    """float32, hidden 72, 8 experts of intermediate 40, top-2 renormalized (Mixtral) and
    top-3 not (Qwen2-MoE's routing), 1, 3 and 13 tokens: each rank's share bitwise EP 1's, the
    rest zero, and the partials summed equal to EP 1 bitwise. The Buffer is made by the first
    step (13 tokens, one piece for every later step)."""
    errs = []
    for spec in (RouterSpec(top_k=2, renormalize=True), RouterSpec(top_k=3)):
        w = weights(seed, "fp32", spec.top_k, E=8, H=72, I=40)
        full = layer(w, spec, torch.float32, solo(rt), rt.device)
        ep = layer(w, spec, torch.float32, rt.tp, rt.device, ep=True)
        assert ep.w13.shape == (8 // rt.tp.size, 80, 72) and ep.inter == 40
        for T in (13, 1, 3):
            x = w["x"](T).to(rt.device)
            want, got = full(x), ep(x)
            what = f"top-{spec.top_k}, {T} tokens"
            errs += share_errors(rt, got, want, T, what)
            if not torch.equal(summed(rt, got), want):
                errs.append(f"{what}: the partials summed differ from EP 1")
        sizes = [b.max_tokens_per_rank for b in ep.exchange.buffers]
        if sizes != [-(-13 // rt.tp.size)]:
            errs.append(f"the first step's Buffer holds {sizes} tokens per rank")
        ep.close()
    assert not errs, "; ".join(errs)


@check
@emulated
def layer_bf16_ep_equals_ep1_bitwise(rt, seed):
    """bfloat16, 8 experts, top-2, 1, 3 and 13 tokens: each rank's share bitwise EP 1's, the
    rest zero. Gloo on CPUs (the high-throughput path; the experts' plain-torch reference);
    on emulated GPU ranks the low-latency kernels, both sides through the grouped GEMM kernel
    (the test's tuning file sets moe.gemv_max_pairs 0: the grouped GEMV splits K by the
    routing of every expert, so its rows' rounding depends on the other experts' counts)."""
    cuda = rt.device.type == "cuda"
    if cuda:
        from fusedist import _ext
        from fusedist.ops.moe.grouped_gemm import available, preferred_path
        if _ext.why_not("ep_low_latency", rt.device):
            skip(f"no low-latency kernels: {_ext.why_not('ep_low_latency', rt.device)}")
        if not available(rt.device):
            skip("the grouped GEMM kernel does not run here")
        if preferred_path(rt.device, 1) != "gemm":
            skip("bitwise needs the grouped GEMM kernel on both sides: run with "
                 "FUSEDIST_TUNING_FILE setting moe.gemv_max_pairs to 0 "
                 "(tests/models/test_moe_ep.py does)")
    H, I = (256, 128) if cuda else (72, 40)
    spec = RouterSpec(top_k=2, renormalize=True)
    w = weights(seed, "bf16", E=8, H=H, I=I)
    full = layer(w, spec, torch.bfloat16, solo(rt), rt.device)
    ep = layer(w, spec, torch.bfloat16, rt.tp, rt.device, ep=True)
    ep.reserve(13)
    buf, mode, _ = ep.exchange.step(13, False)
    if cuda:
        assert not buf.why_not["low_latency"], buf.why_not["low_latency"]
    errs = []
    for T in (13, 1, 3):
        x = w["x"](T).to(device=rt.device, dtype=torch.bfloat16)
        want = full(x)
        got = ep(x)
        errs += share_errors(rt, got, want, T, f"bf16 {T} tokens ({mode})")
    ep.close()
    assert not errs, "; ".join(errs)


@check
@not_emulated(CPU_ONLY)
def layer_in_pieces_and_shared_expert(rt, seed):
    """A Buffer of one token per rank (reserve(world)) takes a 13-token step in 7 pieces: the
    share within float32 GEMM rounding of EP 1 (each piece's expert segments are shorter),
    the rest zero. The shared expert (tensor-parallel over its intermediate, added to the
    partial): the partials summed within float32 rounding of EP 1."""
    W = rt.tp.size
    spec = RouterSpec(top_k=2, renormalize=True)
    w = weights(seed, "pieces", E=8, H=72, I=40)
    full = layer(w, spec, torch.float32, solo(rt), rt.device)
    ep = layer(w, spec, torch.float32, rt.tp, rt.device, ep=True)
    ep.reserve(W)
    x = w["x"](13)
    errs = share_errors(rt, ep(x), full(x), 13, "13 tokens in pieces of 1 a rank", exact=False)
    if [b.max_tokens_per_rank for b in ep.exchange.buffers] != [1]:
        errs.append("reserve(world) did not make a Buffer of one token per rank")
    ep.close()

    w = weights(seed, "shared", E=8, H=72, I=40, S=24)
    full = layer(w, spec, torch.float32, solo(rt), rt.device)
    ep = layer(w, spec, torch.float32, rt.tp, rt.device, ep=True)
    for T in (13, 1):
        x = w["x"](T)
        err = gemm_rel_err(summed(rt, ep(x)), full(x))
        if not err <= GEMM_REL[torch.float32]:
            errs.append(f"shared expert, {T} tokens: rel err {err:.2e}")
    ep.close()
    assert not errs, "; ".join(errs)


@check
@not_emulated(CPU_ONLY)
def layer_bf16_within_rounding_beside_tp(rt, seed):
    """bfloat16 at EP and at TP over the intermediate, both within bf16 GEMM rounding of the
    float64 loop (element-wise and in norm), and of each other."""
    spec = RouterSpec(top_k=3, renormalize=True)
    w = weights(seed, "bf16tp", E=8, H=72, I=40)
    ep = layer(w, spec, torch.bfloat16, rt.tp, rt.device, ep=True)
    tp = layer(w, spec, torch.bfloat16, rt.tp, rt.device)
    x = w["x"](13).to(torch.bfloat16)
    ref = float64_loop(w, x, spec, torch.bfloat16)
    got_ep = summed(rt, ep(x)).to(torch.bfloat16)
    got_tp = summed(rt, tp(x)).to(torch.bfloat16)
    for what, got in (("ep", got_ep), ("tp", got_tp)):
        bad, err = count_bad_gemm(got, ref), gemm_rel_err(got, ref)
        assert bad == 0 and err <= GEMM_REL[torch.bfloat16], f"{what}: {bad} bad, rel {err:.2e}"
    assert gemm_rel_err(got_ep, got_tp) <= 2 * GEMM_REL[torch.bfloat16]
    ep.close()


@check
@not_emulated(CPU_ONLY)
def fp8_experts_ep_equal_ep1(rt, seed):
    """FP8 experts (per-channel; block: hidden and intermediate 128) in a float32 model: each
    rank's share bitwise EP 1's (the same e4m3 experts and scales, whole), and within the
    weight-only GEMM bound of the float64 loop over the dequantized weights."""
    if FP8 is None:
        skip("torch without float8_e4m3fn")
    spec = RouterSpec(top_k=2, renormalize=True)
    errs = []
    for fp8_layout, H, I in (("channel", 72, 40), ("block", 128, 128)):
        w = weights(seed, "fp8", fp8_layout, E=8, H=H, I=I)
        full = layer(w, spec, torch.float32, solo(rt), rt.device, fp8_layout=fp8_layout)
        ep = layer(w, spec, torch.float32, rt.tp, rt.device, ep=True, fp8_layout=fp8_layout)
        assert ep.w13.layout == fp8_layout and ep.w13.shape == (8 // rt.tp.size, 2 * I, H)
        for T in (13, 3):
            x = w["x"](T)
            got = ep(x)
            errs += share_errors(rt, got, full(x), T, f"fp8 {fp8_layout}, {T} tokens")
        tot = summed(rt, got).to(torch.bfloat16)
        bad = count_bad_gemm(tot, float64_loop(w, x, spec, torch.float32, fp8_layout))
        if bad:
            errs.append(f"fp8 {fp8_layout}: {bad} elements outside the bf16 GEMM bound")
        ep.close()
    assert not errs, "; ".join(errs)


# ---- the models --------------------------------------------------------------------------------
class Recording:
    """A weight source that records the names it reads."""

    def __init__(self, src):
        self.src, self.read_names = src, set()

    def __getattr__(self, name):
        return getattr(self.src, name)

    def read(self, name, *a, **kw):
        self.read_names.add(name)
        return self.src.read(name, *a, **kw)


def expert_reads(model, src) -> list:
    """Expert tensors of sparse layers this rank read that are not its experts'."""
    import re

    mine = {i: set(layer.mlp.experts) for i, layer in enumerate(model.layers)
            if isinstance(layer.mlp, MoE)}
    bad = []
    for name in src.read_names:
        m = re.search(r"layers\.(\d+)\..*experts\.(\d+)\.", name)
        if m and int(m.group(2)) not in mine[int(m.group(1))]:
            bad.append(name)
    return sorted(bad)


@check
@not_emulated(CPU_ONLY)
def models_match_hf_at_ep(rt, seed):
    """The tiny MoE models at EP = the group's size (float32, gloo): each rank reads only its
    experts' tensors; prefill logits within GEMM_REL[float32] of transformers'; greedy ids
    equal to HF generate() (a divergence only at a near-tie of HF's logits)."""
    from fusedist.models import LlamaConfig, Runner, build_model
    from fusedist.models.llama import SafetensorsWeights
    from hf_tiny import assert_greedy_matches, load_hf

    assert CKPTS, "FUSEDIST_MOE_EP_CKPTS names no checkpoints (tests/models/test_moe_ep.py)"
    ran = 0
    for kind, path in CKPTS.items():
        cfg = LlamaConfig.from_dir(path)
        if cfg.moe.num_experts % rt.tp.size:
            continue
        src = Recording(SafetensorsWeights(path))
        m = build_model(cfg, src, group=rt.tp, dtype=torch.float32, device=rt.device, ep=True)
        assert not expert_reads(m, src), f"{kind}: read other ranks' experts: " \
                                         f"{expert_reads(m, src)[:4]}"
        sparse = [layer.mlp for layer in m.layers if isinstance(layer.mlp, MoE)]
        assert sparse and all(s.ep and s.exchange is sparse[0].exchange for s in sparse)
        hf = load_hf(path)
        g = torch.Generator().manual_seed(seed % 1000)
        prompt = torch.randint(0, cfg.vocab_size, (23,), generator=g).tolist()
        r = Runner(m, max_batch=2, max_seq_len=64)
        got = r.prefill([prompt], all_logits=True)[0]
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0]
        err = gemm_rel_err(got, ref)
        assert err <= GEMM_REL[torch.float32], f"{kind}: logits rel err {err:.2e}"
        ids = r.generate([prompt, prompt[:9]], 16).ids
        assert_greedy_matches(hf, prompt, ids[0], GEMM_REL[torch.float32], kind)
        assert_greedy_matches(hf, prompt[:9], ids[1], GEMM_REL[torch.float32], kind)
        r.close()
        m.close()
        ran += 1
    assert ran, f"no checkpoint's experts split over {rt.tp.size} ranks"


@check
@not_emulated(CPU_ONLY)
def fp8_checkpoints_read_per_rank(rt, seed):
    """A block-scaled FP8 checkpoint (HF "fp8") at EP: each rank reads only its experts, whole:
    their e4m3 data and 128 x 128 scales equal the file's (gate | up stacked), and the bf16
    checkpoint quantized at load (--quantize fp8: per-channel) holds quantize_fp8 of each
    whole expert. The FP8 model's logits equal those of the bf16 checkpoint quantized to
    blocks at load, and (where its experts' shards are whole blocks: 2 ranks) lie within bf16
    GEMM rounding of the same checkpoint at TP over the intermediate (at 4 ranks TP cannot
    hold it, 64 rows a shard; EP keeps whole experts)."""
    if FP8 is None:
        skip("torch without float8_e4m3fn")
    from safetensors import safe_open

    from fusedist.models import LlamaConfig, Runner, build_model
    from fusedist.models.llama import SafetensorsWeights
    from fusedist.models.llama.weights import check_tp

    assert FP8_CKPTS, "FUSEDIST_MOE_EP_FP8_CKPTS names no checkpoints"
    ckpt, bf16 = FP8_CKPTS["hf-block"], FP8_CKPTS["bf16"]
    cfg = LlamaConfig.from_dir(ckpt)
    src = Recording(SafetensorsWeights(ckpt))
    m = build_model(cfg, src, group=rt.tp, dtype=torch.float32, device=rt.device, ep=True)
    assert not expert_reads(m, src), expert_reads(m, src)[:4]
    mlp, L = m.layers[0].mlp, cfg.moe.num_experts // rt.tp.size
    I = cfg.moe.intermediate_size
    assert mlp.w13.layout == "block" and mlp.w13.shape == (L, 2 * I, cfg.hidden_size)
    with safe_open(os.path.join(ckpt, "model.safetensors"), framework="pt") as f:
        for l, e in enumerate(mlp.experts):
            p = f"model.layers.0.mlp.experts.{e}."
            data = torch.cat([f.get_tensor(p + n + "_proj.weight") for n in ("gate", "up")])
            scale = torch.cat([f.get_tensor(p + n + "_proj.weight_scale_inv").float()
                               for n in ("gate", "up")])
            assert torch.equal(mlp.w13.data[l].view(torch.uint8), data.view(torch.uint8)), e
            assert torch.equal(mlp.w13.scale[l], scale), e
            assert torch.equal(mlp.w2.data[l].view(torch.uint8),
                               f.get_tensor(p + "down_proj.weight").view(torch.uint8)), e
    q = build_model(LlamaConfig.from_dir(bf16), SafetensorsWeights(bf16), group=rt.tp,
                    dtype=torch.float32, device=rt.device, quantize="fp8", ep=True)
    with safe_open(os.path.join(bf16, "model.safetensors"), framework="pt") as f:
        qm = q.layers[0].mlp
        for l, e in enumerate(qm.experts):
            down = quantize_fp8(f.get_tensor(f"model.layers.0.mlp.experts.{e}.down_proj.weight")
                                .float(), "channel")
            assert torch.equal(qm.w2.data[l].view(torch.uint8), down.data.view(torch.uint8))
            assert torch.equal(qm.w2.scale[l], down.scale)
    q.close()
    # the same e4m3 experts quantized at load from the bf16 checkpoint: the same logits
    blk = build_model(LlamaConfig.from_dir(bf16), SafetensorsWeights(bf16), group=rt.tp,
                      dtype=torch.float32, device=rt.device, quantize="fp8-block", ep=True)
    g = torch.Generator().manual_seed(seed % 1000)
    prompt = torch.randint(0, cfg.vocab_size, (17,), generator=g).tolist()
    a = Runner(m, max_batch=1, max_seq_len=32).prefill([prompt], all_logits=True)[0]
    b = Runner(blk, max_batch=1, max_seq_len=32).prefill([prompt], all_logits=True)[0]
    assert torch.equal(a, b), "the FP8 checkpoint's logits differ from the model quantized at load"
    try:   # and, where the experts' shards are whole blocks, beside TP over the intermediate
        check_tp(cfg, rt.tp.size, cfg.quant)
    except ValueError:
        tp = None
    else:
        tp = build_model(cfg, SafetensorsWeights(ckpt), group=rt.tp, dtype=torch.float32,
                         device=rt.device)
    if tp is not None:
        c = Runner(tp, max_batch=1, max_seq_len=32).prefill([prompt], all_logits=True)[0]
        err = gemm_rel_err(a, c)
        assert err <= GEMM_REL[torch.bfloat16], f"FP8 EP against FP8 TP: rel err {err:.2e}"
    m.close()
    blk.close()


if __name__ == "__main__":
    main()
