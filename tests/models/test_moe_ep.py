"""Expert parallelism in the MoE layer and models: MoE(ep=True), build_model(ep=True),
LLM(ep=True), python -m fusedist.generate --ep.

CPU tier: tests/dist/worker_moe_ep.py over gloo at 2 ranks (every check) and 4 (the layer's):
the layer's partial bitwise equal to EP 1 on each rank's share of the tokens (float32 and
bfloat16; shares of 1, 3 and 13 tokens, a rank with none), a step in pieces, the shared
expert, bfloat16 within rounding of the float64 loop beside tensor parallelism over the
intermediate, FP8 experts, tiny Mixtral / Qwen3-MoE / Qwen2-MoE checkpoints (experts that
split over the ranks) against transformers' greedy ids, FP8 checkpoints read expert by expert;
the CLI at EP 2 beside the torch baseline; bad configurations (in-process).
gpu tier: the layer's bfloat16 check on ranks emulated on one GPU (the Buffer's low-latency
kernels), bitwise against EP 1."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fusedist.distributed.groups import Group  # noqa: E402
from fusedist.models import LlamaConfig, Runner, build_model  # noqa: E402
from fusedist.models.llama import RandomWeights  # noqa: E402
from fusedist.models.llama.weights import check_tp  # noqa: E402
from fusedist.nn import MoE  # noqa: E402
from fusedist.nn.moe import token_share  # noqa: E402
from fusedist.nn.quant import FP8  # noqa: E402
from fusedist.ops.moe import RouterSpec  # noqa: E402
from launch import ROOT, assert_passed, emulate, python, torchrun  # noqa: E402
from model_fixtures import rt  # noqa: E402,F401 - the shared runtime fixture

CPU_ENV = {"CUDA_VISIBLE_DEVICES": "", "FUSEDIST_INIT_TIMEOUT_S": "60"}
# Tiny checkpoints whose experts split over 2 (and 4) ranks: Mixtral (4 experts, top-2,
# renormalized), Qwen3-MoE (8 experts, top-3, q/k norm, a dense layer), and hf_tiny's
# Qwen2-MoE (6 experts, top-3, the shared expert; EP 2 only).
EP_KINDS = {
    "mixtral_ep": ("Mixtral", dict(vocab_size=256, hidden_size=64, intermediate_size=48,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   num_local_experts=4, num_experts_per_tok=2,
                                   sliding_window=None), {}),
    "qwen3_moe_ep": ("Qwen3Moe", dict(vocab_size=256, hidden_size=64, intermediate_size=80,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                      num_experts=8, num_experts_per_tok=3,
                                      moe_intermediate_size=40, norm_topk_prob=True,
                                      mlp_only_layers=[1]), {}),
    # whole 128 x 128 blocks: each expert's gate / up 256 rows (for the FP8 checkpoints)
    "qwen3_moe_ep_fp8": ("Qwen3Moe", dict(vocab_size=320, hidden_size=256,
                                          intermediate_size=512, num_attention_heads=4,
                                          num_key_value_heads=2, head_dim=128, num_experts=4,
                                          num_experts_per_tok=2, moe_intermediate_size=256,
                                          norm_topk_prob=True), {}),
}


def _make(kind: str, path: str, seed: int, dtype=None) -> str:
    import hf_tiny

    hf_tiny.MOE_KINDS[kind] = EP_KINDS[kind]
    try:
        return hf_tiny.make_checkpoint(kind, path, seed=seed, dtype=dtype)
    finally:
        del hf_tiny.MOE_KINDS[kind]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    from hf_tiny import make_checkpoint

    root = tmp_path_factory.mktemp("moe_ep")
    out = {k: _make(k, str(root / k), seed=20 + i)
           for i, k in enumerate(("mixtral_ep", "qwen3_moe_ep"))}
    out["qwen2_moe"] = make_checkpoint("qwen2_moe", str(root / "qwen2_moe"), seed=23)
    return out


@pytest.fixture(scope="module")
def fp8_ckpts(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    from hf_tiny import write_fp8_checkpoint

    root = tmp_path_factory.mktemp("moe_ep_fp8")
    bf16 = _make("qwen3_moe_ep_fp8", str(root / "bf16"), seed=4, dtype=torch.bfloat16)
    return {"bf16": bf16, "hf-block": write_fp8_checkpoint(bf16, str(root / "hf-block"), "fp8",
                                                           "block")}


# ---- multi-rank: tests/dist/worker_moe_ep.py -----------------------------------------------
@pytest.mark.timeout(600)
@pytest.mark.skipif(FP8 is None, reason="torch without float8_e4m3fn")
def test_ep2_gloo(ckpts, fp8_ckpts):
    env = dict(CPU_ENV, FUSEDIST_MOE_EP_CKPTS=json.dumps(ckpts),
               FUSEDIST_MOE_EP_FP8_CKPTS=json.dumps(fp8_ckpts))
    assert_passed(torchrun("worker_moe_ep.py", 2, env, timeout=580), 2)


@pytest.mark.timeout(600)
@pytest.mark.skipif(FP8 is None, reason="torch without float8_e4m3fn")
def test_ep4_gloo(ckpts, fp8_ckpts):
    """At 4 ranks: 2 experts each in the layer (1 and 3 tokens leave ranks empty), 1 and 2 in
    the models (Qwen2-MoE's 6 experts do not split over 4: left out)."""
    env = dict(CPU_ENV, FUSEDIST_MOE_EP_CKPTS=json.dumps(ckpts),
               FUSEDIST_MOE_EP_FP8_CKPTS=json.dumps(fp8_ckpts))
    assert_passed(torchrun("worker_moe_ep.py", 4, env, timeout=580), 4)


def test_token_shares():
    """Balanced contiguous shares: the first T % world ranks take one more; all T covered."""
    for T, W in ((1, 2), (3, 2), (13, 4), (0, 3), (5, 8)):
        shares = [token_share(T, W, r) for r in range(W)]
        assert shares[0][0] == 0 and shares[-1][1] == T
        assert all(a[1] == b[0] for a, b in zip(shares, shares[1:]))
        sizes = [hi - lo for lo, hi in shares]
        assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    assert token_share(1, 2, 1) == (1, 1)


# ---- the CLI -------------------------------------------------------------------------------
def _generate(args, nproc=1, timeout=300):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **CPU_ENV)
    cmd = ["-P", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "fusedist.generate"]
    return python(cmd + args + ["--json", "--quiet", "--device", "cpu"], env=env,
                  timeout=timeout, cwd=ROOT)


