"""fusedist.models.sampler: each processor against transformers' (repetition penalty, top-k,
top-p, min-p, temperature) on random logits of an odd vocabulary, OpenAI's presence / frequency
penalties against their formula, the seeded noise (batch position does not matter, seeds and
choices do, frequencies follow the probabilities), logprobs, min_tokens, parameter checks."""

from __future__ import annotations

import math

import pytest
import torch

from fusedist.models.sampler import (GenerationParams, ParamError, SampleRow, process_logits,
                                     sample_rows, warp)

V = 203      # not a multiple of any vector width


def _logits(n, seed, scale=3.0):
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * scale


def _row(seed=0, choice=0, step=0, prompt=(), output=(), eos=(), **kw):
    return SampleRow(GenerationParams(**kw), seed, choice, step, list(prompt), list(output),
                     tuple(eos))


def test_repetition_penalty_is_transformers():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    lg = _logits(3, 1)
    seen = [[5, 9, 9, 200], [0, 1, 2], [17]]
    rows = [_row(prompt=s[:2], output=s[2:], repetition_penalty=p, temperature=0)
            for s, p in zip(seen, (1.3, 0.7, 2.0))]
    ours = process_logits(lg, rows)
    for i, (s, r) in enumerate(zip(seen, rows)):
        hf = RepetitionPenaltyLogitsProcessor(r.params.repetition_penalty)(
            torch.tensor([s]), lg[i:i + 1].clone())
        torch.testing.assert_close(ours[i:i + 1], hf, rtol=0, atol=0)


def test_presence_and_frequency_penalties_count_the_output():
    lg = _logits(2, 2)
    out = [[4, 4, 4, 7], [9]]
    rows = [_row(prompt=[4, 11], output=o, presence_penalty=0.5, frequency_penalty=-0.25,
                 temperature=0) for o in out]
    got = process_logits(lg, rows)
    want = lg.clone().double()
    for i, o in enumerate(out):
        for t in set(o):
            want[i, t] -= 0.5 + -0.25 * o.count(t)     # the prompt's 11 is not penalized
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kw", [dict(temperature=0.7), dict(temperature=1.3, top_k=17),
                                dict(top_p=0.6), dict(temperature=0.8, top_k=40, top_p=0.9),
                                dict(min_p=0.05), dict(temperature=0.5, top_p=0.95, min_p=0.1),
                                dict(top_p=0.0001), dict(top_k=1000)])
def test_warpers_are_transformers(kw):
    from transformers.generation.logits_process import (MinPLogitsWarper,
                                                        TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    lg = _logits(4, 3)
    rows = [_row(seed=s, **kw) for s in range(4)]
    ours = warp(lg.clone(), rows)
    p = rows[0].params
    hf = TemperatureLogitsWarper(p.temperature)(None, lg.clone())
    if p.top_k:
        hf = TopKLogitsWarper(p.top_k)(None, hf)
    if p.top_p < 1:
        hf = TopPLogitsWarper(p.top_p)(None, hf)
    if p.min_p:
        hf = MinPLogitsWarper(p.min_p)(None, hf)
    assert torch.equal(torch.isinf(ours), torch.isinf(hf))
    keep = ~torch.isinf(hf)
    torch.testing.assert_close(ours[keep], hf[keep], rtol=1e-6, atol=1e-6)


def test_rows_of_a_batch_keep_their_own_parameters():
    lg = _logits(3, 4)
    rows = [_row(seed=1, top_k=3), _row(seed=1, top_p=0.5), _row(seed=1, temperature=2.0)]
    both = warp(lg.clone(), rows)
    for i, r in enumerate(rows):
        torch.testing.assert_close(both[i:i + 1], warp(lg[i:i + 1].clone(), [r]))


def test_a_tiny_temperature_is_greedy():
    lg = _logits(3, 9)
    ids, _ = sample_rows(lg, [_row(seed=s, temperature=1e-30) for s in range(3)])
    assert ids == lg.argmax(-1).tolist()


def test_greedy_is_the_argmax_of_the_penalized_logits():
    lg = _logits(5, 5)
    rows = [_row(temperature=0, output=[int(lg[i].argmax())], repetition_penalty=100.0)
            for i in range(5)]
    ids, _ = sample_rows(lg, rows)
    assert ids == process_logits(lg, rows).argmax(-1).tolist()
    assert all(i != int(lg[r].argmax()) for r, i in enumerate(ids))   # the penalty bit


def test_a_seeded_sample_does_not_depend_on_its_place_in_the_batch():
    lg = _logits(1, 6, scale=0.5)[0]
    me = _row(seed=1234, step=7, top_p=0.95)
    alone, _ = sample_rows(lg[None], [me])
    others = _logits(6, 7)
    for at in range(7):
        batch = torch.cat([others[:at], lg[None], others[at:]])
        rows = [_row(seed=s, temperature=0.9) for s in range(at)] + [me] + \
            [_row(seed=s, temperature=0.0) for s in range(at, 6)]
        ids, _ = sample_rows(batch, rows)
        assert ids[at] == alone[0], at
    # another seed, step or choice is another draw: over 40 of each, not all the same
    draws = {k: {sample_rows(lg[None], [_row(**{k: v}, top_p=0.95)])[0][0] for v in range(40)}
             for k in ("seed", "step", "choice")}
    assert all(len(d) > 5 for d in draws.values()), draws


def test_sample_frequencies_follow_the_probabilities():
    """20000 draws (steps 0..19999 of one seed) of a 7-token distribution: each token's count
    within 5 standard deviations of its binomial mean."""
    lg = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 1.5]])
    p = torch.softmax(lg[0].double(), -1)
    N = 20000
    rows = [_row(seed=99, step=s) for s in range(N)]
    ids, _ = sample_rows(lg.expand(N, 7), rows)
    counts = torch.bincount(torch.tensor(ids), minlength=7).double()
    sd = (N * p * (1 - p)).sqrt()
    assert ((counts - N * p).abs() <= 5 * sd + 1).all(), (counts, N * p)


