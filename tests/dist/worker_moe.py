"""fusedist.models' mixture-of-experts decoders at TP > 1 (gloo on CPU): logits and greedy ids
against Hugging Face on the tiny checkpoints tests/models/test_moe_models.py creates (paths
in FUSEDIST_MOE_CKPTS), both backends; the MoE layer's partial sums over the ranks equal to the
layer at TP 1; a block-scaled FP8 checkpoint's shards; random weights identical to slices of
the full random model."""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "models"))
from _checks import check, main  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from fusedist.distributed.groups import Group  # noqa: E402
from fusedist.models import LlamaConfig, Runner, build_model  # noqa: E402
from fusedist.models.llama import RandomWeights, SafetensorsWeights  # noqa: E402
from fusedist.nn import MoE  # noqa: E402
from fusedist.ops.moe import RouterSpec  # noqa: E402
from hf_tiny import assert_greedy_matches, load_hf  # noqa: E402
from tolerances import GEMM_REL, gemm_rel_err  # noqa: E402

CKPTS = json.loads(os.environ.get("FUSEDIST_MOE_CKPTS", "{}"))
# {"bf16": dir, "hf-block": dir}: a tiny Qwen3-MoE and its block-scaled FP8 checkpoint.
FP8_CKPTS = json.loads(os.environ.get("FUSEDIST_MOE_FP8_CKPTS", "{}"))


def _model(rt, path, backend):
    cfg = LlamaConfig.from_dir(path)
    return build_model(cfg, SafetensorsWeights(path), backend=backend, group=rt.tp,
                       dtype=torch.float32, device=rt.device)


@check
def logits_and_greedy_match_hf(rt, seed):
    assert CKPTS, ("FUSEDIST_MOE_CKPTS names no checkpoints (tests/models/test_moe_models.py "
                   "sets it)")
    for kind, path in CKPTS.items():
        hf = load_hf(path)
        for backend in ("fusedist", "torch"):
            m = _model(rt, path, backend)
            g = torch.Generator().manual_seed(seed % 1000)
            prompt = torch.randint(0, m.cfg.vocab_size, (23,), generator=g).tolist()
            r = Runner(m, max_batch=2, max_seq_len=64)
            got = r.prefill([prompt], all_logits=True)[0]
            with torch.no_grad():
                ref = hf(torch.tensor([prompt])).logits[0]
            err = gemm_rel_err(got, ref)
            assert err <= GEMM_REL[torch.float32], f"{kind} {backend}: rel err {err:.2e}"
            if backend == "fusedist":
                ids = r.generate([prompt, prompt[:9]], 24).ids
                tol = GEMM_REL[torch.float32]
                assert_greedy_matches(hf, prompt, ids[0], tol, kind)
                assert_greedy_matches(hf, prompt[:9], ids[1], tol, kind)


@check
def partial_sums_equal_tp1(rt, seed):
    """Each rank's MoE partial (its rows of every expert's gate / up, columns of down, and of
    the shared expert), summed over the ranks, equals the layer holding every expert whole
    (a TP 1 layer on each rank), to float32 rounding; odd sizes: hidden 72, 5 experts, expert
    intermediate 42 (21 a rank), shared 30, 13 tokens."""
    W, r = rt.tp.size, rt.tp.rank
    H, E, I, S, T = 72, 5, 42, 30, 13
    g = torch.Generator().manual_seed(seed % 997)
    rnd = lambda *s: torch.randn(*s, generator=g) * 0.2   # noqa: E731 - same on every rank
    router, sgate = rnd(E, H) * 5, rnd(1, H)
    experts = [(rnd(I, H), rnd(I, H), rnd(H, I)) for _ in range(E)]
    shared = (rnd(S, H), rnd(S, H), rnd(H, S))
    x = rnd(T, H) * 5
    solo = Group(name=f"solo{dist.get_rank()}", ranks=(dist.get_rank(),), pg=None,
                 device=rt.device)
    spec = RouterSpec(top_k=2, renormalize=False)
    full = MoE(H, E, I, spec, shared_intermediate_size=S, group=solo, dtype=torch.float32)
    part = MoE(H, E, I, spec, shared_intermediate_size=S, group=rt.tp, dtype=torch.float32)
    i, s = I // W, S // W
    for m, rows, srows in ((full, slice(0, I), slice(0, S)),
                           (part, slice(r * i, (r + 1) * i), slice(r * s, (r + 1) * s))):
        m.load_router(router)
        for e, (gw, uw, dw) in enumerate(experts):
            m.load_expert(e, gw[rows], uw[rows], dw[:, rows])
        m.load_shared(shared[0][srows], shared[1][srows], shared[2][:, srows], sgate)
    assert part.inter == i and part.shared_inter == s
    want = full(x)
    got = part(x)
    dist.all_reduce(got, group=rt.tp.pg)
    err = gemm_rel_err(got, want)
    assert err <= GEMM_REL[torch.float32], f"partials summed vs TP 1: rel err {err:.2e}"


