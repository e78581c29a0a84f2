"""fusedist.models.Runner: the compiled decode step (torch.compile of the step's body, then the
same graphs), prefill of batches with equal prompts (one SDPA call per layer in the torch
backend) against one prompt at a time, time_prefill / profile_prefill, the kernel breakdown.
CPU tier: the tiny config in fp32 (torch.compile with the aot_eager backend; inductor, which
compiles C++ here and takes ~10-25 s, under FUSEDIST_SLOW_TESTS=1). gpu tier: the compiled
step (inductor) against the eager step, and the SDPA kernel the torch baseline's decode gets."""

from __future__ import annotations

import gc
import os
import shutil
import weakref
import sys
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fusedist  # noqa: E402
from fusedist.models import LlamaConfig, Runner, build_model  # noqa: E402
from fusedist.models.llama import RandomWeights  # noqa: E402
from fusedist.models.profiling import kernel_breakdown, timeline  # noqa: E402
from model_fixtures import rt  # noqa: E402,F401 - the shared runtime fixture
from tolerances import GEMM_REL, gemm_rel_err  # noqa: E402
from launch import assert_passed, real_ranks, torchrun  # noqa: E402

SLOW = os.environ.get("FUSEDIST_SLOW_TESTS") == "1"


def _tiny(backend, seed=3, **kw):
    cfg = LlamaConfig.named("tiny").replace(**kw)
    return build_model(cfg, RandomWeights(cfg, seed=seed), backend=backend, dtype=torch.float32,
                       device="cpu")


