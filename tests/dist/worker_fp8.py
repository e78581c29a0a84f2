"""fusedist.models with FP8 weights at TP > 1 (gloo on CPU): the FP8 checkpoints that
tests/models/test_fp8_model.py writes, read by slices (FUSEDIST_FP8_REF: their paths, a prompt
and the TP 1 logits), give TP 1's logits to fp32 rounding; each rank's FP8 shards are the
rows / columns of the full FP8 weight with their scales."""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _checks import check, fresh, main, rank_seed  # noqa: E402

import torch  # noqa: E402

from fusedist.models import LlamaConfig, Runner, build_model  # noqa: E402
from fusedist.models.llama import SafetensorsWeights  # noqa: E402
from fusedist.models.llama.weights import read_projection  # noqa: E402
from tolerances import GEMM_REL, gemm_rel_err  # noqa: E402

REF = torch.load(os.environ["FUSEDIST_FP8_REF"]) if os.environ.get("FUSEDIST_FP8_REF") else None


def _model(rt, path, backend="fusedist", quantize=None):
    cfg = LlamaConfig.from_dir(path)
    return build_model(cfg, SafetensorsWeights(path), backend=backend, group=rt.tp,
                       dtype=torch.float32, device=rt.device, quantize=quantize)


@check
def fp8_logits_equal_tp1(rt, seed):
    assert REF is not None, "FUSEDIST_FP8_REF is not set (tests/models/test_fp8_model.py sets it)"
    for key, want in REF["logits"].items():
        variant, how = key.split("/")
        path = REF["ckpts"][variant]
        quantize = how if how.startswith("fp8") else None
        m = _model(rt, path, "fusedist" if quantize else how, quantize=quantize)
        got = Runner(m, max_batch=1, max_seq_len=32).prefill([REF["prompt"]], all_logits=True)[0]
        # Quantized at load too: the scales come from the whole weight (a MAX all-reduce of
        # the amax where a rank's slice does not hold a whole scale group), so every TP size
        # holds the same FP8 model.
        err = gemm_rel_err(got, want)
        if rt.rank == 0:
            print(f"{key}: TP {rt.tp.size} against TP 1: rel err {err:.2e}", flush=True)
        assert err <= GEMM_REL[torch.float32], f"{key}: TP {rt.tp.size} against TP 1: " \
                                               f"rel err {err:.2e}"


@check
def fp8_shards_are_slices(rt, seed):
    path = REF["ckpts"]["hf-block"]
    cfg = LlamaConfig.from_dir(path)
    m = _model(rt, path)
    src = SafetensorsWeights(path)
    W, r = rt.tp.size, rt.tp.rank
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        full = {n: read_projection(src, p + n, cfg.quant, dtype=torch.float32, device="cpu")
                for n in ("self_attn.o_proj", "mlp.down_proj", "mlp.gate_proj")}
        o = full["self_attn.o_proj"]
        qn = o.shape[1] // W
        assert torch.equal(m.layers[i].attn.o_weight.dequantize(),
                           o.dequantize()[:, r * qn:(r + 1) * qn])
        assert tuple(m.layers[i].attn.o_weight.scale.shape) == (o.scale.shape[0],
                                                                qn // 128)
        inter = cfg.intermediate_size // W
        assert torch.equal(m.layers[i].mlp.down.dequantize(),
                           full["mlp.down_proj"].dequantize()[:, r * inter:(r + 1) * inter])
        assert torch.equal(m.layers[i].mlp.gate_up.dequantize()[:inter],
                           full["mlp.gate_proj"].dequantize()[r * inter:(r + 1) * inter])


@check
def norms_write_fp8_at_tp2(rt, seed):
    """At TP > 1 the model's norm before q/k/v and gate|up is all_reduce_add_rmsnorm over the
    tensor-parallel group (gloo here): with fp8 its e4m3 rows and per-token scales come back as
    FP8Rows, bitwise the reference norm's on the sum of the ranks' partials, the new residual
    in bf16 and the same on every rank; without fp8, (normed, residual) in bf16."""
    from fusedist.nn.quant import FP8, FP8Rows
    from fusedist.ops.add_rmsnorm import add_rmsnorm_reference

    path = REF["ckpts"]["ct-channel"]
    cfg = LlamaConfig.from_dir(path)
    m = build_model(cfg, SafetensorsWeights(path), group=rt.tp, dtype=torch.bfloat16,
                    device=rt.device)
    assert m.tp == rt.tp.size > 1
    hidden = cfg.hidden_size
    parts = [fresh((20, hidden), torch.bfloat16, rt.device, rank_seed(seed, "part", r))
             for r in range(rt.tp.size)]
    res = fresh((20, hidden), torch.bfloat16, rt.device, rank_seed(seed, "res"))
    w = m.layers[0].post_norm
    total = parts[0]
    for p in parts[1:]:        # the all-reduce's sum, rounded to bf16 per addition
        total = total + p
    want = add_rmsnorm_reference(total, res, w, 1e-6, FP8)
    x, h = m._add_rmsnorm(parts[rt.tp.rank].clone(), res.clone(), w, 1e-6, True)
    assert isinstance(x, FP8Rows) and x.data.dtype == FP8 and x.scale.shape == (20,)
    assert torch.equal(x.data.view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(x.scale, want[2])
    assert h.dtype == torch.bfloat16 and torch.equal(h, want[1])
    x, h = m._add_rmsnorm(parts[rt.tp.rank].clone(), res.clone(), w, 1e-6)
    assert isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16 and torch.equal(h, want[1])
    # The check notices a norm that skips the all-reduce (each rank normalizing its own partial).
    import fusedist.models.llama.model as model_mod

    real = model_mod.all_reduce_add_rmsnorm
    model_mod.all_reduce_add_rmsnorm = \
        lambda x, residual, w, eps, *, out_dtype=None, group=None: \
        add_rmsnorm_reference(x, residual, w, eps, out_dtype)
    try:
        x, _ = m._add_rmsnorm(parts[rt.tp.rank].clone(), res.clone(), w, 1e-6, True)
        assert not torch.equal(x.data.view(torch.uint8), want[0].view(torch.uint8))
    finally:
        model_mod.all_reduce_add_rmsnorm = real


if __name__ == "__main__":
    main()
