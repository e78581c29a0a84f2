"""fusedist.serve with the official `openai` client against a server on localhost (a tiny
checkpoint on the CPU): greedy ids equal LLM.generate, concurrent streaming clients, a client
that disconnects (its request aborted, its pages released), stop strings, n > 1, prefix hits,
chat with logprobs, bad requests (400 naming the field), a full queue (503), /health,
/v1/models, /metrics; `python -m fusedist.serve` shutting down gracefully on SIGTERM."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "models"))
sys.path.insert(0, str(ROOT / "tests"))

# The serving extra and the client (pip install "fusedist[serve]" openai; tests/run.sh and
# CI install them): a host without them (an offline GPU host) skips this file, naming them.
for _dep in ("fastapi", "uvicorn", "openai"):
    pytest.importorskip(_dep, reason='pip install "fusedist[serve]" openai')
import openai  # noqa: E402
import uvicorn  # noqa: E402

from fusedist.models import LLM  # noqa: E402
from fusedist.models.async_engine import AsyncEngine  # noqa: E402
from fusedist.models.scheduler import Engine  # noqa: E402
from fusedist.serve import build_app  # noqa: E402
from hf_tiny import make_checkpoint  # noqa: E402
from model_fixtures import rt  # noqa: E402,F401 - the shared runtime fixture
from test_llm import write_tokenizer  # noqa: E402

NAME = "tiny"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("serve") / "llama3")
    make_checkpoint("llama3", d, seed=13)
    write_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def llm(rt, ckpt):  # noqa: F811
    with LLM(ckpt, max_batch=1, max_seq_len=128) as m:
        yield m


class Server:
    """An AsyncEngine and uvicorn in this process (uvicorn on a thread), on a free port."""

    def __init__(self, llm, **kw):
        self.engine = Engine.from_llm(llm, **kw)
        self.ae = AsyncEngine(self.engine).start()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(build_app(self.ae, NAME),
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       daemon=True)
        self.thread.start()
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="-",
                                    max_retries=0, timeout=60)
        for _ in range(300):
            if self.server.started:
                break
            time.sleep(0.02)

    def request(self, method, path, body=None, raw=None):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None
                                            else None)
        c.request(method, path, data, {"Content-Type": "application/json"})
        r = c.getresponse()
        out = r.status, r.read().decode(), dict(r.getheaders())
        c.close()
        return out

    def idle(self, timeout=30.0):
        """Wait until the engine has no request and every page is back."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            e = self.engine
            if not e.has_work() and e.pool.num_free == e.pool.total:
                return True
            time.sleep(0.02)
        return False

    def close(self):
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.ae.shutdown()
        self.engine.close()


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "overlap"])
def srv(llm, request):
    s = Server(llm, max_seqs=4, max_num_batched_tokens=32, num_pages=48, max_waiting=64,
               overlap=request.param)
    yield s
    s.close()


