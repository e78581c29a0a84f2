"""The FastAPI application: OpenAI's /v1/completions and /v1/chat/completions (server-sent
events when stream is true), /v1/models, /health and Prometheus /metrics, over an AsyncEngine.

Each prompt of a request (and each of its n choices) is a request of the engine; a request body
is checked whole before any of them is queued. Errors come back in OpenAI's shape,
{"error": {"message", "type", "param", "code"}}: 400 for bad JSON, an unknown field, a wrong
type or a value out of range (param names the field), 404 for another model's name, 503 when
the engine's queue of requests not yet admitted is full (Retry-After: 1) or the engine has
stopped. A client that disconnects (a stream closed early, a non-streaming call given up) has
its requests aborted: a task watches the connection while the request runs.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from ..models.async_engine import AsyncEngine, EngineDeadError
from ..models.sampler import ParamError
from ..models.scheduler import QueueFull, RequestOutput
from . import metrics
from .protocol import ChatCompletionRequest, CompletionRequest


def _error(status: int, message: str, param: Optional[str] = None,
           kind: str = "invalid_request_error", headers: Optional[dict] = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": None}}, status_code=status, headers=headers)


def _field(loc) -> str:
    parts = [str(p) for p in loc if p != "body"]
    # a union's members show up as type names in the location: keep the field path
    out = []
    for p in parts:
        if p.isdigit() or p.startswith(("str", "int", "float", "bool", "list[", "dict[",
                                        "function-", "literal[")):
            if p.isdigit():
                out.append(f"[{p}]")
            continue
        out.append(("." if out else "") + p)
    return "".join(out) or "body"


def build_app(engine: AsyncEngine, model_name: str, *, disconnect_poll_s: float = 0.2) -> FastAPI:
    """The application over a started AsyncEngine, serving it as model `model_name`."""
    app = FastAPI(title="fusedist", docs_url=None, redoc_url=None)
    eng = engine.engine
    tok = eng.tokenizer
    served = {"rejected": {}}
    app.state.engine = engine
    app.state.counters = served

    def reject(resp: JSONResponse) -> JSONResponse:
        served["rejected"][resp.status_code] = served["rejected"].get(resp.status_code, 0) + 1
        return resp

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        e = errs[0] if errs else {"loc": (), "msg": "invalid request", "type": ""}
        if e.get("type") == "json_invalid":
            return reject(_error(400, f"the body is not valid JSON: {e.get('msg')}", "body"))
        field = _field(e.get("loc", ()))
        same = [x for x in errs if _field(x.get("loc", ())) == field]
        if e.get("type") == "extra_forbidden":
            msg = f"{field} is not a field of this endpoint"
        elif len(same) > 1:             # the members of a union each refused it
            msg = f"{field}: {e.get('input')!r:.80} is not of a type this field takes"
        else:
            msg = f"{field}: {e.get('msg', 'invalid')}"
        return reject(_error(400, msg, field))

    @app.get("/health")
    async def health():
        if engine.error is not None or not engine.running:
            return JSONResponse({"status": "stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "created": 0, "owned_by": "fusedist",
                                            "max_model_len": eng.max_model_len}]}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(eng, served),
                                 media_type="text/plain; version=0.0.4")

    def token_text(i: int) -> str:
        if tok is None:
            return f"<{i}>"
        impl = getattr(tok, "impl", tok)
        return impl.decode([int(i)], skip_special_tokens=False)

    def params_of(body, prompt_len: int, logprobs: Optional[int]):
        bad = body.unsupported()
        if bad is not None:
            raise ParamError(*bad)
        max_tokens = body.max_tokens
        if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
            max_tokens = body.max_completion_tokens
        if max_tokens is None:
            max_tokens = min(eng.default_params(prompt_len).max_tokens,
                             max(1, eng.max_model_len - prompt_len))
        top_k = body.top_k if body.top_k is None or body.top_k >= 0 else 0   # -1: off
        return eng.default_params(
            prompt_len, max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
            top_k=top_k, min_p=body.min_p, repetition_penalty=body.repetition_penalty,
            presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
            seed=body.seed, n=body.n, logprobs=logprobs,
            stop=tuple([body.stop] if isinstance(body.stop, str) else body.stop or ()),
            stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos,
            min_tokens=body.min_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens)

    def prompts_of(body) -> list:
        if isinstance(body, ChatCompletionRequest):
            if tok is None or not tok.has_chat_template:
                raise ParamError("messages", "this model has no chat template; use "
                                             "/v1/completions")
            msgs = [{"role": m.role, "content": m.text()} for m in body.messages]
            return [tok.chat(msgs, body.add_generation_prompt)]
        p = body.prompt
        items = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
        if not items:
            raise ParamError("prompt", "prompt is empty")
        out = []
        for i, x in enumerate(items):
            if isinstance(x, str):
                if tok is None:
                    raise ParamError("prompt", "this model has no tokenizer; send token ids")
                if not x:
                    raise ParamError("prompt", "prompt is an empty string")
                x = tok.encode(x)
            out.append(list(x))
        return out

    async def watch(request: Request, rids: list) -> None:
        """Abort the requests once the client has gone."""
        while True:
            await asyncio.sleep(disconnect_poll_s)
            if await request.is_disconnected():
                for rid in rids:
                    engine.abort(rid)
                return

    async def submit(request: Request, body, chat: bool):
        if body.model != model_name:
            return reject(_error(404, f"the model `{body.model}` does not exist; this server "
                                      f"serves `{model_name}`", "model", "not_found_error"))
        try:
            prompts = prompts_of(body)
            if chat:
                lp = (body.top_logprobs or 0) if body.logprobs else None
            else:
                lp = body.logprobs
            params = [params_of(body, len(p), lp) for p in prompts]
            for p, sp in zip(prompts, params):
                eng.check_request(p, sp)
        except ParamError as e:
            param = e.param
            if chat and param == "logprobs":
                param = "top_logprobs"
            if chat and param == "prompt":
                param = "messages"
            return reject(_error(400, str(e), param))
        base = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        q: asyncio.Queue = asyncio.Queue()
        rids = []
        try:
            for i, (p, sp) in enumerate(zip(prompts, params)):
                rid, _ = engine.add(p, sp, f"{base}-{i}", queue=q)
                rids.append(rid)
        except (QueueFull, EngineDeadError, ParamError, RuntimeError) as e:
            for rid in rids:
                engine.abort(rid)
            if isinstance(e, ParamError):
                return reject(_error(400, str(e), e.param))
            kind = "server_overloaded" if isinstance(e, QueueFull) else "server_error"
            return reject(_error(503, str(e), None, kind, {"Retry-After": "1"}))
        ctx = _Ctx(base, model_name, chat, prompts, params, rids, body, token_text)
        if body.stream:
            return StreamingResponse(stream_body(request, ctx, q), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        watcher = asyncio.create_task(watch(request, rids))
        collector = asyncio.create_task(collect(ctx, q))
        try:
            # An aborted request sends nothing more to its queue: when the client goes first,
            # stop collecting (else this handler would wait for ever).
            await asyncio.wait({watcher, collector}, return_when=asyncio.FIRST_COMPLETED)
            if not collector.done():
                collector.cancel()
                return Response(status_code=499)    # nobody is there to read it
            results = collector.result()
        except EngineDeadError as e:
            return reject(_error(503, str(e), None, "server_error"))
        finally:
            watcher.cancel()
            collector.cancel()
            for rid in ctx.pending:
                engine.abort(rid)
        return JSONResponse(ctx.response(results))

    async def collect(ctx, q) -> dict:
        results: dict = {}
        while ctx.pending:
            out = await q.get()
            if isinstance(out, BaseException):
                raise out
            if out.request_id in results:
                results[out.request_id].merge(out)
            else:
                results[out.request_id] = out
            if out.finished:
                ctx.pending.discard(out.request_id)
        return results

    async def stream_body(request: Request, ctx, q):
        watcher = asyncio.create_task(watch(request, ctx.rids))
        try:
            if ctx.chat:
                for i in range(len(ctx.prompts) * ctx.n):
                    yield _sse(ctx.chunk(i, {"role": "assistant", "content": ""}, None, None))
            while ctx.pending:
                out = await q.get()
                if isinstance(out, BaseException):
                    yield _sse({"error": {"message": str(out), "type": "server_error",
                                          "param": None, "code": None}})
                    return
                ctx.count(out)
                for c in out.choices:
                    idx = ctx.index(out.request_id, c.index)
                    if not c.ids and not c.text and c.finish_reason is None:
                        continue
                    yield _sse(ctx.choice_chunk(idx, c))
                if out.finished:
                    ctx.pending.discard(out.request_id)
            if ctx.body.stream_options is not None and ctx.body.stream_options.include_usage:
                yield _sse(ctx.usage_chunk())
            yield "data: [DONE]\n\n"
        finally:
            watcher.cancel()
            for rid in ctx.pending:
                engine.abort(rid)

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest):
        return await submit(request, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatCompletionRequest):
        return await submit(request, body, chat=True)

    return app


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class _Ctx:
    """One HTTP request's engine requests and how their outputs become OpenAI's JSON."""

    def __init__(self, base, model, chat, prompts, params, rids, body, token_text):
        self.id, self.model, self.chat = base, model, chat
        self.prompts, self.params, self.rids, self.body = prompts, params, rids, body
        self.n = params[0].n
        self.pending = set(rids)
        self.created = int(time.time())
        self.token_text = token_text
        self.sub = {rid: i for i, rid in enumerate(rids)}
        self.completion_tokens = 0
        self.cached = {}

    def index(self, rid: str, choice: int) -> int:
        return self.sub[rid] * self.n + choice

    def count(self, out: RequestOutput) -> None:
        self.completion_tokens += sum(len(c.ids) for c in out.choices)
        self.cached[out.request_id] = out.cached_tokens

    def usage(self) -> dict:
        prompt = sum(len(p) for p in self.prompts)
        return {"prompt_tokens": prompt, "completion_tokens": self.completion_tokens,
                "total_tokens": prompt + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached.values())}}

    # ---- logprobs ------------------------------------------------------------------------
    def _logprobs(self, ids, lps) -> Optional[dict]:
        if lps is None:
            return None
        if self.chat:
            content = []
            for t, (lp, top) in zip(ids, lps):
                s = self.token_text(t)
                content.append({"token": s, "logprob": lp, "bytes": list(s.encode()),
                                "top_logprobs": [{"token": self.token_text(i), "logprob": v,
                                                  "bytes": list(self.token_text(i).encode())}
                                                 for i, v in top]})
            return {"content": content}
        tokens = [self.token_text(t) for t in ids]
        return {"tokens": tokens, "token_logprobs": [lp for lp, _ in lps],
                "top_logprobs": [{self.token_text(i): v for i, v in top} for _, top in lps],
                "text_offset": []}

    def _choice(self, idx: int, c) -> dict:
        d = {"index": idx, "logprobs": self._logprobs(c.ids, c.logprobs),
             "finish_reason": c.finish_reason,
             "stop_reason": c.stop_reason}
        if self.body.return_token_ids:
            d["token_ids"] = list(c.ids)
        return d

    # ---- whole responses -------------------------------------------------------------------
    def response(self, results: dict) -> dict:
        choices = []
        for rid in self.rids:
            out = results[rid]
            self.count(out)
            for c in out.choices:
                d = self._choice(self.index(rid, c.index), c)
                if self.chat:
                    d["message"] = {"role": "assistant", "content": c.text}
                else:
                    d["text"] = c.text
                choices.append(d)
        choices.sort(key=lambda d: d["index"])
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices,
                "usage": self.usage()}

    # ---- stream chunks ---------------------------------------------------------------------
    def chunk(self, idx: int, delta, finish, logprobs, extra: Optional[dict] = None) -> dict:
        if self.chat:
            ch = {"index": idx, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            ch = {"index": idx, "text": delta, "logprobs": logprobs, "finish_reason": finish}
        if extra:
            ch.update(extra)
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else
                "text_completion", "created": self.created, "model": self.model,
                "choices": [ch]}

    def choice_chunk(self, idx: int, c) -> dict:
        d = self._choice(idx, c)
        extra = {"stop_reason": d["stop_reason"]}
        if "token_ids" in d:
            extra["token_ids"] = d["token_ids"]
        delta = {"content": c.text} if self.chat else c.text
        if self.chat and not c.text and c.finish_reason is not None:
            delta = {}
        return self.chunk(idx, delta, d["finish_reason"], d["logprobs"], extra)

    def usage_chunk(self) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else
                "text_completion", "created": self.created, "model": self.model,
                "choices": [], "usage": self.usage()}