@pytest.mark.timeout(300)
def test_cli_ep2_equals_tp1_library(rt):
    """--ep at 2 ranks (tiny-moe: 8 experts, 4 a rank): the ids of the library's TP 1 model
    and of the torch baseline (tensor-parallel experts) in the same run."""
    p = _generate(["--config", "tiny-moe", "--random-weights", "--prompt-len", "9",
                   "--max-new-tokens", "10", "--baseline", "torch", "--ep"], nproc=2)
    assert p.returncode == 0, p.stderr[-4000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    cfg = LlamaConfig.named("tiny-moe")
    m = build_model(cfg, RandomWeights(cfg, 0), dtype=torch.float32, device="cpu")
    prompt = torch.randint(0, cfg.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0))
    lib = Runner(m, max_batch=1, max_seq_len=32).generate(prompt.tolist(), 10).ids
    assert out["tp"] == 2 and out["ep"] is True and out["timings"]["fusedist"]["ep"] is True
    assert out["ids"] == lib and out["torch_ids_match"]


@pytest.mark.timeout(200)
def test_cli_ep_errors():
    """--ep on a dense model, and on experts that do not divide by the ranks: one line naming
    the problem, exit status 1, before anything is built."""
    p = _generate(["--config", "tiny", "--random-weights", "--ep", "--max-new-tokens", "2"])
    assert p.returncode != 0 and "tiny is a dense model (no experts); drop ep / --ep" in \
        p.stderr, p.stderr[-2000:]
    p = _generate(["--config", "tiny-moe", "--random-weights", "--ep", "--max-new-tokens", "2"],
                  nproc=3)
    assert p.returncode != 0 and "tiny-moe has num_experts=8, not divisible by tp=3" in \
        p.stderr, p.stderr[-2000:]


# ---- bad configurations --------------------------------------------------------------------
def _group(size: int, rank: int = 0):
    """A group of `size` ranks as rank `rank` sees it (the layer reads its size and rank)."""
    class _G(Group):
        @property
        def rank(self) -> int:
            return rank
    return _G(name=f"g{size}", ranks=tuple(range(size)), pg=None, device=torch.device("cpu"))


