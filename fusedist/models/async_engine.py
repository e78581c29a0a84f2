"""AsyncEngine: an Engine stepped by a background thread, with `async for` streams.

    engine = AsyncEngine(Engine.from_llm(llm, max_seqs=32)).start()
    async for out in engine.stream("The capital of France is", GenerationParams(max_tokens=16)):
        print(out.choices[0].text, end="", flush=True)       # deltas; out.finished at the end
    result = await engine.generate(ids, params)              # every choice's ids and text
    engine.shutdown()

The stepping thread applies the requests queued since the last step (add / abort), runs one
step and hands each output to the event loop that awaits it; when there is nothing to do it
sleeps until a request arrives. A stream that is closed before its request finished (a client
that went away, `break` out of the `async for`) aborts the request: its pages are released at
the next step.

Tensor parallelism: every rank builds the same Engine and an AsyncEngine over it. The leader
(rank 0 of the model's tensor-parallel group) takes the requests and runs the stepping thread;
before each step it broadcasts the events it applies (the requests with their seeds, aborts,
the stop) over the group, and the other ranks run follow(), which applies the same events and
runs the same step. The scheduler's decisions depend only on those events, so every rank
schedules, samples and stops alike; only the leader hands outputs out. While idle the leader
broadcasts an empty event list every heartbeat_s, so the followers' collective never waits
longer than that.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from typing import AsyncIterator, Optional, Sequence, Union

import torch

from .sampler import GenerationParams
from .scheduler import Engine, RequestOutput


class EngineDeadError(RuntimeError):
    """The stepping thread stopped on an error; the engine takes no more requests."""


class AsyncEngine:
    def __init__(self, engine: Engine, *, heartbeat_s: float = 1.0):
        if not isinstance(engine, Engine):
            raise TypeError(f"AsyncEngine: engine must be a fusedist.models.Engine, got "
                            f"{type(engine).__name__}")
        self.engine = engine
        group = engine.runner._tp_group()
        self.group = group if group is not None and group.size > 1 else None
        self.leader = self.group is None or self.group.rank == 0
        self.heartbeat_s = heartbeat_s
        self.error: Optional[BaseException] = None
        self._streams: dict = {}            # request id -> (event loop, asyncio.Queue)
        self._wake = threading.Event()
        self._stop = False
        self._stopped = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # ---- the stepping thread (leader) ----------------------------------------------------
    def start(self) -> "AsyncEngine":
        if not self.leader:
            raise RuntimeError("AsyncEngine.start: this rank follows the leader; call "
                               "follow() here (rank 0 of the tensor-parallel group leads)")
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="fusedist-engine",
                                            daemon=True)
            self._thread.start()
        return self

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        eng = self.engine
        if eng.device.type == "cuda":
            torch.cuda.set_device(eng.device)
        try:
            while True:
                if not eng.has_work() and not self._stop:
                    self._wake.wait(self.heartbeat_s)
                    self._wake.clear()
                events = eng.take_events()
                stop = self._stop
                if stop:
                    events.append(("stop",))
                if self.group is not None:
                    events = self._broadcast(events)
                outs = eng.apply([e for e in events if e[0] != "stop"])
                if stop:
                    outs += eng.apply([("abort", rid) for rid in list(eng.requests)])
                    self._deliver(outs)
                    return
                if eng.running or eng.waiting:
                    outs += eng.run_step()
                self._deliver(outs)
        except BaseException as e:  # noqa: BLE001 - every waiting stream gets it
            self.error = e
            for rid in list(self._streams):
                self._put(rid, EngineDeadError(f"fusedist engine stopped: "
                                               f"{type(e).__name__}: {e}"))
        finally:
            self._stopped.set()

    def follow(self) -> None:
        """The other ranks' loop: apply the leader's events and run the same steps, until the
        leader stops."""
        if self.leader:
            raise RuntimeError("AsyncEngine.follow: this rank leads; call start() here")
        eng = self.engine
        while True:
            events = self._broadcast(None)
            eng.apply([e for e in events if e[0] != "stop"])
            if any(e[0] == "stop" for e in events):
                eng.apply([("abort", rid) for rid in list(eng.requests)])
                return
            if eng.running or eng.waiting:
                eng.run_step()

    def _broadcast(self, events: Optional[list]) -> list:
        box = [events]
        dev = self.group.device if self.group.device.type == "cuda" else None
        torch.distributed.broadcast_object_list(box, src=self.group.ranks[0],
                                                group=self.group.pg, device=dev)
        return box[0]

    def _deliver(self, outs: Sequence[RequestOutput]) -> None:
        for out in outs:
            self._put(out.request_id, out)
            if out.finished:
                self._streams.pop(out.request_id, None)

    def _put(self, rid: str, item) -> None:
        entry = self._streams.get(rid)
        if entry is None:
            return
        loop, q = entry
        try:
            loop.call_soon_threadsafe(q.put_nowait, item)
        except RuntimeError:                # the loop is closed: nobody awaits it
            self._streams.pop(rid, None)

    # ---- requests ------------------------------------------------------------------------
    def encode(self, prompt: Union[str, Sequence[int]]) -> list:
        if isinstance(prompt, str):
            if self.engine.tokenizer is None:
                from .sampler import ParamError
                raise ParamError("prompt", "this model has no tokenizer; send token ids")
            return self.engine.tokenizer.encode(prompt)
        return list(prompt)

    def add(self, prompt: Union[str, Sequence[int]], params: Optional[GenerationParams] = None,
            request_id: Optional[str] = None, queue: Optional[asyncio.Queue] = None) -> tuple:
        """Queue a request now (ParamError / QueueFull raised here); returns (request id, the
        asyncio.Queue its outputs go to: `queue`, which several requests may share, or a new
        one). stream() is the usual way in."""
        if self.error is not None:
            raise EngineDeadError(f"fusedist engine stopped: {self.error}")
        if self._stop:
            raise EngineDeadError("fusedist engine is shutting down")
        if not self.running:
            raise RuntimeError("AsyncEngine: start() it first")
        ids = self.encode(prompt)
        rid = request_id if request_id is not None else uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue() if queue is None else queue
        if rid in self._streams:
            from .sampler import ParamError
            raise ParamError("request_id", f"request {rid!r} is already in the engine")
        self._streams[rid] = (loop, q)      # before it is queued: no output is missed
        try:
            self.engine.add_request(rid, ids, params)
        except BaseException:
            self._streams.pop(rid, None)
            raise
        self._wake.set()
        return rid, q

    async def stream(self, prompt: Union[str, Sequence[int]],
                     params: Optional[GenerationParams] = None,
                     request_id: Optional[str] = None) -> AsyncIterator[RequestOutput]:
        """The request's RequestOutputs as it decodes (each with the choices' new ids and
        text; the last has finished=True). Closing the stream early aborts the request."""
        rid, q = self.add(prompt, params, request_id)
        async for out in self.outputs(rid, q):
            yield out

    async def outputs(self, rid: str, q: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        """The outputs of a request queued by add(); closing it early aborts the request."""
        finished = False
        try:
            while True:
                out = await q.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished:
                self.abort(rid)

    async def generate(self, prompt: Union[str, Sequence[int]],
                       params: Optional[GenerationParams] = None,
                       request_id: Optional[str] = None) -> RequestOutput:
        """The whole request: every choice's ids, text (and logprobs)."""
        result = None
        async for out in self.stream(prompt, params, request_id):
            if result is None:
                result = out
            else:
                result.merge(out)
        return result

    def abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self.engine.abort(request_id)
        self._wake.set()

    # ---- shutdown ------------------------------------------------------------------------
    def shutdown(self, timeout_s: float = 0.0) -> None:
        """Stop: wait up to timeout_s for the requests in flight to finish, abort the rest,
        stop the stepping thread (and, at TP > 1, the followers)."""
        if self._thread is None:
            return
        if timeout_s > 0 and self.error is None:
            import time
            end = time.monotonic() + timeout_s
            while self.engine.has_work() and time.monotonic() < end and self.running:
                time.sleep(0.01)
        self._stop = True
        self._wake.set()
        self._thread.join()
        self._thread = None


__all__ = ["AsyncEngine", "EngineDeadError"]
