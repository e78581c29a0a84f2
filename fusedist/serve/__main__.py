"""python -m fusedist.serve MODEL [options]: load the model on every rank, then rank 0 serves
HTTP (uvicorn) while the other ranks follow its engine steps. SIGINT / SIGTERM shut it down
gracefully: no new connections, requests in flight get --shutdown-timeout seconds to finish,
the rest are aborted, every rank exits."""

from __future__ import annotations

import argparse
import socket
import sys

import torch


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m fusedist.serve",
                                description="OpenAI-compatible server over fusedist's "
                                            "continuous-batching engine")
    p.add_argument("model", nargs="?", help="a Hugging Face checkpoint directory")
    p.add_argument("--config", help="a shipped shape (with --random-weights) instead of MODEL")
    p.add_argument("--random-weights", action="store_true")
    p.add_argument("--served-model-name", help="the name clients ask for (default: the "
                                               "directory's name or the config's)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: any free port (printed)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantize", default="none", help="fp8, fp8-tensor, fp8-block: FP8 "
                                                      "projection weights quantized at load")
    p.add_argument("--kv-dtype", default="auto", choices=("auto", "fp8"))
    p.add_argument("--tp-size", type=int, default=None)
    p.add_argument("--max-seqs", type=int, default=32, help="sequences decoded together")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + new tokens of a sequence (default: the model's, <= 4096)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="token budget of a step (prefill chunks + decodes)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--kv-budget-gb", type=float, default=None, help="KV cache size")
    p.add_argument("--num-pages", type=int, default=None, help="KV pages of the pool")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--max-queue", type=int, default=256,
                   help="requests waiting for admission before new ones get 503")
    p.add_argument("--no-cuda-graphs", action="store_true")
    ov = p.add_mutually_exclusive_group()
    ov.add_argument("--overlap", dest="overlap", action="store_true", default=None,
                    help="launch each decode step before the previous one's tokens reach the "
                         "host (the engine's host work overlaps the GPU; docs/design/serving.md); "
                         "the default on GPUs")
    ov.add_argument("--no-overlap", dest="overlap", action="store_false",
                    help="wait for each step's tokens before launching the next")
    p.add_argument("--prefill-graph-tokens", type=int, default=None)
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds requests in flight get to finish at shutdown")
    p.add_argument("--log-level", default="info")
    a = p.parse_args(argv)
    if (a.model is None) == (a.config is None):
        p.error("give MODEL (a checkpoint directory) or --config NAME --random-weights")
    return a


def _server_class(uvicorn):
    """uvicorn.Server whose SIGINT / SIGTERM start its graceful shutdown and are not raised
    again afterwards (uvicorn re-raises them, which would end the process before the engine
    and the other ranks are shut down)."""
    import contextlib
    import signal

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            old = {s: signal.signal(s, self.handle_exit)
                   for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, h in old.items():
                    signal.signal(s, h)

    return Server


def main(argv=None) -> int:
    args = parse_args(argv)
    import os

    from ..distributed import runtime
    from ..models import LLM
    from ..models.async_engine import AsyncEngine
    from ..models.runner import PREFILL_GRAPH_TOKENS
    from ..models.scheduler import Engine

    kv = torch.float8_e4m3fn if args.kv_dtype == "fp8" else None
    # The LLM's own runner (LLM.generate) is kept minimal: the engine has its own cache.
    llm = LLM(args.model, config=args.config, random_weights=args.random_weights,
              dtype=args.dtype, tp_size=args.tp_size, max_batch=1,
              max_seq_len=args.max_model_len, cuda_graphs=False, quantize=args.quantize,
              prefill_graph_tokens=0)
    rt = runtime.get_runtime()
    leader = rt.tp.rank == 0
    say = (lambda *a: print("fusedist.serve:", *a, flush=True)) if leader else \
        (lambda *a: None)
    name = args.served_model_name or (os.path.basename(os.path.normpath(args.model))
                                      if args.model else args.config)
    engine = Engine.from_llm(
        llm, max_seqs=args.max_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        page_size=args.page_size, num_pages=args.num_pages,
        kv_budget_bytes=None if args.kv_budget_gb is None else int(args.kv_budget_gb * 2**30),
        prefix_caching=not args.no_prefix_caching, max_waiting=args.max_queue,
        cuda_graphs=False if args.no_cuda_graphs else None,
        prefill_graph_tokens=PREFILL_GRAPH_TOKENS if args.prefill_graph_tokens is None
        else args.prefill_graph_tokens, kv_dtype=kv, overlap=args.overlap)
    ae = AsyncEngine(engine)
    try:
        if not ae.leader:
            ae.follow()
            return 0
        import uvicorn

        from .app import build_app

        ae.start()
        app = build_app(ae, name)
        sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((args.host, args.port))
        host, port = sock.getsockname()[:2]
        config = uvicorn.Config(app, log_level=args.log_level,
                                timeout_graceful_shutdown=max(1, int(args.shutdown_timeout)))
        server = _server_class(uvicorn)(config)
        say(f"serving {name} (tp {rt.tp.size}, {engine.max_seqs} "
            f"sequences, {engine.pool.total} KV pages of {engine.page_size}, max_model_len "
            f"{engine.max_model_len}) on http://{host}:{port}")
        server.run(sockets=[sock])
        say("shutting down")
        ae.shutdown(args.shutdown_timeout)
        return 0
    finally:
        if ae.leader and ae.running:
            ae.shutdown()
        engine.close()
        llm.close()


if __name__ == "__main__":
    sys.exit(main())