def test_layer_shards_experts_and_refuses_bad_configs():
    spec = RouterSpec(top_k=2)
    m = MoE(72, 8, 40, spec, group=_group(4, 3), dtype=torch.float32, ep=True)
    assert (m.ep, m.ep_size, m.ep_rank, list(m.experts)) == (True, 4, 3, [6, 7])
    assert m.w13.shape == (2, 80, 72) and m.w2.shape == (2, 72, 40) and m.inter == 40
    assert "ep=4 (experts 6..7 here)" in repr(m)
    g, u, d = torch.zeros(40, 72), torch.zeros(40, 72), torch.zeros(72, 40)
    m.load_expert(7, g, u, d.add(1.0))
    assert bool((m.w2[1] == 1).all()) and bool((m.w2[0] == 0).all())
    with pytest.raises(ValueError, match=r"expert 2 lives on rank 1 of the expert-parallel "
                                         r"group; this rank \(rank 3\) holds experts \[6, 8\)"):
        m.load_expert(2, g, u, d)
    with pytest.raises(ValueError, match=r"expert 6 down must be \[72, 40\]"):
        m.load_expert(6, g, u, d[:, :20])
    with pytest.raises(ValueError, match=r"ep=True shards the experts over the group: "
                                         r"num_experts=5 is not divisible by the group's size "
                                         r"2; use a group size among \[1, 5\]"):
        MoE(72, 5, 40, spec, group=_group(2), dtype=torch.float32, ep=True)
    with pytest.raises(TypeError, match=r"ep must be True or False, got 'yes'"):
        MoE(72, 8, 40, spec, dtype=torch.float32, ep="yes")
    # the shared expert stays tensor-parallel: its size must split; the experts' need not
    MoE(72, 8, 41, spec, group=_group(2), dtype=torch.float32, ep=True)
    with pytest.raises(ValueError, match=r"shared_intermediate_size=25 is not divisible"):
        MoE(72, 8, 40, spec, shared_intermediate_size=25, group=_group(2),
            dtype=torch.float32, ep=True)
    if FP8 is not None:
        with pytest.raises(ValueError, match=r"intermediate_size = 192 \(whole experts: ep\) "
                                             r"is not a multiple of 128"):
            MoE(256, 8, 192, spec, group=_group(2), dtype=torch.bfloat16, ep=True,
                fp8_layout="block")
        MoE(256, 8, 256, spec, group=_group(4), dtype=torch.bfloat16, ep=True,
            fp8_layout="block")   # whole experts: 256 rows at any EP size
    # EP 1: every expert here, no exchange (the layer without ep)
    one = MoE(72, 5, 40, spec, dtype=torch.float32, ep=True)
    assert not one.ep and one.exchange is None and list(one.experts) == list(range(5))


def test_models_refuse_bad_ep(rt):
    moe, dense = LlamaConfig.named("tiny-moe"), LlamaConfig.named("tiny")
    check_tp(moe, 4, ep=True)
    with pytest.raises(ValueError, match=r"tiny is a dense model \(no experts\); drop ep"):
        check_tp(dense, 1, ep=True)
    with pytest.raises(ValueError, match=r"tiny-moe has num_experts=8, not divisible by tp=3; "
                                         r"pick a tp among \[1, 2, 4, 8\]"):
        check_tp(moe, 3, ep=True)
    q = LlamaConfig.named("qwen3-30b-a3b")
    from fusedist.models.llama import WeightQuant
    block = WeightQuant("quantize", "block")
    with pytest.raises(ValueError, match=r"moe_intermediate_size / tp = 768 / 4 = 192"):
        check_tp(q, 4, block)
    check_tp(q, 4, block, ep=True)      # whole experts of 768 rows: 6 blocks
    with pytest.raises(ValueError, match=r"backend; the torch baseline shards every expert"):
        build_model(moe, RandomWeights(moe), backend="torch", dtype=torch.float32,
                    device="cpu", ep=True)
    with pytest.raises(ValueError, match=r"tiny is a dense model"):
        build_model(dense, RandomWeights(dense), dtype=torch.float32, device="cpu", ep=True)
    # EP over one rank is the layer without ep
    m = build_model(moe, RandomWeights(moe, seed=1), dtype=torch.float32, device="cpu", ep=True)
    ref = build_model(moe, RandomWeights(moe, seed=1), dtype=torch.float32, device="cpu")
    prompts = [[1, 2, 3, 4], [9, 8]]
    assert Runner(m, max_batch=2, max_seq_len=32).generate(prompts, 4).ids == \
        Runner(ref, max_batch=2, max_seq_len=32).generate(prompts, 4).ids


def test_llm_ep(rt):
    """LLM(ep=True): refused on a dense model before anything is built; over one rank the
    model's experts are all here and its ids those of ep=False."""
    from fusedist.models import LLM

    with pytest.raises(ValueError, match=r"tiny is a dense model"):
        LLM(config="tiny", random_weights=True, ep=True)
    kw = dict(config="tiny-moe", random_weights=True, max_batch=1, max_seq_len=32)
    with LLM(ep=True, **kw) as a, LLM(**kw) as b:
        assert a.model.ep and not b.model.ep
        assert a.generate([1, 2, 3], 6).ids == b.generate([1, 2, 3], 6).ids


# ---- GPU tier ------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", (2, 4))
def test_gpu_layer_on_emulated_ranks(world, tmp_path):
    """The bfloat16 layer check on ranks emulated on one GPU: the Buffer's low-latency
    kernels, the grouped GEMM kernel on both sides (moe.gemv_max_pairs 0 in a tuning file:
    the GEMV's split of K depends on every expert's count), each rank's share bitwise EP 1's."""
    tuning = tmp_path / "tuning.json"
    tuning.write_text(json.dumps({"moe": {"gemv_max_pairs": 0}}))
    p = emulate("worker_moe_ep.py", world, {"FUSEDIST_TUNING_FILE": str(tuning)}, timeout=850)
    assert_passed(p, world)
    assert "[ok] layer_bf16_ep_equals_ep1_bitwise" in p.stdout, p.stdout[-3000:]