def _prompt(n, seed):
    return torch.randint(4, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_models_health_and_greedy_ids_equal_llm_generate(srv, llm):
    assert [m.id for m in srv.client.models.list().data] == [NAME]
    assert srv.request("GET", "/health")[0] == 200
    prompts = [_prompt(n, n) for n in (3, 17, 30)]
    r = srv.client.completions.create(model=NAME, prompt=prompts, max_tokens=9, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    for p, c in zip(prompts, r.choices):
        assert c.token_ids == llm.generate(p, 9, greedy=True, ignore_eos=True).ids
        assert c.finish_reason == "length"
    assert r.usage.prompt_tokens == 50 and r.usage.completion_tokens == 27
    text = srv.client.completions.create(model=NAME, prompt="w3 w4 w5", max_tokens=6,
                                         temperature=0, extra_body={"ignore_eos": True})
    want = llm.generate("w3 w4 w5", 6, greedy=True, ignore_eos=True)
    assert text.choices[0].text.strip() == want.text        # the text continues the prompt


def test_concurrent_streaming_clients(srv):
    prompts = [f"w{i} w{i + 7} w{i + 3}" for i in range(4, 10)]
    want = [srv.client.completions.create(model=NAME, prompt=p, max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True}).choices[0].text
            for p in prompts]
    got = [None] * len(prompts)
    errors = []

    def client(i):
        try:
            chunks = srv.client.completions.create(model=NAME, prompt=prompts[i], max_tokens=12,
                                                   temperature=0, stream=True,
                                                   extra_body={"ignore_eos": True})
            parts = [(c.choices[0].text, c.choices[0].finish_reason) for c in chunks]
            assert parts[-1][1] == "length" and all(f is None for _, f in parts[:-1])
            got[i] = "".join(t for t, _ in parts)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert got == want
    assert srv.idle()


def test_a_client_that_disconnects_frees_its_pages(srv):
    # The request must still be running when the server sees its client gone, however slow
    # the machine: once the request has its first token, no step runs until its abort is
    # queued (at most HOLD_S; a server that never sees the disconnect then lets the request
    # run to its end, and the abort counts below fail).
    eng = srv.engine
    hold = {"base": None}    # generation_tokens when the request was sent; None: no hold

    def held_step():
        base = hold["base"]
        if base is not None and eng.stats.generation_tokens > base:
            end = time.monotonic() + HOLD_S
            while not _abort_queued(eng):
                if time.monotonic() > end:
                    hold["base"] = None
                    break
                time.sleep(0.005)
        return type(eng).run_step(eng)

    eng.run_step = held_step
    try:
        _disconnects(srv, hold)
    finally:
        del eng.run_step


HOLD_S = 30.0


def _abort_queued(eng) -> bool:
    with eng._lock:
        return any(e[0] == "abort" for e in eng._inbox)


def _disconnects(srv, hold):
    before = srv.engine.stats.finished.get("abort", 0)
    hold["base"] = srv.engine.stats.generation_tokens
    c = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    c.request("POST", "/v1/completions", json.dumps(
        {"model": NAME, "prompt": _prompt(20, 1), "max_tokens": 100, "temperature": 0,
         "ignore_eos": True, "stream": True}), {"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200
    assert r.readline().startswith(b"data: ")             # it is decoding
    assert srv.engine.pool.num_free < srv.engine.pool.total
    c.sock.shutdown(socket.SHUT_RDWR)
    c.close()
    assert srv.idle(), "the request was not aborted, or its pages not released"
    assert srv.engine.stats.finished.get("abort", 0) == before + 1
    # a non-streaming request whose client gives up
    hold["base"] = srv.engine.stats.generation_tokens
    c = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    c.request("POST", "/v1/completions", json.dumps(
        {"model": NAME, "prompt": _prompt(20, 2), "max_tokens": 100, "temperature": 0,
         "ignore_eos": True}), {"Content-Type": "application/json"})
    end = time.monotonic() + 30
    while srv.engine.stats.generation_tokens <= hold["base"] or not srv.engine.running:
        assert time.monotonic() < end, "the request never started decoding"
        time.sleep(0.005)
    c.sock.shutdown(socket.SHUT_RDWR)
    c.close()
    assert srv.idle(), "the request was not aborted, or its pages not released"
    assert srv.engine.stats.finished.get("abort", 0) == before + 2
    # ... and its handler ended (an aborted request sends nothing more to its queue)
    end = time.monotonic() + 10
    while srv.server.server_state.tasks:
        assert time.monotonic() < end, f"request handlers left running: " \
            f"{srv.server.server_state.tasks}"
        time.sleep(0.02)
    srv.engine.pool.check()


def test_stop_strings_and_n_choices(srv):
    free = srv.client.completions.create(model=NAME, prompt="w9 w8 w7", max_tokens=10,
                                         temperature=0, extra_body={"ignore_eos": True})
    text = free.choices[0].text
    words = text.split()
    stop = words[1][-1] + " " + words[2][:2]                  # across a token boundary
    r = srv.client.completions.create(model=NAME, prompt="w9 w8 w7", max_tokens=10,
                                      temperature=0, stop=["qq", stop],
                                      extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert c.finish_reason == "stop" and c.text == text[:text.index(stop)]
    assert c.model_extra["stop_reason"] == stop
    r = srv.client.completions.create(model=NAME, prompt="w9 w8 w7", max_tokens=8, n=3,
                                      temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    texts = [c.text for c in r.choices]
    assert [c.index for c in r.choices] == [0, 1, 2] and len(set(texts)) > 1
    again = srv.client.completions.create(model=NAME, prompt="w9 w8 w7", max_tokens=8, n=3,
                                          temperature=1.0, seed=7,
                                          extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == texts                 # seeded
    s = srv.client.completions.create(model=NAME, prompt="w9 w8 w7", max_tokens=8, n=3,
                                      temperature=1.0, seed=7, stream=True,
                                      extra_body={"ignore_eos": True})
    parts = ["", "", ""]
    for ch in s:
        for c in ch.choices:
            parts[c.index] += c.text
    assert parts == texts
    assert srv.idle()


def test_prefix_hits_and_metrics(srv):
    p = _prompt(70, 3)
    first = srv.client.completions.create(model=NAME, prompt=p, max_tokens=4, temperature=0)
    second = srv.client.completions.create(model=NAME, prompt=p, max_tokens=4, temperature=0)
    assert first.choices[0].text == second.choices[0].text
    assert second.usage.prompt_tokens_details.cached_tokens == 64    # 4 whole pages of 16
    status, body, _ = srv.request("GET", "/metrics")
    assert status == 200
    metrics = {line.split()[0]: float(line.split()[1]) for line in body.splitlines()
               if line and not line.startswith("#")}
    assert metrics["fusedist_prefix_cache_hits_tokens_total"] >= 64
    assert 0 < metrics["fusedist_prefix_cache_hit_rate"] < 1
    assert metrics["fusedist_kv_pages_total"] == 48
    assert metrics['fusedist_requests_finished_total{reason="length"}'] >= 2
    assert metrics["fusedist_time_to_first_token_seconds_count"] >= 2


def test_chat_with_logprobs(srv):
    msgs = [{"role": "system", "content": "w1 w2"}, {"role": "user", "content": "w7 w8"}]
    r = srv.client.chat.completions.create(model=NAME, messages=msgs, max_tokens=5,
                                           temperature=0, logprobs=True, top_logprobs=2,
                                           extra_body={"ignore_eos": True,
                                                       "return_token_ids": True})
    c = r.choices[0]
    assert c.message.role == "assistant" and c.finish_reason == "length"
    lp = c.logprobs.content
    assert len(lp) == 5 and all(len(t.top_logprobs) == 2 for t in lp)
    assert all(t.top_logprobs[0].logprob >= t.logprob - 1e-6 for t in lp)   # greedy: the top
    s = srv.client.chat.completions.create(model=NAME, messages=msgs, max_tokens=5,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
    chunks = list(s)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == c.message.content


@pytest.mark.parametrize("body,field", [
    ({"model": NAME, "prompt": "w1", "bogus": 1}, "bogus"),
    ({"model": NAME, "prompt": "w1", "max_tokens": -3}, "max_tokens"),
    ({"model": NAME, "prompt": "w1", "max_tokens": 100000}, "max_tokens"),
    ({"model": NAME, "prompt": "w1", "temperature": "hot"}, "temperature"),
    ({"model": NAME, "prompt": "w1", "top_p": 1.5}, "top_p"),
    ({"model": NAME, "prompt": "w1", "n": 0}, "n"),
    ({"model": NAME, "prompt": "w1", "logprobs": 99}, "logprobs"),
    ({"model": NAME, "prompt": ""}, "prompt"),
    ({"model": NAME, "prompt": [1, 2, 100000]}, "prompt"),
    ({"model": NAME, "prompt": [5] * 200}, "prompt"),
    ({"model": NAME, "prompt": "w1", "echo": True}, "echo"),
    ({"model": NAME, "prompt": "w1", "stop": [""]}, "stop"),
    ({"model": NAME}, "prompt"),
    ({"model": NAME, "messages": []}, "messages"),
    ({"model": NAME, "messages": [{"role": "wizard", "content": "w1"}]}, "messages[0].role"),
    ({"model": NAME, "messages": [{"role": "user", "content": "w1"}], "top_logprobs": 2},
     "top_logprobs"),
])
def test_bad_requests_get_400_naming_the_field(srv, body, field):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    status, text, _ = srv.request("POST", path, body)
    err = json.loads(text)["error"]
    assert status == 400 and err["param"] == field, (status, err)
    assert err["type"] == "invalid_request_error" and err["message"]


def test_bad_json_and_unknown_model(srv):
    status, text, _ = srv.request("POST", "/v1/completions", raw=b'{"model": ')
    assert status == 400 and json.loads(text)["error"]["param"] == "body"
    status, text, _ = srv.request("POST", "/v1/completions", {"model": "gpt-9", "prompt": "w1"})
    assert status == 404 and json.loads(text)["error"]["param"] == "model"
    with pytest.raises(openai.BadRequestError):
        srv.client.completions.create(model=NAME, prompt="w1", max_tokens=-1)
    assert srv.request("GET", "/health")[0] == 200        # nothing stopped the server


def test_a_full_queue_answers_503(llm):
    s = Server(llm, max_seqs=1, max_num_batched_tokens=16, num_pages=24, max_waiting=1)
    try:
        long = {"model": NAME, "prompt": "w5 w6", "max_tokens": 120, "temperature": 0,
                "ignore_eos": True, "stream": True}
        c1 = http.client.HTTPConnection("127.0.0.1", s.port, timeout=60)
        c1.request("POST", "/v1/completions", json.dumps(long),
                   {"Content-Type": "application/json"})
        r1 = c1.getresponse()
        assert r1.readline().startswith(b"data: ")        # admitted: the only seat
        c2 = http.client.HTTPConnection("127.0.0.1", s.port, timeout=60)
        c2.request("POST", "/v1/completions", json.dumps(long),
                   {"Content-Type": "application/json"})
        r2 = c2.getresponse()                                  # queued (headers come first)
        status, text, headers = s.request("POST", "/v1/completions",
                                          {"model": NAME, "prompt": "w1", "max_tokens": 2})
        assert status == 503 and headers.get("retry-after") == "1", (status, text)
        assert json.loads(text)["error"]["type"] == "server_overloaded"
        # the admitted and the queued request both finish
        body1, body2 = r1.read().decode(), r2.read().decode()
        assert body1.rstrip().endswith("data: [DONE]") and body2.rstrip().endswith("[DONE]")
        c1.close()
        c2.close()
        status, text, _ = s.request("GET", "/metrics")
        assert 'fusedist_requests_rejected_total{code="503"} 1' in text
        assert s.idle()
    finally:
        s.close()


@pytest.mark.timeout(240)
def test_cli_serves_and_shuts_down_gracefully(ckpt):
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    p = subprocess.Popen([sys.executable, "-P", "-m", "fusedist.serve", ckpt, "--port", "0",
                          "--served-model-name", NAME, "--max-seqs", "2", "--log-level",
                          "warning", "--overlap"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    try:
        url = None
        lines = []
        for line in p.stdout:
            lines.append(line)
            if " on http://" in line:
                url = line.split(" on ")[-1].strip()
                break
        assert url, "".join(lines)
        client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=5)
        r = client.completions.create(model=NAME, prompt="w3 w4", max_tokens=3, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].finish_reason == "length" and len(r.choices[0].text.split()) == 3
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, "".join(lines) + out
        assert "shutting down" in out
    finally:
        if p.poll() is None:
            p.kill()


def test_cli_overlap_flags():
    """--overlap / --no-overlap set the engine's overlap; neither leaves it to the device."""
    from fusedist.serve.__main__ import parse_args
    base = ["--config", "tiny", "--random-weights"]
    assert parse_args(base).overlap is None
    assert parse_args(base + ["--overlap"]).overlap is True
    assert parse_args(base + ["--no-overlap"]).overlap is False
    with pytest.raises(SystemExit):
        parse_args(base + ["--overlap", "--no-overlap"])
