"""The torch baseline's two decode forms (fusedist/models/llama/baseline.py) compute the
same masked attention, against a float64 reference; on CUDA the faster one is picked once."""

import sys
from pathlib import Path

import pytest
import torch

from fusedist.models.llama import baseline as ta

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tolerances import TOL_EPILOGUE, count_bad  # noqa: E402

CUDA = torch.cuda.is_available()


def _inputs(T, KH, G, S, D, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, KH, G, D, generator=g).to(device, dtype)
    k = torch.randn(T, KH, S, D, generator=g).to(device, dtype)
    v = torch.randn(T, KH, S, D, generator=g).to(device, dtype)
    lens = torch.randint(1, S + 1, (T,), generator=g)
    mask = (torch.arange(S)[None, :] < lens[:, None])[:, None, None, :].to(device)
    return q, k, v, mask


def _reference(q, k, v, mask):
    s = torch.matmul(q.double(), k.double().transpose(-1, -2)) * q.shape[-1] ** -0.5
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.matmul(p, v.double())


@pytest.mark.parametrize("name", ta.DECODE_PATHS)
@pytest.mark.parametrize("T,S", [(1, 37), (3, 130), (5, 17)])
def test_decode_forms_match_float64_cpu(name, T, S):
    args = _inputs(T, 2, 4, S, 64, torch.float32, "cpu", seed=T * S)
    out = ta._DECODE_FNS[name](*args)
    assert count_bad(out, _reference(*args), torch.float32) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("T,S", [(1, 4160), (64, 4048), (3, 999)])
def test_decode_forms_match_and_pick_cuda(T, S):
    args = _inputs(T, 8, 4, S, 128, torch.bfloat16, "cuda", seed=T + S)
    ref = _reference(*args)
    for name in ta.DECODE_PATHS:
        out = ta._DECODE_FNS[name](*args)
        # bf16 scores (the matmul form rounds q K^T to bf16, as HF's eager attention does)
        # and a bf16 output: the epilogue budget.
        assert count_bad(out, ref, torch.bfloat16, table=TOL_EPILOGUE) == 0, name
    key = ("test", T, S)
    ta.decode_path_choices.pop(key, None)
    choice = ta._pick_decode_path(key, args)
    assert choice in ta.DECODE_PATHS and ta.decode_path_choices[key] == choice
