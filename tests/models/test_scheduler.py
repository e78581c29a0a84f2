"""fusedist.models.Engine (continuous batching) on a tiny checkpoint on the CPU: greedy ids equal
the static Runner's (LLM.generate) through chunked prefills mixed into decode steps and
preemption; a random arrival trace where every request completes and no page leaks; prefix
hits with copy on write; n > 1 choices sharing the prompt; stop strings across token
boundaries, stop ids, EOS; generation_config.json honoured; the queue bound; the async API;
TP 2 under torchrun with the AsyncEngine leader and a follower."""

from __future__ import annotations

import asyncio
import os
import random
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fusedist.models import LLM  # noqa: E402
from fusedist.models.async_engine import AsyncEngine  # noqa: E402
from fusedist.models.hf import GenerationDefaults  # noqa: E402
from fusedist.models.sampler import GenerationParams, ParamError  # noqa: E402
from fusedist.models.scheduler import Engine, QueueFull  # noqa: E402
from hf_tiny import make_checkpoint  # noqa: E402
from launch import assert_passed, torchrun  # noqa: E402
from model_fixtures import rt  # noqa: E402,F401 - the shared runtime fixture
from test_llm import write_generation_config, write_tokenizer  # noqa: E402

GREEDY = GenerationParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("sched") / "llama3")
    make_checkpoint("llama3", d, seed=11)
    write_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def llm(rt, ckpt):  # noqa: F811
    with LLM(ckpt, max_batch=1, max_seq_len=96) as m:
        yield m


_REF: dict = {}


def ref(llm, prompt, n):
    """The static Runner's greedy ids (cached)."""
    key = (tuple(prompt), n)
    if key not in _REF:
        _REF[key] = llm.generate(list(prompt), n, greedy=True, ignore_eos=True).ids
    return _REF[key]