@check
def fp8_block_checkpoint_shards(rt, seed):
    """At TP 2 each rank reads its 128-row blocks of every expert's e4m3 weights and the
    matching rows / columns of their 128 x 128 scales: the same FP8 experts, and the same
    logits, as quantizing this rank's shard of the bf16 checkpoint at load."""
    assert FP8_CKPTS, "FUSEDIST_MOE_FP8_CKPTS names no checkpoints"
    ckpt, bf16 = FP8_CKPTS["hf-block"], FP8_CKPTS["bf16"]
    got = build_model(LlamaConfig.from_dir(ckpt), SafetensorsWeights(ckpt), group=rt.tp,
                      dtype=torch.float32, device=rt.device)
    want = build_model(LlamaConfig.from_dir(bf16), SafetensorsWeights(bf16), group=rt.tp,
                       dtype=torch.float32, device=rt.device, quantize="fp8-block")
    for a, b in ((got.layers[1].mlp.w13, want.layers[1].mlp.w13),
                 (got.layers[0].mlp.w2, want.layers[0].mlp.w2)):
        assert a.layout == b.layout == "block" and torch.equal(a.scale, b.scale)
        assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
    assert got.layers[0].mlp.w13.shape == (5, 256, 256)   # 128 gate + 128 up rows a rank
    g = torch.Generator().manual_seed(seed % 1000)
    prompt = torch.randint(0, 320, (17,), generator=g).tolist()
    a = Runner(got, max_batch=1, max_seq_len=32).prefill([prompt], all_logits=True)[0]
    b = Runner(want, max_batch=1, max_seq_len=32).prefill([prompt], all_logits=True)[0]
    assert torch.equal(a, b)


@check
def random_shards_are_slices_of_the_full_model(rt, seed):
    cfg = LlamaConfig.named("tiny-moe")
    m = build_model(cfg, RandomWeights(cfg, seed=seed % 97), group=rt.tp, dtype=torch.float32,
                    device=rt.device)
    full = RandomWeights(cfg, seed=seed % 97)
    W, r = rt.tp.size, rt.tp.rank
    inter = cfg.moe.intermediate_size // W
    rd = lambda n: full.read(n, dtype=torch.float32, device="cpu")   # noqa: E731
    p = "model.layers.1.mlp."
    mlp = m.layers[1].mlp
    assert torch.equal(mlp.router, rd(p + "gate.weight"))
    for e in (0, cfg.moe.num_experts - 1):
        down = rd(p + f"experts.{e}.down_proj.weight")
        up = rd(p + f"experts.{e}.up_proj.weight")
        assert torch.equal(mlp.w2[e], down[:, r * inter:(r + 1) * inter])
        assert torch.equal(mlp.w13[e, inter:], up[r * inter:(r + 1) * inter])
    qn = m.layers[0].attn.q_norm
    assert torch.equal(qn, rd("model.layers.0.self_attn.q_norm.weight"))


if __name__ == "__main__":
    main()
