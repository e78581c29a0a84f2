"""Ranks that disagree, at TP = the world size over gloo: LLM built with different arguments
on one rank, a rank that refuses its own LLM arguments or request, the model CLI given
different flags or a bad flag on one rank. Every rank must end with an error naming the
difference (or the refusing rank) within seconds: none may wait for the others.

    torchrun --nproc-per-node 2 tests/dist/worker_disagree.py          # the LLM checks
    torchrun --nproc-per-node 2 tests/dist/worker_disagree.py cli      # the CLI, one run
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _checks import check, main  # noqa: E402

import fusedist  # noqa: E402
from fusedist.models import LLM  # noqa: E402

TINY = dict(config="tiny", random_weights=True, max_batch=2, max_seq_len=64)


def _stops(what, call, errors, *needles, within=20.0):
    """call() raises one of `errors` naming every needle, within `within` seconds."""
    t0 = time.time()
    try:
        call()
    except errors as e:
        for n in needles:
            assert n in str(e), f"{what}: {type(e).__name__} {str(e)!r} lacks {n!r}"
    else:
        raise AssertionError(f"{what}: no error")
    took = time.time() - t0
    assert took < within, f"{what}: took {took:.1f} s"


@check
def llm_arguments_differ(rt, seed):
    last = rt.world_size - 1
    mine = rt.rank == last
    for field, ours, theirs in (("quantize", "none", "fp8"), ("max_batch", 2, 4),
                                ("page_size", 16, 8), ("weights_seed", 0, 1),
                                ("dtype", "float32", "bfloat16")):
        kw = dict(TINY, **{field: theirs if mine else ours})
        if field == "weights_seed":
            kw["random_weights"] = True
        _stops(field, lambda: LLM(**kw), fusedist.CollectiveMismatchError,
               f"{field}: ", f"rank {last}: {theirs!r}")
    with LLM(**TINY) as llm:                                   # agreeing ranks still build
        assert llm.generate([1, 2, 3], 2, greedy=True).ids


@check
def a_rank_refusing_its_own_llm_arguments_stops_all(rt, seed):
    last = rt.world_size - 1
    mine = rt.rank == last
    errors = (ValueError, TypeError) if mine else fusedist.CollectiveMismatchError
    _stops("page_size 0", lambda: LLM(**dict(TINY, page_size=0 if mine else 16)), errors,
           "page_size must be an int >= 1")
    _stops("max_batch 2.5", lambda: LLM(**dict(TINY, max_batch=2.5 if mine else 2)), errors,
           "max_batch must be an int >= 1, got 2.5")


@check
def a_request_refused_on_one_rank_stops_all(rt, seed):
    last = rt.world_size - 1
    mine = rt.rank == last
    with LLM(**TINY) as llm:
        errors = (ValueError, TypeError) if mine else fusedist.RequestMismatchError
        _stops("float id", lambda: llm.generate([1, 2.5] if mine else [1, 2], 2), errors,
               "prompt[1] is 2.5")
        _stops("stream", lambda: llm.stream([1, 2], 0 if mine else 2), errors,
               "max_new_tokens must be an int >= 1")
        _stops("greedy", lambda: llm.generate([1, 2], 2, greedy=mine, temperature=0.8),
               fusedist.RequestMismatchError, "sampling.greedy")
        assert llm.generate([1, 2], 2, greedy=True).ids          # still usable
    llm = LLM(**TINY)
    if mine:
        llm.close()                    # this rank's LLM is closed, the others' open
    _stops("closed", lambda: llm.generate([1, 2], 2),
           RuntimeError if mine else fusedist.RequestMismatchError, "the LLM is closed")
    llm.close()


def cli(rank: int) -> None:
    """The model CLI on every rank, with flags that differ or that one rank refuses: every
    rank exits 1 with one line naming the difference."""
    from fusedist import generate

    base = ["--config", "tiny", "--random-weights", "--max-new-tokens", "2", "--device", "cpu",
            "--json", "--quiet"]
    last = int(os.environ["WORLD_SIZE"]) - 1
    mine = rank == last
    cases = (("--quantize", base + (["--quantize", "fp8"] if mine else []),
              "ranks of group world were given different flags: --quantize: "),
             ("--page-size 0", base + (["--page-size", "0"] if mine else []),
              "--page-size must be >= 1, got 0" if mine else
              f"rank {last} of {last + 1} stopped before starting (rank {last}: --page-size "
              "must be >= 1, got 0)"),
             ("--prompt-ids", base + ["--prompt-ids", "1,2" if mine else "3,4"],
              "--prompt-ids: "))
    bad = []
    for what, argv, needle in cases:
        err = io.StringIO()
        t0 = time.time()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                code = generate.main(argv)
            except SystemExit as e:
                code, msg = 1, str(e.code)
            else:
                msg = err.getvalue()
        took = time.time() - t0
        if code != 1 or needle not in msg or took > 60:
            bad.append(f"{what}: exit {code} after {took:.0f} s, {msg[-300:]!r}")
        if fusedist.is_initialized():
            bad.append(f"{what}: fusedist left initialized")
            fusedist.shutdown()
    print(f"rank {rank}: " + ("all checks passed" if not bad else "FAILED: " + " | ".join(bad)),
          flush=True)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "cli":
        cli(int(os.environ["RANK"]))
    else:
        main(backend="gloo")