def prompt(n, seed):
    return torch.randint(4, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_no_leak(eng):
    assert not eng.running and not eng.waiting and not eng.requests and not eng.has_work()
    assert eng.pool.num_free == eng.pool.total, (eng.pool.num_free, eng.pool.total)
    assert all(r == 0 for r in eng.pool.ref.values())
    assert sorted(eng._free_rows) == list(range(eng.runner.max_rows))
    eng.pool.check()


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_greedy_ids_equal_the_static_runner(llm, overlap):
    """Odd prompt lengths, a budget that splits prompts into chunks beside decodes, and a pool
    too small for all of them at once (preemption by recompute)."""
    prompts = [prompt(n, 100 + n) for n in (1, 7, 16, 17, 33, 50)]
    news = [9, 5, 12, 7, 10, 6]
    with Engine.from_llm(llm, max_seqs=3, max_num_batched_tokens=13, num_pages=6,
                         overlap=overlap) as eng:
        outs = eng.generate(prompts, [GREEDY.replace(max_tokens=k) for k in news])
        for p, k, o in zip(prompts, news, outs):
            assert o.finished and o.choices[0].ids == ref(llm, p, k)
            assert o.choices[0].finish_reason == "length"
        assert eng.stats.preemptions > 0 and eng.stats.decode_steps > 0
        assert eng.stats.steps > eng.stats.decode_steps          # mixed steps too
        assert_no_leak(eng)


def _run_trace(llm, overlap: bool, max_seqs: int = 4, num_pages: int = 8):
    """A random arrival trace (half the prompts share a prefix; greedy and seeded sampled
    requests, n up to 3, stop ids, aborts 3 steps after arrival) through an engine; returns
    (engine, trace, results by request id, index of each id in trace, aborted ids)."""
    rng = random.Random(7)
    base = prompt(40, 1)
    eng = Engine.from_llm(llm, max_seqs=max_seqs, max_num_batched_tokens=19,
                          num_pages=num_pages, overlap=overlap)
    trace = []
    for i in range(16):
        shared = rng.random() < 0.5                      # half share a prefix
        n = rng.randint(1, 30)
        p = (base[:rng.randint(16, 40)] + prompt(n, 200 + i)) if shared else prompt(n, 300 + i)
        greedy = rng.random() < 0.5
        gp = GenerationParams(max_tokens=rng.randint(1, 14), ignore_eos=True,
                              temperature=0 if greedy else 0.9, top_p=0.9, seed=i,
                              n=1 if greedy else rng.randint(1, 3),
                              stop_token_ids=() if greedy else (rng.randint(4, 255),))
        trace.append((rng.randint(0, 30), p, gp, rng.random() < 0.15))
    results, aborted, step = {}, set(), 0
    pending = sorted(range(len(trace)), key=lambda i: trace[i][0])
    rid_of = {}
    while pending or eng.has_work():
        while pending and trace[pending[0]][0] <= step:
            i = pending.pop(0)
            rid_of[eng.add_request(f"r{i}", trace[i][1], trace[i][2])] = i
        for rid, i in rid_of.items():
            if trace[i][3] and step == trace[i][0] + 3 and rid not in results:
                eng.abort(rid)
                aborted.add(rid)
        for out in eng.step():
            if out.request_id in results:
                results[out.request_id].merge(out)
            else:
                results[out.request_id] = out
        step += 1
        assert step < 2000, "the trace does not finish"
        eng.pool.check()
    return eng, trace, results, rid_of, aborted


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_random_arrival_trace_completes_without_leaks(llm, overlap):
    eng, trace, results, rid_of, aborted = _run_trace(llm, overlap)
    assert set(results) == set(rid_of)
    for rid, out in results.items():
        p, gp = trace[rid_of[rid]][1], trace[rid_of[rid]][2]
        assert out.finished and len(out.choices) == gp.n
        for c in out.choices:
            assert c.finish_reason in ("length", "stop", "abort")
            if c.finish_reason == "abort":
                assert rid in aborted
                continue
            assert len(c.ids) <= gp.max_tokens
            if c.finish_reason == "length":
                assert len(c.ids) == gp.max_tokens
            else:
                assert c.ids[-1] in gp.stop_token_ids
            if gp.greedy:
                assert c.ids == ref(llm, p, gp.max_tokens), rid
    assert eng.stats.preemptions > 0 and eng.pool.hit_tokens > 0
    assert (eng.stats.overlapped_steps > 0) == overlap
    assert_no_leak(eng)
    eng.close()


def _steady(llm, overlap: bool):
    """Eight requests decoding together (seeded draws that stop on any of 16 ids, a greedy
    one with logprobs, an abort at step 10): step by step outputs and the engine."""
    stops = tuple(range(40, 56))
    params = [GenerationParams(max_tokens=40, temperature=1.0, seed=i, stop_token_ids=stops,
                               ignore_eos=True) for i in range(7)]
    params.append(GREEDY.replace(max_tokens=40, logprobs=2))
    eng = Engine.from_llm(llm, max_seqs=8, num_pages=64, overlap=overlap)
    rids = [eng.add_request(f"s{i}", prompt(5 + i, 700 + i), sp) for i, sp in enumerate(params)]
    steps, k = [], 0
    while eng.has_work():
        if k == 10:
            eng.abort(rids[2])
        steps.append(sorted((o.request_id, [(c.index, c.ids, c.text, c.finish_reason,
                                              c.logprobs) for c in o.choices], o.finished)
                            for o in eng.step()))
        k += 1
    return steps, eng


def test_overlap_steady_decode_same_steps(llm):
    """Requests decoding together, some ending on stop ids, one aborted: with overlap every
    step hands out exactly what it hands out without (ids, text, finish reasons, logprobs),
    nearly every decode step overlaps, and the rows of sequences that ended are dropped."""
    want, plain = _steady(llm, False)
    got, over = _steady(llm, True)
    assert got == want
    assert any(f for s in want for _, ch, f in s for c in ch if c[3] == "stop")
    assert over.stats.overlapped_steps >= over.stats.decode_steps - 3 > 20, over.stats
    assert over.stats.overlap_dropped > 0 and plain.stats.overlapped_steps == 0
    # Ends by length are known ahead: those rows are left out, not dropped.
    dropped, steps = over.stats.overlap_dropped, over.stats.overlapped_steps
    ps = [prompt(n, 800 + n) for n in (3, 11, 6, 20)]
    outs = over.generate(ps, [GREEDY.replace(max_tokens=k) for k in (3, 9, 17, 30)])
    for p, k, o in zip(ps, (3, 9, 17, 30), outs):
        assert o.choices[0].ids == ref(llm, p, k)
    assert over.stats.overlap_dropped == dropped and over.stats.overlapped_steps > steps + 20
    for eng in (plain, over):
        assert_no_leak(eng)
        eng.close()


def test_overlap_hands_out_the_same_tokens(llm):
    """The engine with overlap (each decode step launched before the previous step's tokens
    reach the host, a sequence's row kept one step past a stop) gives every request that was
    not aborted the same choices, token by token, as without: ids, text, finish reasons (a
    seeded draw depends on the request's seed, its choice and its step only). Most decode
    steps overlap, at a pool large enough not to preempt and with one too small."""
    for max_seqs, num_pages in ((8, 64), (4, 8)):
        runs = [_run_trace(llm, ov, max_seqs, num_pages) for ov in (False, True)]
        (plain, _, want, _, ab0), (over, _, got, _, ab1) = runs
        assert set(want) == set(got)
        for rid in set(want) - ab0 - ab1:
            a = [(c.index, c.ids, c.text, c.finish_reason) for c in want[rid].choices]
            b = [(c.index, c.ids, c.text, c.finish_reason) for c in got[rid].choices]
            assert a == b, rid
        assert over.stats.overlapped_steps > 0.3 * over.stats.decode_steps, \
            (over.stats.overlapped_steps, over.stats.decode_steps)
        assert over.stats.generation_tokens >= plain.stats.generation_tokens - 64
        for eng in (plain, over):
            assert_no_leak(eng)
            eng.close()


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_prefix_hits_copy_the_page_they_write(llm, overlap):
    p = prompt(32, 5)                                   # two whole pages of 16
    with Engine.from_llm(llm, max_seqs=2, max_num_batched_tokens=64, num_pages=20,
                         overlap=overlap) as eng:
        first = eng.generate([p], GREEDY)[0]
        assert first.cached_tokens == 0 and first.choices[0].ids == ref(llm, p, 8)
        again = eng.generate([p], GREEDY)[0]
        # every page cached: the last token is recomputed for its logits, in a copy of the
        # second page (the cached one stays as it was)
        assert again.cached_tokens == 31 and again.choices[0].ids == first.choices[0].ids
        longer = p + prompt(5, 6)
        out = eng.generate([longer], GREEDY)[0]
        assert out.cached_tokens == 32 and out.choices[0].ids == ref(llm, longer, 8)
        # the generated tokens' pages are cached too: a follow-up turn hits them
        turn = p + first.choices[0].ids + prompt(3, 7)
        out = eng.generate([turn], GREEDY.replace(max_tokens=4))[0]
        assert out.cached_tokens == 32 and out.choices[0].ids == ref(llm, turn, 4)
        assert 0 < eng.pool.hit_rate < 1
        assert_no_leak(eng)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_n_choices_share_the_prompt_pages(llm, overlap):
    p = prompt(21, 8)
    sp = GenerationParams(max_tokens=6, temperature=1.0, seed=42, n=3, ignore_eos=True)
    with Engine.from_llm(llm, max_seqs=4, max_num_batched_tokens=64, num_pages=30,
                         overlap=overlap) as eng:
        rid = eng.add_request(None, p, sp)
        out, = eng.step()                               # the prefill, then the fork
        req = eng.requests[rid]
        assert len(req.seqs) == 3 and eng.stats.prompt_tokens == 21
        first_page = req.seqs[0].pages[0]
        assert all(s.pages[0] == first_page for s in req.seqs) and eng.pool.ref[first_page] == 3
        while eng.has_work():
            for o in eng.step():
                out = o if out is None else (out.merge(o) or out)
        assert [c.index for c in out.choices] == [0, 1, 2]
        ids = [c.ids for c in out.choices]
        assert len({tuple(x) for x in ids}) > 1          # three draws, not one
        alone = eng.generate([p], sp.replace(n=1))[0].choices[0].ids
        assert alone == ids[0]                           # choice 0 is the n = 1 draw
        assert eng.generate([p], sp)[0].choices[1].ids == ids[1]   # seeded: reproducible
        assert_no_leak(eng)


def _texts(llm, p, ids) -> list:
    """The text after each of `ids`, continuing prompt p (as the engine decodes it)."""
    from fusedist.models.detokenize import IncrementalDetokenizer

    d, out, text = IncrementalDetokenizer(llm.tokenizer, p), [], ""
    for t in ids:
        text += d.push(t)
        out.append(text)
    return out


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_stop_strings_across_token_boundaries(llm, overlap):
    p = prompt(9, 9)
    with Engine.from_llm(llm, max_seqs=2, num_pages=20, overlap=overlap) as eng:
        free = eng.generate([p], GREEDY.replace(max_tokens=10))[0].choices[0]
        texts = _texts(llm, p, free.ids)
        assert texts[-1] == free.text
        # the end of the 3rd token's text, then the start of the 4th's (" wNN"): the stop
        # string is complete only with the 4th token
        stop = texts[2][-1] + texts[3][len(texts[2]):len(texts[2]) + 2]
        k = next(i for i, t in enumerate(texts) if stop in t)
        assert k >= 3 and stop not in texts[k - 1]
        want = free.text[:free.text.index(stop)]
        got = eng.generate([p], GREEDY.replace(max_tokens=10, stop=("zzz", stop)))[0].choices[0]
        assert got.finish_reason == "stop" and got.stop_reason == stop
        assert got.text == want and got.ids == free.ids[:k + 1]
        keep = eng.generate([p], GREEDY.replace(max_tokens=10, stop=(stop,),
                                                include_stop_str_in_output=True))[0]
        assert keep.choices[0].text == want + stop
        # stop ids end a choice without their text; min_tokens holds them off
        sid = free.ids[2]
        c = eng.generate([p], GREEDY.replace(max_tokens=10, stop_token_ids=(sid,)))[0].choices[0]
        first = free.ids.index(sid)
        assert c.ids == free.ids[:first + 1] and c.stop_reason == sid
        assert c.finish_reason == "stop" and c.text == (texts[first - 1] if first else "")
        c = eng.generate([p], GREEDY.replace(max_tokens=10, stop_token_ids=(sid,),
                                             min_tokens=10))[0].choices[0]
        assert c.finish_reason == "length" and len(c.ids) == 10
        # deltas add up to the text, the stop string held back until it cannot start one
        rid = eng.add_request(None, p, GREEDY.replace(max_tokens=10, stop=(stop,)))
        text = ""
        while eng.has_work():
            for o in eng.step():
                text += "".join(ch.text for ch in o.choices if o.request_id == rid)
        assert text == want
        assert_no_leak(eng)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_eos_ends_a_choice(llm, ckpt, tmp_path, overlap):
    p = prompt(6, 10)
    free = ref(llm, p, 10)
    d = tmp_path / "eos"
    d.mkdir()
    for f in os.listdir(ckpt):
        if f != "generation_config.json":
            os.symlink(os.path.join(ckpt, f), d / f)
    write_generation_config(str(d), eos_token_id=[free[3]], do_sample=False)
    with LLM(str(d), max_batch=1, max_seq_len=96) as m, \
            Engine.from_llm(m, max_seqs=2, num_pages=12, overlap=overlap) as eng:
        c = eng.generate([p], GenerationParams(max_tokens=10, temperature=0))[0].choices[0]
        assert c.ids == free[:free.index(free[3]) + 1] and c.finish_reason == "stop"
        c = eng.generate([p], GenerationParams(max_tokens=10, temperature=0,
                                               ignore_eos=True))[0].choices[0]
        assert c.ids == free


def test_generation_config_is_honoured_field_by_field(ckpt, tmp_path, rt):  # noqa: F811
    g = GenerationDefaults.from_dict({"do_sample": True, "temperature": 0.7, "top_p": 0.8,
                                      "top_k": 20, "repetition_penalty": 1.05, "min_p": 0.02,
                                      "max_new_tokens": 33, "stop_strings": ["\n\n"],
                                      "bos_token_id": 1, "transformers_version": "4.37"})
    assert g.params() == GenerationParams(max_tokens=33, temperature=0.7, top_p=0.8, top_k=20,
                                          repetition_penalty=1.05, min_p=0.02, stop=("\n\n",))
    assert g.params(temperature=0).greedy and g.params(top_k=5).top_k == 5
    greedy = GenerationDefaults.from_dict({"repetition_penalty": 1.2, "max_length": 50,
                                           "min_new_tokens": 2})
    assert greedy.params(prompt_len=20) == GenerationParams(
        max_tokens=30, temperature=0.0, repetition_penalty=1.2, min_tokens=2)
    assert greedy.params(top_p=0.9).temperature == 1.0 and greedy.params(top_p=0.9).top_k == 0
    with pytest.warns(UserWarning, match="num_beams=4 is not honoured"):
        g = GenerationDefaults.from_dict({"num_beams": 4, "length_penalty": 2.0})
    assert g.ignored == ("num_beams",)
    with pytest.warns(UserWarning, match="flux_capacitor=1 is not a field fusedist knows"):
        GenerationDefaults.from_dict({"flux_capacitor": 1})
    with pytest.warns(UserWarning, match="repetition_penalty=1.2, min_new_tokens=2 not applied by the static"):
        greedy.sampling()
    # the engine takes the file's defaults: a repetition penalty changes the greedy ids
    d = tmp_path / "rp"
    d.mkdir()
    for f in os.listdir(ckpt):
        if f != "generation_config.json":
            os.symlink(os.path.join(ckpt, f), d / f)
    write_generation_config(str(d), repetition_penalty=3.0, do_sample=False,
                            max_new_tokens=12)
    p = prompt(10, 11)
    with LLM(str(d), max_batch=1, max_seq_len=96) as m, \
            Engine.from_llm(m, max_seqs=2, num_pages=12) as eng:
        dflt = eng.default_params(ignore_eos=True)
        assert dflt.repetition_penalty == 3.0 and dflt.max_tokens == 12 and dflt.greedy
        got = eng.generate([p], dflt)[0].choices[0].ids
        plain = eng.generate([p], dflt.replace(repetition_penalty=1.0))[0].choices[0].ids
        assert plain == m.generate(p, 12, greedy=True, ignore_eos=True).ids
        assert got != plain and len(set(got)) > len(set(plain))


def test_overlap_default_follows_the_device(llm):
    """overlap=None: on for GPUs, off on the CPU (the forward runs on the host there); a value
    that is not None or a bool is named."""
    with Engine.from_llm(llm, max_seqs=2, num_pages=6) as eng:
        assert eng.overlap == (eng.device.type == "cuda")
    with pytest.raises(ValueError, match="overlap must be None"):
        Engine.from_llm(llm, max_seqs=2, num_pages=6, overlap="yes")


def test_bad_requests_and_the_queue_bound(llm):
    with Engine.from_llm(llm, max_seqs=2, num_pages=6, max_waiting=2) as eng:
        for ids, sp, field in (([], GREEDY, "prompt"), ([1, 2, 999], GREEDY, "prompt"),
                               ([5] * 96, GREEDY, "prompt"),
                               ([5] * 90, GREEDY.replace(max_tokens=7), "max_tokens"),
                               ([5] * 10, GREEDY.replace(max_tokens=80), "max_tokens"),
                               ([5], GREEDY.replace(n=3), "n"), ("w1", GREEDY, "prompt")):
            with pytest.raises(ParamError) as e:
                eng.add_request(None, ids, sp)
            assert e.value.param == field, (ids, e.value)
        eng.add_request("a", [5, 6], GREEDY)
        with pytest.raises(ParamError, match="already"):
            eng.add_request("a", [5, 6], GREEDY)
        eng.add_request("b", [5, 6], GREEDY)
        with pytest.raises(QueueFull):
            eng.add_request("c", [5, 6], GREEDY)
        eng.step()                                      # both admitted: room again
        eng.add_request("c", [5, 6], GREEDY)
        eng.abort("a")
        eng.abort("c")
        while eng.has_work():
            eng.step()
        assert_no_leak(eng)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_async_streams(llm, overlap):
    prompts = [prompt(n, 400 + n) for n in (5, 19, 11)]

    async def main(ae):
        async def one(p):
            text, ids = "", []
            async for out in ae.stream(p, GREEDY.replace(max_tokens=9)):
                text += out.choices[0].text if out.choices else ""
                ids += out.choices[0].ids if out.choices else []
            return ids, text
        got = await asyncio.gather(*(one(p) for p in prompts))
        # a stream closed early aborts its request
        agen = ae.stream(prompts[0], GREEDY.replace(max_tokens=60))
        await agen.__anext__()
        await agen.aclose()
        return got

    with Engine.from_llm(llm, max_seqs=2, max_num_batched_tokens=16, num_pages=16,
                         overlap=overlap) as eng:
        want = eng.generate(prompts, GREEDY.replace(max_tokens=9))
        ae = AsyncEngine(eng).start()
        try:
            got = asyncio.run(main(ae))
            for (ids, text), w in zip(got, want):
                assert ids == w.choices[0].ids and text == w.choices[0].text
            for _ in range(500):
                if not eng.has_work():
                    break
                import time
                time.sleep(0.01)
            assert eng.stats.finished.get("abort") == 1
        finally:
            ae.shutdown()
        assert_no_leak(eng)


@pytest.mark.timeout(300)
def test_engine_tp2_cpu(ckpt):
    assert_passed(torchrun("worker_engine.py", 2, {"CUDA_VISIBLE_DEVICES": ""}, timeout=280,
                           args=(ckpt,)), 2)


@pytest.mark.gpu
def test_gpu_engine_replays_the_runners_graphs(tmp_path_factory):
    """On a GPU (bf16, head_dim 128: the paged prefill kernel and prefill graphs): a request
    alone runs the static Runner's kernels at batch 1 (its prefill graph, its bucket-1 decode
    graph) and gets its ids exactly; a trace of batched, chunked, preempted requests with n > 1
    completes without leaks through decode graphs of several buckets and prefill graphs; the
    async stepping thread drives the same engine."""
    import fusedist

    if fusedist.is_initialized():
        fusedist.shutdown()
    d = str(tmp_path_factory.mktemp("gpu") / "h128")
    make_checkpoint("llama_fp8", d, seed=3)
    with LLM(d, max_batch=1, max_seq_len=256) as m, \
            Engine.from_llm(m, max_seqs=8, max_num_batched_tokens=128, num_pages=24) as eng:
        assert m.device.type == "cuda" and m.dtype == torch.bfloat16
        r = eng.runner
        assert r.cuda_graphs and set(r.graphs) == set(r.buckets) and r.prefill_graph_tokens
        for n in (1, 37, 100):
            p = prompt(n, 500 + n)
            want = m.generate(p, 12, greedy=True, ignore_eos=True).ids
            got = eng.generate([p], GREEDY.replace(max_tokens=12))[0].choices[0].ids
            assert got == want, n
        rng = random.Random(1)
        prompts = [prompt(rng.randint(1, 150), 600 + i) for i in range(12)]
        params = [GenerationParams(max_tokens=rng.randint(1, 40), ignore_eos=True, seed=i,
                                   temperature=rng.choice([0.0, 0.8]), n=rng.choice([1, 1, 2]))
                  for i in range(12)]
        outs = eng.generate(prompts, params)
        for o, sp in zip(outs, params):
            assert o.finished and len(o.choices) == sp.n
            assert all(len(c.ids) == sp.max_tokens for c in o.choices)
        assert eng.stats.preemptions > 0 and len(r.prefill_graphs) > 0
        assert eng.stats.decode_steps > 0
        assert_no_leak(eng)
        ae = AsyncEngine(eng).start()
        try:
            async def two():
                return await asyncio.gather(*(ae.generate(p, GREEDY.replace(max_tokens=5))
                                              for p in prompts[:2]))
            got = asyncio.run(two())
            assert all(len(o.choices[0].ids) == 5 for o in got)
        finally:
            ae.shutdown()
        assert_no_leak(eng)


@pytest.mark.gpu
def test_gpu_engine_overlap_same_tokens(tmp_path_factory):
    """On a GPU (bf16, decode graphs): eight requests decoding together, greedy and seeded,
    ending by length at different steps, give the same ids with overlap as without (every
    step's rows and bucket are the same: ends by length are left out ahead), and most decode
    steps overlap."""
    import fusedist

    if fusedist.is_initialized():
        fusedist.shutdown()
    d = str(tmp_path_factory.mktemp("gpu_overlap") / "h128")
    make_checkpoint("llama_fp8", d, seed=5)
    prompts = [prompt(3 + 9 * i, 900 + i) for i in range(8)]
    params = [GenerationParams(max_tokens=20 + 7 * i, ignore_eos=True, seed=i,
                               temperature=0.0 if i % 2 else 0.8) for i in range(8)]
    with LLM(d, max_batch=1, max_seq_len=256) as m:
        outs = {}
        for overlap in (False, True):
            with Engine.from_llm(m, max_seqs=8, num_pages=64, overlap=overlap) as eng:
                assert eng.runner.cuda_graphs
                outs[overlap] = [o.choices[0].ids for o in eng.generate(prompts, params)]
                stats = eng.stats
                assert_no_leak(eng)
        assert outs[True] == outs[False]
        assert stats.overlapped_steps > 0.8 * stats.decode_steps and stats.overlap_dropped == 0

