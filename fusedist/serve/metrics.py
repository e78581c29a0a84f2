"""The Prometheus text exposition (format 0.0.4) of an engine's state and counters: what
/metrics serves. No client library: the format is a few lines per metric."""

from __future__ import annotations


def _histogram(lines: list, name: str, help_: str, h) -> None:
    lines += [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
    cum = 0
    for bound, count in zip(h.bounds, h.counts):
        cum += count
        lines.append(f'{name}_bucket{{le="{bound}"}} {cum}')
    lines.append(f'{name}_bucket{{le="+Inf"}} {h.count}')
    lines.append(f"{name}_sum {h.sum}")
    lines.append(f"{name}_count {h.count}")


def render(engine, server: dict) -> str:
    """engine: fusedist.models.Engine; server: the server's own counters (rejected requests
    by status code)."""
    s, pool = engine.stats, engine.pool
    lines: list = []

    def one(name, kind, help_, value, labels=""):
        lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}",
                      f"{name}{labels} {value}"])

    one("fusedist_requests_running", "gauge", "Sequences being decoded or prefilled.",
        engine.num_running)
    one("fusedist_requests_waiting", "gauge", "Sequences waiting for admission.",
        engine.num_waiting)
    one("fusedist_kv_pages_total", "gauge", "KV cache pages of the scheduler's pool.",
        pool.total)
    one("fusedist_kv_pages_free", "gauge", "KV pages free or cached and evictable.",
        pool.num_free)
    one("fusedist_kv_pages_cached", "gauge", "KV pages findable by the prefix cache.",
        pool.num_cached)
    one("fusedist_prefix_cache_hit_rate", "gauge",
        "Prompt tokens found in the prefix cache over prompt tokens looked up.", pool.hit_rate)
    one("fusedist_prefix_cache_queries_tokens_total", "counter",
        "Prompt tokens looked up in the prefix cache.", pool.query_tokens)
    one("fusedist_prefix_cache_hits_tokens_total", "counter",
        "Prompt tokens found in the prefix cache.", pool.hit_tokens)
    one("fusedist_prompt_tokens_total", "counter", "Prompt tokens of admitted requests.",
        s.prompt_tokens)
    one("fusedist_generation_tokens_total", "counter", "Generated tokens.",
        s.generation_tokens)
    one("fusedist_preemptions_total", "counter",
        "Sequences preempted (pages released, recomputed later).", s.preemptions)
    one("fusedist_steps_total", "counter", "Engine steps (forwards).", s.steps)
    one("fusedist_decode_steps_total", "counter", "Steps that were decode only.",
        s.decode_steps)
    lines += ["# HELP fusedist_requests_finished_total Requests finished, by finish reason.",
              "# TYPE fusedist_requests_finished_total counter"]
    finished = dict(s.finished)          # the stepping thread may add a reason meanwhile
    for reason in sorted(set(finished) | {"stop", "length", "abort"}):
        lines.append(f'fusedist_requests_finished_total{{reason="{reason}"}} '
                     f'{finished.get(reason, 0)}')
    lines += ["# HELP fusedist_requests_rejected_total Requests refused, by HTTP status.",
              "# TYPE fusedist_requests_rejected_total counter"]
    for code in sorted(set(server.get("rejected", {})) | {400, 503}):
        lines.append(f'fusedist_requests_rejected_total{{code="{code}"}} '
                     f'{server.get("rejected", {}).get(code, 0)}')
    _histogram(lines, "fusedist_time_to_first_token_seconds",
               "Arrival to first generated token.", s.ttft)
    _histogram(lines, "fusedist_inter_token_latency_seconds",
               "Between consecutive tokens of a choice.", s.itl)
    _histogram(lines, "fusedist_e2e_request_latency_seconds", "Arrival to the last token.",
               s.e2e)
    return "\n".join(lines) + "\n"
