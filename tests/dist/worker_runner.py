"""Runner.generate at TP > 1 (gloo on CPU) when ranks are handed different requests: every
rank raises fusedist.RequestMismatchError naming each differing field and every rank's value,
in bounded time (before: rank 0 reported wrong ids and exited 0, different max_new_tokens
broke gloo's connection, EOS ids on one rank aborted the job), and the runner works for the
next, matching request. A request invalid on one rank only fails there with its ValueError
and on the others with the mismatch. Launched by tests/models/test_runner.py."""

from __future__ import annotations

import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _checks import check, main  # noqa: E402

import torch  # noqa: E402

import fusedist  # noqa: E402
from fusedist.models import LlamaConfig, Runner, SamplingParams, build_model  # noqa: E402
from fusedist.models.llama import RandomWeights  # noqa: E402

_RUNNER = {}
PROMPTS = [[5, 17, 42, 8, 99], [7, 3, 250]]
SAMPLED = SamplingParams(greedy=False, temperature=0.8, top_p=0.9, seed=5)


def _runner(rt):
    if "r" not in _RUNNER:
        cfg = LlamaConfig.named("tiny")
        m = build_model(cfg, RandomWeights(cfg, seed=4), group=rt.tp, dtype=torch.float32,
                        device=rt.device)
        _RUNNER["r"] = Runner(m, max_batch=2, max_seq_len=64)
    return _RUNNER["r"]


def _same_everywhere(rt, ids, what):
    got = rt.tp.all_gather_object(ids)
    assert all(g == got[0] for g in got), f"{what}: ranks report different ids: {got}"


def _expect_mismatch(rt, call, *fields_and_values, within=20.0):
    """call() raises RequestMismatchError naming every field and value given, on every rank,
    within `within` seconds; then a matching request still generates the same ids on every
    rank."""
    t0 = time.time()
    try:
        call()
    except fusedist.RequestMismatchError as e:
        msg = str(e)
    else:
        raise AssertionError("generate() of different requests raised nothing")
    took = time.time() - t0
    assert took < within, f"the mismatch took {took:.1f} s to report"
    assert isinstance(fusedist.RequestMismatchError("x"), (fusedist.FusedistError, ValueError))
    for part in ("Runner.generate: ranks of group tp0 were given different requests",
                 *fields_and_values):
        assert part in msg, f"message lacks {part!r}: {msg}"
    r = _runner(rt)
    _same_everywhere(rt, r.generate(PROMPTS, 4, SAMPLED).ids, "after the mismatch")
    return msg


@check
def same_request_generates_same_ids(rt, seed):
    r = _runner(rt)
    out = r.generate(PROMPTS, 6, SAMPLED, eos_ids=(1,))
    _same_everywhere(rt, out.ids, "same request")


@check
def different_prompt_ids_same_length(rt, seed):
    p = [list(PROMPTS[0]), PROMPTS[1]]
    if rt.rank == 1:
        p[0][3] = 123
    msg = _expect_mismatch(rt, lambda: _runner(rt).generate(p, 6), "prompts[0]",
                           "rank 0: 5 ids [5, 17, 42, 8, 99]", "rank 1: 5 ids [5, 17, 42, 123, 99]")
    assert "prompts[1]" not in msg, msg


@check
def different_seed(rt, seed):
    sp = SamplingParams(greedy=False, temperature=0.8, top_p=0.9, seed=rt.rank)
    _expect_mismatch(rt, lambda: _runner(rt).generate(PROMPTS, 6, sp), "sampling.seed",
                     "rank 0: 0", "rank 1: 1")


@check
def different_max_new_tokens(rt, seed):
    n = 8 if rt.rank == 0 else 12
    _expect_mismatch(rt, lambda: _runner(rt).generate(PROMPTS, n), "max_new_tokens",
                     "rank 0: 8", "rank 1: 12")


@check
def eos_ids_on_one_rank(rt, seed):
    second = _runner(rt).generate(PROMPTS, 3).ids[0][1]
    eos = (second,) if rt.rank == 0 else ()
    _expect_mismatch(rt, lambda: _runner(rt).generate(PROMPTS, 8, eos_ids=eos), "eos_ids",
                     f"rank 0: {list(eos)}" if rt.rank == 0 else "rank 1: []")


@check
def different_sampling_and_context(rt, seed):
    sp = SAMPLED if rt.rank == 0 else SamplingParams(greedy=True, seed=5)
    fill = 0 if rt.rank == 0 else 3
    _expect_mismatch(rt, lambda: _runner(rt).generate(PROMPTS, 4, sp, context_fill=fill),
                     "sampling.greedy", "sampling.temperature", "context_fill", "rank 1: 3")


@check
def invalid_request_on_one_rank(rt, seed):
    n = 4 if rt.rank == 0 else 0
    # The errors say which path found it: the request check, not a peer's timeout (which
    # would be PeerLostError after FUSEDIST_TIMEOUT_S).
    try:
        _runner(rt).generate(PROMPTS, n)
    except fusedist.RequestMismatchError as e:
        assert rt.rank == 0, f"rank {rt.rank}: {e}"
        assert "rank 1: invalid: ValueError: Runner.generate: max_new_tokens must be" in str(e), e
    except ValueError as e:
        assert rt.rank == 1 and "max_new_tokens must be" in str(e), f"rank {rt.rank}: {e}"
    else:
        raise AssertionError("no error")
    _same_everywhere(rt, _runner(rt).generate(PROMPTS, 3).ids, "after the invalid request")


if __name__ == "__main__":
    main()
