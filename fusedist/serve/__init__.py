"""fusedist.serve: an OpenAI-compatible HTTP server over the continuous-batching engine.

    python -m fusedist.serve /ckpt/Qwen2.5-0.5B-Instruct --port 8000 --max-seqs 32
    torchrun --nproc-per-node 8 -m fusedist.serve /ckpt/Llama-3.1-70B-Instruct

Endpoints: /v1/completions, /v1/chat/completions (server-sent events with "stream": true),
/v1/models, /health, /metrics (Prometheus). Under torchrun rank 0 serves HTTP and the other
ranks of its tensor-parallel group follow its steps (fusedist.models.async_engine). Needs the
serve extra: pip install 'fusedist[serve]' (FastAPI, uvicorn). docs/design/serving.md says how
it works."""

from .app import build_app

__all__ = ["build_app"]
