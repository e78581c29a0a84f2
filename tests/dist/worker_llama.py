"""fusedist.models at TP > 1 (gloo on CPU): logits and greedy ids against Hugging Face on the
tiny checkpoints tests/models/test_llama.py creates (paths in FUSEDIST_LLAMA_CKPTS), both
backends, random weights identical to slices of the full random model."""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "models"))
from _checks import check, main  # noqa: E402

import torch  # noqa: E402

from fusedist.models import LlamaConfig, Runner, build_model  # noqa: E402
from fusedist.models.llama import RandomWeights, SafetensorsWeights  # noqa: E402
from hf_tiny import assert_greedy_matches, load_hf  # noqa: E402
from tolerances import GEMM_REL, gemm_rel_err  # noqa: E402

CKPTS = json.loads(os.environ.get("FUSEDIST_LLAMA_CKPTS", "{}"))


def _model(rt, path, backend):
    cfg = LlamaConfig.from_dir(path)
    return build_model(cfg, SafetensorsWeights(path), backend=backend, group=rt.tp,
                       dtype=torch.float32, device=rt.device)


@check
def logits_and_greedy_match_hf(rt, seed):
    assert CKPTS, "FUSEDIST_LLAMA_CKPTS names no checkpoints (tests/models/test_llama.py sets it)"
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
                ids = r.generate([prompt, prompt[:9]], 32).ids
                tol = GEMM_REL[torch.float32]
                assert_greedy_matches(hf, prompt, ids[0], tol, kind)
                assert_greedy_matches(hf, prompt[:9], ids[1], tol, kind)


@check
def random_shards_are_slices_of_the_full_model(rt, seed):
    cfg = LlamaConfig.named("tiny")
    m = build_model(cfg, RandomWeights(cfg, seed=seed % 97), group=rt.tp, dtype=torch.float32,
                    device=rt.device)
    full = RandomWeights(cfg, seed=seed % 97)
    W, r = rt.tp.size, rt.tp.rank
    inter = cfg.intermediate_size // W
    down = full.read("model.layers.0.mlp.down_proj.weight", dtype=torch.float32, device="cpu")
    assert torch.equal(m.layers[0].mlp.down, down[:, r * inter:(r + 1) * inter])
    assert torch.equal(m.embed, full.read("model.embed_tokens.weight", dtype=torch.float32,
                                          device="cpu"))
    q = full.read("model.layers.1.self_attn.q_proj.weight", dtype=torch.float32, device="cpu")
    qn = cfg.q_size // W
    assert torch.equal(m.layers[1].attn.qkv_weight[:qn], q[r * qn:(r + 1) * qn])


if __name__ == "__main__":
    main()