def test_logprobs_are_the_models():
    lg = _logits(3, 8)
    rows = [_row(temperature=0, logprobs=3), _row(seed=3, logprobs=0),
            _row(temperature=0, repetition_penalty=2.0, output=[1])]
    ids, lps = sample_rows(lg, rows)
    ref = lg.double().log_softmax(-1)
    lp, top = lps[0]
    assert math.isclose(lp, float(ref[0, ids[0]]), rel_tol=1e-5)
    assert [i for i, _ in top] == ref[0].topk(3).indices.tolist()
    assert all(math.isclose(v, float(ref[0, i]), rel_tol=1e-5) for i, v in top)
    assert lps[1][1] == [] and math.isclose(lps[1][0], float(ref[1, ids[1]]), rel_tol=1e-5)
    assert lps[2] is None


def test_min_tokens_keeps_stop_ids_out():
    lg = torch.zeros(2, V)
    lg[:, 3] = 50.0          # EOS would win
    lg[:, 8] = 40.0          # a stop id next
    rows = [_row(temperature=0, eos=[3], stop_token_ids=[8], min_tokens=2, step=1),
            _row(temperature=0, eos=[3], stop_token_ids=[8], min_tokens=2, step=2)]
    ids, _ = sample_rows(lg, rows)
    assert ids[0] not in (3, 8) and ids[1] == 3


@pytest.mark.parametrize("kw,field", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-1), "temperature"),
    (dict(temperature=float("nan")), "temperature"), (dict(top_p=0), "top_p"),
    (dict(top_k=-1), "top_k"), (dict(min_p=1.5), "min_p"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(presence_penalty=3),
                                                         "presence_penalty"),
    (dict(frequency_penalty="1"), "frequency_penalty"), (dict(n=0), "n"),
    (dict(logprobs=21), "logprobs"), (dict(stop=[""]), "stop"), (dict(stop=5), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"), (dict(seed=1.5), "seed"),
    (dict(ignore_eos="yes"), "ignore_eos"), (dict(min_tokens=-1), "min_tokens"),
    (dict(max_tokens=True), "max_tokens")])
def test_bad_parameters_name_the_field(kw, field):
    with pytest.raises(ParamError) as e:
        GenerationParams(**kw)
    assert e.value.param == field and field in str(e.value)


@pytest.mark.gpu
def test_sampling_on_a_gpu_waits_for_nothing_queued_before_it():
    """sample_rows_async queues its work behind a busy stream without waiting for it (the
    engine's launched-ahead step samples so): every host-to-device column goes through pinned
    memory. The ids and logprobs equal the CPU's (the same counter-based noise)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from fusedist.models.sampler import sample_rows_async
    lg = _logits(5, 11)
    rows = [_row(seed=3, temperature=0.8, top_k=40, top_p=0.9, min_p=0.02, logprobs=2),
            _row(seed=4, temperature=0.0, logprobs=1),
            _row(seed=5, step=1, temperature=1.1, min_tokens=3, eos=(7,)),
            _row(seed=6, temperature=0.7, top_k=5),
            _row(seed=7, temperature=0.0)]
    want = sample_rows(lg, rows)
    dev = torch.device("cuda")
    lg_d = lg.to(dev)
    stream = torch.cuda.current_stream(dev)
    # The engine's steady state: the kernels loaded and pinned host blocks cached (a first
    # kernel launch or a new pinned allocation may wait for the GPU: not what is tested).
    sample_rows_async(lg_d, rows).result()
    stream.synchronize()
    torch.cuda._sleep(1 << 28)           # ~0.1-0.2 s of GPU cycles ahead of the sampling
    # torch names any synchronizing call it makes (a copy from pageable memory, .item())
    torch.cuda.set_sync_debug_mode("error")
    try:
        s = sample_rows_async(lg_d, rows)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not stream.query(), "sample_rows_async waited for the work queued before it"
    ids, lps = s.result()
    assert ids == want[0]
    for got, ref in zip(lps, want[1]):
        assert (got is None) == (ref is None)
        if got is not None:   # float32 log_softmax on two devices: a few ulps apart
            assert math.isclose(got[0], ref[0], rel_tol=1e-5, abs_tol=1e-5)
            assert [i for i, _ in got[1]] == [i for i, _ in ref[1]]