def _prompts(vocab, lens, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def _compiled_matches_eager(backend, compile_backend, **kw):
    m = _tiny(backend, **kw)
    prompts = _prompts(m.cfg.vocab_size, (6, 11, 3), 1)
    eager = Runner(m, max_batch=3, max_seq_len=64)
    want = eager.generate(prompts, 10).ids
    r = Runner(m, max_batch=3, max_seq_len=64, compile_decode=True,
               compile_backend=compile_backend)
    assert r.generate(prompts, 10).ids == want
    assert set(r.compile_s) == {4} and r.compile_s[4] > 0     # bucket 4, compiled once
    # One step at the same lengths: the compiled step's logits against the eager step's.
    for x in (eager, r):
        x.seq_lens[:3] = torch.tensor([20, 31, 9], dtype=torch.int32)
        x.tokens[:3] = torch.tensor([5, 6, 7])
    err = gemm_rel_err(r.decode_step(4)[:3], eager.decode_step(4)[:3])
    assert err <= GEMM_REL[torch.float32], f"{backend} {compile_backend}: rel err {err:.2e}"


# The FP8 KV cache against the model-dtype cache, through the model: KL(model-dtype cache ||
# fp8 cache) of one decode step's next-token distributions. Error model: e4m3 rounds each K / V
# element (per token and kv head scale amax / 448) to 2^-4 relative, so a score q.k moves by
# ~2^-4 |q||k| / sqrt(3 head_dim) (random signs: the per-element errors add in quadrature); on
# the tiny config's softmax temperatures that perturbs the logits of the next token by a few
# 1e-3 and the KL by ~1e-5..1e-4. The bound 1e-2 is two orders above that; a decode step that
# does not read the cached history (an empty or zeroed cache, the cache of another row) gives
# KL ~0.1 (test_fp8_kv_cache_mutations checks that the metric sees those).
FP8_KV_KL = 1e-2


def _fp8_kv_kl(m, prompts, mutate=None, max_seq_len=64) -> float:
    """KL between the next-token distributions of a decode step that reads the cached prompts,
    a model-dtype cache's against an FP8 cache's. `mutate(runner)`, applied to the FP8 runner
    after its prefill, breaks the cache on purpose (the mutation checks)."""
    fp8 = torch.float8_e4m3fn
    ref = Runner(m, max_batch=len(prompts), max_seq_len=max_seq_len)
    r = Runner(m, max_batch=len(prompts), max_seq_len=max_seq_len, kv_dtype=fp8)
    n = len(prompts)
    nxt = ref.prefill(prompts).argmax(-1)
    r.prefill(prompts)
    if mutate is not None:
        mutate(r)
    lens = torch.tensor([len(p) + 1 for p in prompts], dtype=torch.int32)
    for x in (ref, r):
        # the next token at position len(prompt): decode reads positions 0..len(prompt) - 1
        # from the cache (the prefill's) and writes position len(prompt)
        x.seq_lens[:n] = lens.to(x.device)
        x.tokens[:n] = nxt
    la, lb = (x.decode_step(x.bucket(n))[:n].double() for x in (ref, r))
    return float(torch.nn.functional.kl_div(lb.log_softmax(-1), la.log_softmax(-1),
                                            log_target=True, reduction="batchmean"))


@pytest.mark.skipif(getattr(torch, "float8_e4m3fn", None) is None, reason="no float8_e4m3fn")
def test_fp8_kv_cache_runner(rt):
    """kv_dtype=float8_e4m3fn: the cache holds e4m3 K / V with a scale per token and kv head,
    sized by kv_bytes_per_token; a decode step over the cached prompts follows the model-dtype
    cache's logits within the e4m3 rounding of K and V (FP8_KV_KL); the torch baseline refuses
    it by name."""
    fp8 = torch.float8_e4m3fn
    m = _tiny("fusedist")
    prompts = _prompts(m.cfg.vocab_size, (9, 4), 5)
    r = Runner(m, max_batch=2, max_seq_len=64, kv_dtype=fp8)
    assert r.cache.k[0].dtype == fp8 and r.cache.k_scale[0] is not None
    assert r.kv_bytes == r.num_pages * r.page_size * m.kv_bytes_per_token(fp8)
    assert m.kv_bytes_per_token(fp8) == 2 * m.cfg.num_layers * m.local_kv_heads * \
        (m.cfg.head_dim + 4)
    kl = _fp8_kv_kl(m, prompts)
    assert kl < FP8_KV_KL, f"KL(model-dtype cache || fp8 cache) = {kl:.3e}"
    assert r.generate(prompts, 6).ids and r.cache.k[0].float().abs().sum() > 0
    with pytest.raises(ValueError, match="kv_dtype must be None .* or torch.float8_e4m3fn"):
        Runner(m, max_batch=1, max_seq_len=16, kv_dtype=torch.float16)
    with pytest.raises(ValueError, match="the torch baseline keeps its KV cache"):
        Runner(_tiny("torch"), max_batch=1, max_seq_len=16, kv_dtype=fp8)


def _zero_cache(r):
    for t in (*r.cache.k, *r.cache.v):
        t.zero_()


def _zero_scales(r):
    for t in (*r.cache.k_scale, *r.cache.v_scale):
        t.zero_()


def _swap_rows(r):
    """Row 0's pages hold row 1's cache and the other way round (a wrong block table row)."""
    r.bt[[0, 1]] = r.bt[[1, 0]].clone()


@pytest.mark.skipif(getattr(torch, "float8_e4m3fn", None) is None, reason="no float8_e4m3fn")
@pytest.mark.parametrize("mutate", [_zero_cache, _zero_scales, _swap_rows],
                         ids=["zeroed_cache", "zeroed_scales", "rows_swapped"])
def test_fp8_kv_cache_mutations(rt, mutate):
    """The FP8 KV test's metric notices a decode step that does not read the right history:
    the cache zeroed after the prefill, its scales zeroed, or the rows' pages swapped all put
    the KL past FP8_KV_KL (a test that could pass on broken code would not)."""
    m = _tiny("fusedist")
    kl = _fp8_kv_kl(m, _prompts(m.cfg.vocab_size, (9, 4), 5), mutate)
    assert kl > FP8_KV_KL, f"{mutate.__name__}: KL {kl:.3e} within the bound {FP8_KV_KL}"


@pytest.mark.parametrize("compiled", [False, True])
def test_runner_freed_without_cyclic_gc(rt, compiled):
    """A dropped runner is freed by reference counting alone (no cycle through self), so its
    CUDA graphs never wait for the cyclic GC, which may run during another capture (where
    destroying a graph invalidates that capture)."""
    m = _tiny("fusedist")
    # torch's first compile() imports dynamo and keeps that call's frames (its caller's too)
    torch.compile(lambda x: x)
    gc.collect()
    gc.disable()
    try:
        r = Runner(m, max_batch=2, max_seq_len=64, compile_decode=compiled)
        r.prefill(_prompts(m.cfg.vocab_size, (5, 3), 2))
        if not compiled:
            r.generate(_prompts(m.cfg.vocab_size, (4,), 3), 3)
        ref = weakref.ref(r)
        del r
        assert ref() is None, [type(x).__name__ for x in gc.get_referrers(ref())]
    finally:
        gc.enable()


@pytest.mark.parametrize("backend", ["torch", "fusedist"])
def test_compiled_decode_equals_eager(rt, backend):
    _compiled_matches_eager(backend, "aot_eager")


@pytest.mark.slow
@pytest.mark.skipif(not SLOW or shutil.which(os.environ.get("CXX", "g++")) is None,
                    reason="inductor on CPU compiles C++ (~10-25 s): FUSEDIST_SLOW_TESTS=1 and "
                    "a C++ compiler")
def test_compiled_decode_inductor_cpu(rt):
    _compiled_matches_eager("torch", "inductor", num_layers=1)


@pytest.mark.parametrize("backend", ["torch", "fusedist"])
def test_equal_prompts_prefill_as_one_batch(rt, backend, monkeypatch):
    """Four prompts, three of one length (chunks of 7 tokens, so later chunks run behind a
    cached prefix): every row's logits equal its prompt prefilled alone."""
    m = _tiny(backend)
    prompts = _prompts(m.cfg.vocab_size, (19, 19, 19, 12), 2)
    alone = [Runner(m, max_batch=1, max_seq_len=64).prefill([p], all_logits=True)[0]
             for p in prompts]
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention
    for chunk in (4096, 7):
        with monkeypatch.context() as mp:
            if chunk == 4096:   # (a patched SDPA would not take the CausalBias of later chunks)
                mp.setattr(torch.nn.functional, "scaled_dot_product_attention",
                           lambda q, *a, **kw: calls.append(q.shape[0]) or real(q, *a, **kw))
            got = Runner(m, max_batch=4, max_seq_len=64, prefill_chunk=chunk).prefill(
                prompts, all_logits=True)
        for i, (g, a) in enumerate(zip(got, alone)):
            err = gemm_rel_err(g, a)
            assert err <= GEMM_REL[torch.float32], f"chunk {chunk} row {i}: rel err {err:.2e}"
    if backend == "torch":
        # one call for the three equal prompts and one for the fourth, per layer
        assert calls == [3, 1] * m.cfg.num_layers, calls


def test_time_prefill(rt):
    m = _tiny("fusedist")
    r = Runner(m, max_batch=2, max_seq_len=64)
    prompts = _prompts(m.cfg.vocab_size, (9, 14), 3)
    want = r.generate(prompts, 8, context_fill=5).ids
    ms = r.time_prefill(prompts, start=5, reps=3)
    assert len(ms) == 3 and all(t > 0 for t in ms)
    # The timed prefills rewrite the prompts' slots with the same values.
    assert r.generate(prompts, 8, context_fill=5).ids == want
    with pytest.raises(ValueError, match="reps must be >= 1"):
        r.time_prefill(prompts, reps=0)


def test_time_step(rt, monkeypatch):
    """time_step(n): ms per decode step of n's bucket, from `iters` steps (one more untimed on
    a GPU); the steps rewrite the slot at seq_lens - 1 with the same values, so a generate
    after it gives the same ids; n past max_batch is refused by name."""
    m = _tiny("fusedist")
    r = Runner(m, max_batch=3, max_seq_len=64)
    prompts = _prompts(m.cfg.vocab_size, (9, 14, 5), 6)
    want = r.generate(prompts, 6).ids
    calls = []
    real = Runner.decode_step
    monkeypatch.setattr(Runner, "decode_step", lambda self, b: calls.append(b) or real(self, b))
    ms = r.time_step(3, iters=5)
    assert ms > 0 and calls == [4] * 5, calls
    calls.clear()
    assert r.time_step(1, iters=2) > 0 and calls == [1, 1]
    monkeypatch.undo()
    assert r.generate(prompts, 6).ids == want
    with pytest.raises(ValueError, match="a batch of 5 prompts exceeds max_batch 4"):
        r.time_step(5)


@pytest.mark.gpu
def test_gpu_time_step(gpu_rt):
    """On the GPU time_step replays the bucket's CUDA graph (timed with CUDA events) and leaves
    the cache as it was: the ids of a generate after it equal those before."""
    m = _gpu_model("fusedist")
    r = Runner(m, max_batch=2, max_seq_len=256)
    prompts = _prompts(m.cfg.vocab_size, (40, 77), 5)
    want = r.generate(prompts, 8).ids
    assert 2 in r.graphs
    ms = r.time_step(2, iters=10)
    assert ms > 0
    assert r.generate(prompts, 8).ids == want


@pytest.mark.parametrize("backend", ["torch", "fusedist"])
def test_profile_prefill(rt, backend):
    m = _tiny(backend)
    r = Runner(m, max_batch=2, max_seq_len=64)
    prompts = _prompts(m.cfg.vocab_size, (9, 14), 4)
    r.generate(prompts, 2)
    p = r.profile_prefill(prompts)
    assert set(p) == {"gemm", "attention", "communication", "other", "total", "top", "kernels",
                      "wall_us"}
    assert p["gemm"] > 0 and p["kernels"] > 0 and p["wall_us"] > 0
    assert p["total"] == pytest.approx(p["gemm"] + p["attention"] + p["communication"] +
                                       p["other"])
    assert p["top"] and p["top"][0][1] >= p["top"][-1][1]
    s = r.profile_step(2)
    assert s["gemm"] > 0 and s["kernels"] > 0


def _ev(name, us, device="CUDA", parent=None):
    return SimpleNamespace(name=name, device_type=f"DeviceType.{device}", device_time_total=us,
                           cpu_time_total=us, cpu_parent=parent)


def test_kernel_breakdown():
    events = [_ev("nvjet_sm90_tst_128x8_64x12_2x1_v_bz_TNT", 30.0),
              _ev("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 20.0),
              _ev("fmha_cutlassF_bf16_aligned_64x128_rf_sm80", 5.0),
              _ev("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 4.0),
              _ev("triton_poi_fused_add_mul_0", 2.5),
              _ev("nvjet_sm90_tst_128x8_64x12_2x1_v_bz_TNT", 10.0),
              _ev("aten::mm", 99.0, device="CPU")]          # host events are not kernels
    out = kernel_breakdown(events, cuda=True, top=2)
    assert (out["gemm"], out["attention"], out["communication"], out["other"]) == \
        (40.0, 25.0, 4.0, 2.5)
    assert out["total"] == 71.5 and out["kernels"] == 6
    assert out["top"] == [("nvjet_sm90_tst_128x8_64x12_2x1_v_bz_TNT", 40.0),
                          ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 20.0)]
    # CPU: the outermost aten ops only (a nested op's time is its caller's).
    outer = _ev("aten::linear", 8.0, device="CPU")
    cpu = kernel_breakdown([outer, _ev("aten::mm", 7.0, device="CPU", parent=outer),
                            _ev("aten::softmax", 3.0, device="CPU")], cuda=False)
    assert (cpu["gemm"], cpu["attention"], cpu["kernels"]) == (8.0, 3.0, 2)


def test_timeline():
    """Two calls' spans: overlapping kernels (programmatic dependent launch) count once in the
    busy time, a kernel inside another adds nothing, the idle gaps are the bubbles (the one
    between the calls included), and the largest gap names its neighbours."""
    spans = [("a", 0.0, 10.0), ("b", 8.0, 20.0),      # b starts before a ends: 0-20 busy
             ("c", 25.0, 30.0), ("d", 26.0, 28.0),    # 5 idle; d inside c
             ("a", 40.0, 50.0), ("b", 50.0, 60.0),    # 10 idle between the calls
             ("c", 61.0, 66.0), ("d", 66.5, 70.0)]    # 1 and 0.5 idle
    t = timeline(spans, calls=2, top=2)
    assert t["wall_us"] == 35.0                       # 70 us over two calls
    assert t["busy_us"] == (20 + 5 + 20 + 5 + 3.5) / 2
    assert t["kernel_us"] == (10 + 12 + 5 + 2 + 10 + 10 + 5 + 3.5) / 2
    assert t["bubble_us"] == (5 + 10 + 1 + 0.5) / 2
    assert t["bubble_pct"] == pytest.approx(100 * 16.5 / 70)
    assert t["kernels"] == 4
    assert t["gaps"] == [(10.0, "c", "a"), (5.0, "b", "c")]   # d ends inside c
    # Spans in any order; one kernel alone has no bubble.
    assert timeline(list(reversed(spans)), calls=2) == timeline(spans, calls=2, top=5)
    assert timeline([("k", 3.0, 4.0)])["bubble_us"] == 0.0
    with pytest.raises(ValueError, match="calls must be >= 1"):
        timeline(spans, calls=0)
    with pytest.raises(ValueError, match="ends before it starts"):
        timeline([("k", 4.0, 3.0)])


def test_profile_timeline_needs_cuda(rt):
    m = _tiny("fusedist")
    r = Runner(m, max_batch=2, max_seq_len=64)
    r.generate(_prompts(m.cfg.vocab_size, (5, 6), 2), 2)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        r.profile_timeline(2)


# ---- GPU tier -------------------------------------------------------------------------------
def _gpu_model(backend):
    cfg = LlamaConfig.named("tiny").replace(hidden_size=512, num_heads=4, num_kv_heads=2,
                                            head_dim=128, intermediate_size=1024,
                                            vocab_size=1000)
    return build_model(cfg, RandomWeights(cfg, seed=9), backend=backend, dtype=torch.bfloat16,
                       device="cuda")


@pytest.fixture(scope="module")
def gpu_rt():
    if fusedist.is_initialized():
        fusedist.shutdown()
    fusedist.init(backend="nccl", rank=0, world_size=1, local_rank=0, local_world_size=1)
    yield
    fusedist.shutdown()


@pytest.mark.gpu
def test_gpu_profile_timeline(gpu_rt):
    """The timeline of graph replays: every replay's kernels recorded (the same count per
    step as the eager step's profile), idle time between 0 and the wall time, and the ids of
    a generate after it unchanged."""
    m = _gpu_model("fusedist")
    r = Runner(m, max_batch=2, max_seq_len=256)
    prompts = _prompts(m.cfg.vocab_size, (40, 77), 5)
    want = r.generate(prompts, 8).ids
    t = r.profile_timeline(2, reps=4)
    assert t["graphs"] is True
    assert t["kernels"] == r.profile_step(2)["kernels"]
    assert 0.0 <= t["bubble_us"] < t["wall_us"]
    assert t["busy_us"] <= t["kernel_us"] + 1e-6
    assert t["wall_us"] == pytest.approx(t["busy_us"] + t["bubble_us"])
    assert r.generate(prompts, 8).ids == want


@pytest.mark.gpu
def test_gpu_compiled_step_matches_eager(gpu_rt):
    m = _gpu_model("torch")
    prompts = _prompts(m.cfg.vocab_size, (40, 77, 5), 5)
    outs = []
    for compiled in (False, True):
        r = Runner(m, max_batch=3, max_seq_len=256, compile_decode=compiled)
        r.generate(prompts, 8)
        assert 4 in r.graphs                                   # captured in a CUDA graph
        r.seq_lens[:3] = torch.tensor([60, 90, 30], dtype=torch.int32, device="cuda")
        r.tokens[:3] = torch.tensor([1, 2, 3], device="cuda")
        outs.append(r.decode_step(4)[:3].float())
    err = gemm_rel_err(outs[1], outs[0])
    assert err <= 2 * GEMM_REL[torch.bfloat16], f"compiled vs eager step: rel err {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 3])
def test_gpu_torch_baseline_decode_attention_kernel(gpu_rt, batch, monkeypatch):
    """The torch baseline's masked decode SDPA call, when its SDPA form is taken, runs cuDNN's
    kernel (SDPA_BACKENDS puts it first), not the memory-efficient one, at batch 1 as at larger
    batches."""
    from fusedist.models.llama import baseline as ta
    monkeypatch.setattr(ta, "_pick_decode_path", lambda key, args: "sdpa")
    m = _gpu_model("torch")
    r = Runner(m, max_batch=batch, max_seq_len=256)
    r.generate(_prompts(m.cfg.vocab_size, [50] * batch, 6), 4)
    names = [n.lower() for n, _ in r.profile_step(batch, top=1000)["top"]]
    sdpa = [n for n in names if any(k in n for k in ("cudnn", "flash", "fmha", "attention"))]
    assert sdpa and not any("fmha_cutlassf" in n or "memeff" in n for n in sdpa), names
    assert any("cudnn" in n for n in sdpa), names


@pytest.mark.gpu
def test_gpu_prefill_graphs_match_eager(gpu_rt):
    """Prefill chunks through the token-bucket CUDA graphs give the eager prefill's logits
    (bf16 tolerance: the padded bucket may tile the GEMMs differently), for fresh prompts, a
    chunk behind a cached prefix (a small prefill_chunk splits the prompts) and a batch of two;
    one graph per (sequences, bucket), replayed for every length in the bucket."""
    from conftest import require_kernel
    require_kernel("attention_prefill")
    m = _gpu_model("fusedist")
    eager = Runner(m, max_batch=2, max_seq_len=512, prefill_graph_tokens=0, prefill_chunk=64)
    graphed = Runner(m, max_batch=2, max_seq_len=512, prefill_chunk=64,
                     prefill_graph_tokens=512)
    assert graphed.prefill_graph_tokens == 512, "the runner took no prefill graphs"
    for lens, start in (((37,), 0), ((41,), 0), ((150,), 0), ((20, 33), 7), ((5,), 300)):
        prompts = _prompts(m.cfg.vocab_size, lens, sum(lens) + start)
        want = eager.prefill(prompts, start=start).float()
        got = graphed.prefill(prompts, start=start).float()
        err = gemm_rel_err(got, want)
        assert err <= 2 * GEMM_REL[torch.bfloat16], f"{lens} after {start}: rel err {err:.2e}"
    assert eager.prefill_graphs == {}
    # (1, 48) serves 37 and 41 tokens; 150 tokens in chunks of 64, 64, 22 -> (1, 64), (1, 32)
    assert set(graphed.prefill_graphs) == {(1, 48), (1, 64), (1, 32), (2, 64), (1, 16)}, \
        sorted(graphed.prefill_graphs)
    fusedist.check_device_errors()


@pytest.mark.gpu
@pytest.mark.skipif(getattr(torch, "float8_e4m3fn", None) is None, reason="no float8_e4m3fn")
@pytest.mark.parametrize("mutate", [None, _zero_cache, _swap_rows],
                         ids=["intact", "zeroed_cache", "rows_swapped"])
def test_gpu_fp8_kv_cache(gpu_rt, mutate):
    """The FP8 KV cache through the bf16 model on the GPU (the paged prefill writing e4m3 K / V
    and the decode kernel reading them): within FP8_KV_KL of the bf16 cache's step over the
    cached prompts (odd lengths, partial pages); a zeroed cache or swapped rows go past it."""
    m = _gpu_model("fusedist")
    kl = _fp8_kv_kl(m, _prompts(m.cfg.vocab_size, (40, 77, 5), 7), mutate, max_seq_len=256)
    if mutate is None:
        assert kl < FP8_KV_KL, f"KL(bf16 cache || fp8 cache) = {kl:.3e}"
    else:
        assert kl > FP8_KV_KL, f"{mutate.__name__}: KL {kl:.3e} within the bound {FP8_KV_KL}"
    fusedist.check_device_errors()


def test_prefill_token_buckets(rt):
    from fusedist.models.runner import prefill_token_bucket as bucket
    assert [bucket(n) for n in (1, 16, 17, 33, 48, 49, 65, 97, 129, 193, 257, 385, 513)] == \
        [16, 16, 32, 48, 48, 64, 96, 128, 192, 256, 384, 512, 768]
    with pytest.raises(ValueError, match="prefill_graph_tokens must be an int >= 0"):
        Runner(_tiny("fusedist"), max_batch=1, max_seq_len=16, prefill_graph_tokens=-1)


# ---- construction limits and lifetime ------------------------------------------------------
def test_max_seq_len_beyond_the_models_positions(rt):
    """max_seq_len past the model's rotary table (model.max_position) is refused at
    construction; a generate whose tokens would pass it (the page-rounded cache is longer)
    raises before any step."""
    m = _tiny("fusedist")
    with pytest.raises(ValueError, match=r"max_seq_len=2049 exceeds the model's max_position "
                                         r"2048"):
        Runner(m, max_batch=1, max_seq_len=m.max_position + 1)
    cfg = LlamaConfig.named("tiny")
    short = build_model(cfg, RandomWeights(cfg, seed=3), dtype=torch.float32, device="cpu",
                        max_position=40)
    r = Runner(short, max_batch=1, max_seq_len=40)       # 3 pages of 16: a 48-token cache
    assert r.max_seq_len == 48
    with pytest.raises(ValueError, match="exceed the model's max_position 40"):
        r.generate([list(range(1, 31))], 15)
    assert len(r.generate([list(range(1, 31))], 10).ids[0]) == 10


def test_decode_plans_are_released(rt):
    """Each bucket's decode plan owns its workspace; the runner closes them at close(), at the
    end of a with-block, and when it is dropped (closed plans hold no tensors)."""
    import gc

    m = _tiny("fusedist")
    prompts = _prompts(m.cfg.vocab_size, (5, 7, 4), 8)
    r = Runner(m, max_batch=3, max_seq_len=64)
    want = r.generate(prompts, 3).ids                    # bucket 4
    r.generate(prompts[:1], 3)                           # bucket 1
    plans = list(r._plans)
    assert len(plans) == 2 and not any(p.closed for p in plans)
    del r
    gc.collect()
    assert all(p.closed and p.o_partial is None for p in plans), \
        "a dropped Runner left its decode plans open"

    with Runner(m, max_batch=3, max_seq_len=64) as r:
        assert r.generate(prompts, 3).ids == want
        plans = [meta.plan for meta in r._metas.values()]
        assert plans and not any(p.closed for p in plans)
    assert all(p.closed for p in plans)
    with pytest.raises(RuntimeError, match="Runner.generate: the runner is closed"):
        r.generate(prompts, 3)
    r.close()                                            # twice is fine

    r = Runner(m, max_batch=1, max_seq_len=64)
    r.generate(prompts[:1], 2)
    plans = list(r._plans)
    r.close()
    assert plans and all(p.closed for p in plans)
    # The torch backend makes no plans; close() still works.
    with Runner(_tiny("torch"), max_batch=1, max_seq_len=64) as t:
        t.generate(prompts[:1], 2)
        assert not t._plans


# ---- TP 2 over gloo: ranks given different requests ---------------------------------------
@pytest.mark.timeout(300)
def test_request_mismatch_tp2_cpu():
    """tests/dist/worker_runner.py: different prompt ids, seeds, max_new_tokens, EOS ids on one
    rank, sampling modes, context fills, and a request invalid on one rank only."""
    assert_passed(torchrun("worker_runner.py", 2, {"CUDA_VISIBLE_DEVICES": ""}, timeout=240), 2)


def test_generate_argument_checks(rt):
    """generate() names the bad argument (before: an IndexError deep in the embedding for an
    id past the vocabulary, ZeroDivisionError for eos_check_every=0, a str taken as a prompt)."""
    m = _tiny("fusedist")
    r = Runner(m, max_batch=2, max_seq_len=64)
    for kw, exc, match in [
        ({"prompts": [[1, 512]]}, ValueError, r"prompts\[0\] holds token id 512, outside the "
                                               r"model's vocabulary \[0, 512\)"),
        ({"prompts": [[1, -1]]}, ValueError, "token id -1"),
        ({"prompts": ["hello"]}, TypeError, r"prompts\[0\] must be a sequence of int token ids"),
        ({"prompts": [[1.0, 2.0]]}, TypeError, r"prompts\[0\] must be a sequence of int"),
        ({"prompts": "12"}, ValueError, "prompts must be a non-empty list"),
        ({"prompts": []}, ValueError, "prompts must be a non-empty list"),
        ({"prompts": [[1], []]}, ValueError, r"prompts\[1\] is empty"),
        ({"prompts": [[1]] * 3}, ValueError, "a batch of 3 prompts exceeds max_batch 2; "
                                             "build the Runner with a larger max_batch"),
        ({"prompts": [[1, True]]}, TypeError, r"prompts\[0\] must be a sequence of int token "
                                              r"ids \(not bools or floats\)"),
        ({"eos_ids": 2}, TypeError, r"eos_ids must be a sequence of int token ids \(e\.g\."),
        ({"eos_ids": (True,)}, TypeError, "eos_ids must be a sequence of int token ids"),
        ({"max_new_tokens": 70}, ValueError, "exceed max_seq_len 64; build the Runner with a "
                                             "larger max_seq_len"),
        ({"max_new_tokens": 0}, ValueError, "max_new_tokens must be an int >= 1, got 0"),
        ({"max_new_tokens": 2.0}, ValueError, "max_new_tokens must be an int >= 1"),
        ({"eos_ids": (3,), "eos_check_every": 0}, ValueError,
         "eos_check_every must be an int >= 1, got 0"),
        ({"context_fill": -1}, ValueError, "context_fill must be an int >= 0"),
        ({"eos_ids": ("a",)}, TypeError, "eos_ids must be a sequence of int token ids"),
        ({"sampling": {"greedy": True}}, TypeError, "sampling must be a fusedist.models."
                                                     "SamplingParams"),
    ]:
        args = {"prompts": [[1, 2, 3]], "max_new_tokens": 4, **kw}
        with pytest.raises(exc, match=match):
            r.generate(**args)
    # Token ids given as tensors are taken as their values.
    want = r.generate([[1, 2, 3]], 4).ids
    assert r.generate([torch.tensor([1, 2, 3])], 4).ids == want
    assert r.generate(torch.tensor([[1, 2, 3]]), 4).ids == want
    # numpy ids, arrays and counts are ints too
    import numpy as np
    assert r.generate([np.array([1, 2, 3])], np.int64(4)).ids == want
    assert r.generate(np.array([[1, 2, 3]]), 4, eos_ids=[np.int32(511)]).ids == want
    for bad in (0, -1.0, float("nan"), True, "3"):
        with pytest.raises(ValueError, match="peer_timeout_s must be a finite number"):
            Runner(m, max_batch=1, max_seq_len=64, peer_timeout_s=bad)


def test_describe_differences():
    from fusedist.distributed.groups import describe_differences
    from fusedist.models.runner import _show_ids

    fields = [{"a": "1", "b": "x", "only0": "z"}, {"a": "2", "b": "x"}, {"a": "1", "b": "y"}]
    assert describe_differences((0, 1, 2), fields) == \
        "a: ranks 0, 2: 1; rank 1: 2 | b: ranks 0, 1: x; rank 2: y"
    assert describe_differences((4, 5), [{"k": "1", "extra": "e"}, {"k": "1"}]) == \
        "extra: rank 4: e; rank 5: (absent)"
    long = list(range(40))
    assert _show_ids(long).startswith("40 ids [0, 1, 2, 3, 4, 5, 6, 7, ...] crc32 ")
    assert _show_ids(long) != _show_ids(long[:-1] + [99]) and _show_ids([3, 4]) == "2 ids [3, 4]"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_tp2_sessions_exit_cleanly_cpu():
    """tests/dist/worker_runner_exit.py 12 times at TP 2 over gloo (sampled generate calls, a
    caught CollectiveMismatchError, more generate calls; then fusedist.shutdown() and no gloo
    thread left, or the exit with fusedist initialized, or that exit with an all-gather left in
    flight): every rank exits with status 0 every time (before, a gloo worker thread alive at
    interpreter teardown aborted some runs with SIGABRT)."""
    bad = []
    for i in range(12):
        mode = ("shutdown", "exit", "pending")[i % 3]
        # real interpreters (their exit is what is checked), no launcher process
        p = real_ranks("worker_runner_exit.py", 2, {"CUDA_VISIBLE_DEVICES": ""}, timeout=120,
                       args=(mode,))
        if p.returncode != 0 or p.stdout.count("all checks passed") != 2:
            bad.append(f"run {i} ({mode}): exit {p.returncode}\n{p.stdout[-2500:]}")
    assert not bad, f"{len(bad)} of 12 runs did not exit cleanly:\n" + "\n".join(bad)


def test_constructor_arguments(rt):
    """Sizes as users hold them (numpy ints) are taken; zero, negative and fractional sizes and
    non-bool flags are one ValueError naming the argument, before anything is allocated."""
    import numpy as np

    m = _tiny("fusedist")
    r = Runner(m, max_batch=np.int64(3), max_seq_len=np.int32(40), page_size=np.int64(8),
               prefill_chunk=np.int64(5))
    assert (r.max_rows, r.max_seq_len, r.page_size, r.prefill_chunk) == (4, 40, 8, 5)
    assert type(r.page_size) is int
    for kw, match in (({"page_size": 0}, "page_size must be an int >= 1, got 0"),
                      ({"page_size": -16}, "page_size must be an int >= 1, got -16"),
                      ({"prefill_chunk": 0}, "prefill_chunk must be an int >= 1"),
                      ({"prefill_chunk": -4}, "prefill_chunk must be an int >= 1"),
                      ({"max_batch": 2.5}, r"max_batch must be an int >= 1, got 2.5 \(a float\)"),
                      ({"max_batch": True}, "max_batch must be an int >= 1, got the bool"),
                      ({"max_seq_len": "64"}, "max_seq_len must be an int >= 1"),
                      ({"cuda_graphs": "no"}, "cuda_graphs must be True or False or None"),
                      ({"kv_budget_bytes": 0}, "kv_budget_bytes must be an int >= 1")):
        args = {"max_batch": 2, "max_seq_len": 64, **kw}
        with pytest.raises(ValueError, match="Runner: " + match):
            Runner(m, **args)


def test_one_request_at_a_time(rt):
    """A stream holds the runner's cache until it ends: generate() or a second stream() while
    it is open raise at once (before touching the cache); after the stream ends or is closed,
    calls run and give the ids they give alone."""
    from fusedist.models import SamplingParams

    r = Runner(_tiny("fusedist"), max_batch=2, max_seq_len=64)
    a = r.generate([[1, 2, 3]], 5, SamplingParams()).ids[0]
    b = r.generate([[7, 8]], 5, SamplingParams()).ids[0]
    s = r.stream([[1, 2, 3]], 5, SamplingParams())
    got = [next(s)[0]]
    for call in (lambda: r.generate([[7, 8]], 5), lambda: r.stream([[7, 8]], 5)):
        with pytest.raises(RuntimeError, match="a stream of this runner is open .* iterate it "
                                               "to the end or call its close\\(\\) first"):
            call()
    got += [t[0] for t in s]
    assert got == a
    assert r.generate([[7, 8]], 5).ids[0] == b          # the stream ended: free again
    s = r.stream([[7, 8]], 5)
    next(s)
    s.close()
    assert r.generate([[1, 2, 3]], 5).ids[0] == a        # closed early: free again
    with pytest.raises(ValueError, match="exceed max_seq_len"):   # checked at the call
        r.stream([[1, 2]], 100)
    assert r.generate([[7, 8]], 5).ids[0] == b


def test_nan_logits_raise_instead_of_sampling(rt):
    """NaN weights make NaN logits: generate() and stream() raise NonFiniteError naming the
    sequences and the step (argmax of a NaN row used to give id 0 without a word)."""
    r = Runner(_tiny("fusedist"), max_batch=2, max_seq_len=64)
    ok = r.generate([[1, 2, 3], [4, 5]], 3).ids
    with torch.no_grad():
        r.model.layers[1].mlp.down.fill_(float("nan"))
    with pytest.raises(fusedist.NonFiniteError,
                       match=r"logits hold NaN \(sequence 0 at step 0 \(the prefill\), "
                             r"sequence 1 at step 0"):
        r.generate([[1, 2, 3], [4, 5]], 3)
    with pytest.raises(fusedist.NonFiniteError, match="sequence 0 at step 0"):
        next(r.stream([[1, 2, 3]], 3))
    assert len(ok) == 2


def test_sample_refuses_nan_rows():
    from fusedist.models import SamplingParams, sample

    lg = torch.randn(3, 11)
    lg[2, 4] = float("nan")
    for sp in (SamplingParams(), SamplingParams(greedy=False, temperature=0.5, top_p=0.8)):
        with pytest.raises(ValueError, match=r"logits rows \[2\] of 3 hold NaN"):
            sample(lg, sp, torch.Generator().manual_seed(0))
    assert sample(lg, SamplingParams(), None, check=False).shape == (3,)
