"""fusedist.models.SamplingParams: every field is checked at construction, with an error that
names the field and the accepted values (a NaN or infinite temperature was taken before and
made every id 0 or uniform noise)."""

from __future__ import annotations

import math

import pytest
import torch

from fusedist.models import SamplingParams, sample


@pytest.mark.parametrize("kw, match", [
    ({"temperature": float("nan")}, "temperature must be a finite number >= 0"),
    ({"temperature": math.inf}, "temperature must be a finite number >= 0"),
    ({"temperature": -math.inf}, "temperature must be a finite number >= 0"),
    ({"temperature": -0.5}, "temperature must be a finite number >= 0"),
    ({"temperature": "0.7"}, "temperature must be a finite number >= 0"),
    ({"top_p": float("nan")}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"top_k": -1}, "top_k must be an int >= 0"),
    ({"top_k": 2.5}, "top_k must be an int >= 0"),
    ({"top_k": True}, "top_k must be an int >= 0"),
    ({"seed": 1.5}, "seed must be an int"),
    ({"seed": None}, "seed must be an int"),
    ({"seed": 2 ** 64}, "seed must be an int"),
    ({"greedy": "no"}, "greedy must be a bool"),
])
def test_bad_sampling_params_raise(kw, match):
    base = {"greedy": False, "temperature": 0.8}
    with pytest.raises(ValueError, match=match):
        SamplingParams(**{**base, **kw})


def test_good_sampling_params():
    for kw in ({}, {"greedy": False, "temperature": 0.0}, {"greedy": False, "temperature": 2},
               {"top_k": 0, "top_p": 1.0}, {"seed": -3}, {"seed": 2 ** 63}):
        SamplingParams(**kw)
    logits = torch.randn(3, 17, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    ids = sample(logits, SamplingParams(greedy=False, temperature=0.7, top_k=5, seed=1), g)
    assert ids.shape == (3,) and ids.dtype == torch.int64
