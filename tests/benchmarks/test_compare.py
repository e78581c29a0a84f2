"""benchmarks/compare.py: the result schema (key, value, direction, noise) read from every
committed result file, a synthetic regression of every metric caught, same-run ratios, the
noise band, the row forms, directory pairing and the exit status."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("fusedist_bench_compare",
                                               ROOT / "benchmarks" / "compare.py")
compare = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compare)


def ar_doc(fd_us: float, nccl_us: float, scale: float = 1.0, rounds=None, nbytes=4096,
           status="ok") -> dict:
    """An all-reduce result: one row per backend (benchmarks/allreduce.py's form)."""
    rows = []
    for backend, t in (("fd_auto", fd_us), ("fd_one_shot", fd_us * 0.9), ("nccl_torch", nccl_us)):
        row = {"op": "all_reduce", "backend": backend, "bytes": nbytes, "dtype": "torch.bfloat16",
               "world": 2, "time_us": t * scale, "status": status if backend == "fd_auto" else "ok"}
        if rounds is not None:
            row["rounds_us"] = [t * scale * (1 + d) for d in rounds]
        rows.append(row)
    return {"meta": {"world_size": 2}, "rows": rows}


def verdicts(old, new, **kw):
    rows, n = compare.compare(old, new, **kw)
    return {r["case"]: r["verdict"] for r in rows}, n


def test_a_slower_fusedist_path_is_a_regression():
    v, n = verdicts(ar_doc(10.0, 20.0), ar_doc(12.0, 20.0))
    assert n == 1  # fd_auto vs nccl_torch only: fd_one_shot is a diagnostic, not the headline
    assert list(v.values()) == ["regressed"]
    assert "fd_auto vs nccl_torch" in next(iter(v))


def test_a_faster_one_is_an_improvement_and_noise_is_neither():
    assert list(verdicts(ar_doc(10.0, 20.0), ar_doc(8.0, 20.0))[0].values()) == ["improved"]
    assert list(verdicts(ar_doc(10.0, 20.0), ar_doc(10.4, 20.0))[0].values()) == ["same"]


def test_ratios_not_raw_times():
    # Another machine twice as slow for everything: the same-run ratio is unchanged.
    assert list(verdicts(ar_doc(10.0, 20.0), ar_doc(10.0, 20.0, scale=2.0))[0].values()) == ["same"]
    # The baseline got faster while fusedist did not: fusedist's advantage shrank.
    assert list(verdicts(ar_doc(10.0, 20.0), ar_doc(10.0, 15.0))[0].values()) == ["regressed"]


def test_the_band_grows_with_the_rows_own_spread():
    old, new = ar_doc(10.0, 20.0, rounds=[0, 0.1]), ar_doc(11.0, 20.0, rounds=[0, 0.1])
    rows, _ = compare.compare(old, new)
    # Each row's spread is (max - min) / median = 0.1 / 1.05; fusedist's and the baseline's
    # add per file, the two files combine in quadrature: ~0.27 > the 9% drop.
    s = 2 * 0.1 / 1.05
    assert rows[0]["band"] == pytest.approx((s ** 2 + s ** 2) ** 0.5, rel=1e-9)
    assert rows[0]["verdict"] == "same"
    # Quiet rows (spread 0) fall back to the floor, and the same drop is a regression.
    quiet = compare.compare(ar_doc(10.0, 20.0, rounds=[0, 0]), ar_doc(11.0, 20.0, rounds=[0, 0]))[0]
    assert quiet[0]["band"] == compare.NOISE and quiet[0]["verdict"] == "regressed"


def test_rows_without_recorded_rounds_use_the_unspread_band():
    rows, _ = compare.compare(ar_doc(10.0, 20.0), ar_doc(10.0, 20.0))
    assert rows[0]["band"] == compare.NOISE_UNSPREAD
    assert verdicts(ar_doc(10.0, 20.0), ar_doc(11.0, 20.0), noise_unspread=0.2)[0] \
        != verdicts(ar_doc(10.0, 20.0), ar_doc(11.0, 20.0), noise_unspread=0.05)[0]


def test_a_metric_with_noise_on_one_side_only():
    """One file records a metric's noise and the other does not: the band is the larger of
    the recorded noise and the unspread band (never narrower than either file allows)."""
    def doc(noise):
        return {"metrics": [compare.metric("case: fusedist vs torch", 1.0, "higher", noise)]}
    for old, new in ((0.3, None), (None, 0.3)):
        rows, _ = compare.compare(doc(old), doc(new))
        assert rows[0]["band"] == pytest.approx(0.3)
    rows, _ = compare.compare(doc(0.01), doc(None))
    assert rows[0]["band"] == compare.NOISE_UNSPREAD


def prefill_row(fd_eager, fd_graph, cudnn_eager, cudnn_graph, flops=1e9) -> dict:
    """An attention_prefill row: eager and CUDA-graph times of fusedist and cuDNN."""
    tf = {k: flops / (t * 1e-6) / 1e12 for k, t in (("fusedist", fd_eager),
                                                    ("fusedist_graph", fd_graph),
                                                    ("sdpa_cudnn", cudnn_eager),
                                                    ("sdpa_cudnn_graph", cudnn_graph))}
    return {"section": "prefill", "new_tokens": 1024, "context": 1024,
            "fusedist_us": fd_eager, "fusedist_graph_us": fd_graph,
            "sdpa_cudnn_us": cudnn_eager, "sdpa_cudnn_graph_us": cudnn_graph,
            "best_peer": "sdpa_cudnn", "best_peer_graph": "sdpa_cudnn",
            "vs_best": tf["fusedist"] / tf["sdpa_cudnn"],
            "vs_cudnn": tf["fusedist"] / tf["sdpa_cudnn"],
            "vs_best_graph": tf["fusedist_graph"] / tf["sdpa_cudnn_graph"]}


def test_eager_ratios_carry_their_host_share():
    """A row timed eagerly and in CUDA graphs: an eager ratio's noise is the host share of its
    two eager times (1 - graph / eager each, summed), at most HOST_NOISE_MAX, when over the
    unspread band; the graph ratio, and a GPU-bound row's eager ratio, record none. Measured
    on one H100, two runs: cuDNN's eager time 44 -> 54 us at a graph time of 31 -> 31.5 us
    moved the eager ratio 17%, a regression under the plain band; within the host share's."""
    def noise(row):
        return {m["key"].split(": ")[1]: m["noise"] for m in compare.metrics({"rows": [row]})}

    got = noise(prefill_row(86.8, 71.5, 44.1, 30.8))
    share = (1 - 71.5 / 86.8) + (1 - 30.8 / 44.1)        # 0.18 + 0.30
    assert got["fusedist vs best"] == pytest.approx(min(share, compare.HOST_NOISE_MAX))
    assert got["fusedist vs cudnn"] == got["fusedist vs best"]
    assert got["fusedist vs best_graph"] is None
    gpu_bound = noise(prefill_row(1000.0, 990.0, 1010.0, 1000.0))
    assert gpu_bound["fusedist vs best"] is None
    assert noise(prefill_row(100.0, 30.0, 100.0, 30.0))["fusedist vs best"] == \
        compare.HOST_NOISE_MAX                            # 0.7 + 0.7, clipped
    # The measured pair: the eager ratios move 17% within their band; the same 17% in the
    # graph ratio is a regression.
    old = {"rows": [prefill_row(88.9, 72.2, 54.3, 31.5)]}
    new = {"rows": [prefill_row(86.8, 71.5, 44.1, 30.8)]}
    v, _ = verdicts(old, new)
    assert {k.split(": ")[1]: x for k, x in v.items()} == {
        "fusedist vs best": "same", "fusedist vs cudnn": "same", "fusedist vs best_graph": "same"}
    slow_kernel = {"rows": [prefill_row(86.8, 71.5 * 1.2, 44.1, 30.8)]}
    v, _ = verdicts(old, slow_kernel)
    assert v[next(k for k in v if k.endswith("vs best_graph"))] == "regressed"


def gemv_row(fd_us: float, base_us: float, rounds: list) -> dict:
    """benchmarks/gemv.py's form: every kernel's time in a dict, `vs` naming the baselines,
    each round's ratio in ratio_rounds (its spread is the metric's noise)."""
    return {"shape": "70b/tp2/down", "K": 14336, "N": 8192, "M": 1, "format": "fp8_block",
            "bytes": 117469184, "time_us": {"fusedist": fd_us, "scaled_mm_rowwise": base_us},
            "vs": {"scaled_mm_rowwise": base_us / fd_us},
            "ratio_rounds": {"scaled_mm_rowwise": rounds}}


def test_a_changed_ratio_is_reported_with_each_sides_move(tmp_path, capsys):
    """A ratio that left its band is printed with the two times it divides, old -> new, so a
    baseline that got faster reads apart from a fusedist path that got slower; the verdict is
    the ratio's either way. The measured pair: one H200 against the committed H200 file,
    fusedist's FP8 GEMV at 38.24 -> 39.34 us while torch._scaled_mm went 74.57 -> 69.83 us."""
    old = {"meta": {}, "rows": [gemv_row(38.24, 74.57, [1.958, 1.982, 1.925])]}
    new = {"meta": {}, "rows": [gemv_row(39.34, 69.83, [1.779, 1.765, 1.777])]}
    rows, n = compare.compare(old, new)
    assert n == 1 and rows[0]["verdict"] == "regressed" and rows[0]["band"] == compare.NOISE
    assert rows[0]["parts"] == {"fusedist": (38.24, 39.34), "scaled_mm_rowwise": (74.57, 69.83)}
    line = compare._fmt(rows[0])
    assert "times fusedist 38.24 -> 39.34 (+2.9%), scaled_mm_rowwise 74.57 -> 69.83 (-6.4%)" \
        in line, line
    # A file that stores its metrics (with their parts) reads the same; one whose metrics
    # predate parts gets them from its rows.
    written = {"meta": {}, "metrics": compare.metrics(new), "rows": new["rows"]}
    assert written["metrics"][0]["parts"] == {"fusedist": 39.34, "scaled_mm_rowwise": 69.83}
    bare = {"meta": {}, "metrics": [{k: v for k, v in m.items() if k != "parts"}
                                    for m in compare.metrics(old)], "rows": old["rows"]}
    assert compare.compare(bare, written)[0][0]["parts"] == rows[0]["parts"]
    assert compare.main([str(write(tmp_path / "o.json", bare)),
                         str(write(tmp_path / "n.json", written))]) == 1
    assert "scaled_mm_rowwise 74.57 -> 69.83 (-6.4%)" in capsys.readouterr().out
    # A ratio whose row has no times (a bare metric) is printed without them.
    plain = compare._fmt(compare.compare(
        {"metrics": [compare.metric("c: fusedist vs torch", 2.0, "higher")]},
        {"metrics": [compare.metric("c: fusedist vs torch", 1.0, "higher")]})[0][0])
    assert "times" not in plain and "2.000x -> 1.000x" in plain
    with pytest.raises(ValueError, match="parts must be"):
        compare.metrics({"metrics": [dict(compare.metric("c: a vs b", 1.0, "higher"),
                                          parts={"a": 1.0})]})


def gemv_doc(times: list) -> dict:
    """A gemv file of len(times) shapes, each (fusedist us, baseline us) with steady rounds."""
    rows = []
    for i, (fd, base) in enumerate(times):
        r = gemv_row(fd, base, [base / fd] * 3)
        rows.append(dict(r, N=1024 * (i + 1), bytes=r["bytes"] + i))
    return {"meta": {}, "rows": rows}


# Ten shapes, fusedist and its baseline at steady times; the first is the measured pair of a
# third H200 against the committed H200 file: fusedist 38.24 -> 37.28 us, torch._scaled_mm
# row-wise 74.57 -> 65.90 us (the ratio 1.950x -> 1.768x, -9.4%).
TEN = [(38.24, 74.57)] + [(10.0 + i, 12.0 + 2 * i) for i in range(9)]


def test_a_baseline_that_got_faster_is_not_a_fusedist_regression(tmp_path, capsys):
    """A ratio that regressed because its baseline got faster while fusedist's time held (the
    machine's move, the baselines' median, is ~0 here) gets the verdict "baseline": printed and
    counted, exit 0; --strict fails on it."""
    new = [(37.28, 65.90)] + TEN[1:]
    rows, _ = compare.compare(gemv_doc(TEN), gemv_doc(new))
    assert [r["verdict"] for r in rows if r["verdict"] != "same"] == ["baseline"]
    assert compare.machine_move(rows) == (1.0, 10)
    old_p, new_p = write(tmp_path / "o.json", gemv_doc(TEN)), write(tmp_path / "n.json",
                                                                   gemv_doc(new))
    assert compare.main([str(old_p), str(new_p)]) == 0
    out = capsys.readouterr().out
    assert "0 regressed, 1 baseline moved" in out and "machine move +0.0%, the median of 10" \
        in out and "  baseline  " in out, out
    assert compare.main([str(old_p), str(new_p), "--strict"]) == 1
    # The same baseline move with fusedist 8% slower (past the 6% band) is a regression.
    slow = [(38.24 * 1.08, 65.90)] + TEN[1:]
    rows, _ = compare.compare(gemv_doc(TEN), gemv_doc(slow))
    assert [r["verdict"] for r in rows if r["verdict"] != "same"] == ["regressed"]
    assert compare.main([str(old_p), str(write(tmp_path / "s.json", gemv_doc(slow)))]) == 1


def test_fusedist_that_did_not_follow_a_faster_machine_regresses():
    """Every baseline 10% faster (a faster machine) while fusedist's times stayed put: each
    ratio is 10% worse and fusedist's time is 11% slower than the machine predicts, so every
    ratio regresses; fusedist 10% faster with it is no change."""
    still = [(fd, base * 0.9) for fd, base in TEN]
    rows, _ = compare.compare(gemv_doc(TEN), gemv_doc(still))
    assert compare.machine_move(rows)[0] == pytest.approx(0.9)
    assert {r["verdict"] for r in rows} == {"regressed"}
    along = [(fd * 0.9, base * 0.9) for fd, base in TEN]
    assert {r["verdict"] for r in compare.compare(gemv_doc(TEN), gemv_doc(along))[0]} == {"same"}


def test_too_few_baseline_times_keep_the_ratios_verdict():
    """Under MIN_PEER_TIMES distinct baseline times there is no machine move to judge
    fusedist's time against: the ratio's verdict stands. Parts that do not divide to their
    ratio (a synthetic or edited file) are not evidence either."""
    few = TEN[:compare.MIN_PEER_TIMES - 1]
    rows, _ = compare.compare(gemv_doc(few), gemv_doc([(37.28, 65.90)] + few[1:]))
    assert compare.machine_move(rows) == (None, compare.MIN_PEER_TIMES - 1)
    assert [r["verdict"] for r in rows if r["verdict"] != "same"] == ["regressed"]
    old = gemv_doc(TEN)
    new = {"metrics": compare.metrics(old)}
    new["metrics"][0] = dict(new["metrics"][0], value=new["metrics"][0]["value"] * 0.8)
    rows, _ = compare.compare(old, new)
    assert [r["verdict"] for r in rows if r["verdict"] != "same"] == ["regressed"]


def test_rows_that_did_not_run_are_not_compared():
    assert verdicts(ar_doc(10.0, 20.0), ar_doc(30.0, 20.0, status="n/a (ValueError)"))[1] == 0


def gemm_doc(auto_us: float, torch_us: float, m: int = 128) -> dict:
    """benchmarks/gemm.py's form: one row per shape, every kernel's time in a dict."""
    return {"meta": {"world_size": 1}, "rows": [
        {"layout": "kn", "M": m, "N": 8192, "K": 4096,
         "time_us": {"torch": torch_us, "decode": 99.0, "sm90_swap_along_n": 25.0, "auto": auto_us}}]}


def test_the_per_shape_dict_form():
    v, n = verdicts(gemm_doc(20.0, 20.0), gemm_doc(25.0, 20.0))
    assert n == 1 and list(v.values()) == ["regressed"]
    assert "M=128" in next(iter(v)) and "auto vs torch" in next(iter(v))
    # Shapes only one file has are left out.
    assert verdicts(gemm_doc(20.0, 20.0, m=64), gemm_doc(20.0, 20.0, m=128))[1] == 0


def test_an_explicit_fusedist_path():
    rows, n = compare.compare(ar_doc(10.0, 20.0), ar_doc(10.0, 20.0), fusedist="fd_one_shot")
    assert n == 1 and rows[0]["case"].endswith("fd_one_shot vs nccl_torch")


def test_not_a_result_file():
    with pytest.raises(compare.NotAResult, match="not a benchmark result"):
        compare.metrics({"meta": {}, "traces": []})


def write(path: Path, doc: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))
    return path


def test_exit_status_and_report(tmp_path, capsys):
    old = write(tmp_path / "old.json", ar_doc(10.0, 20.0))
    assert compare.main([str(old), str(write(tmp_path / "same.json", ar_doc(10.0, 21.0)))]) == 0
    assert compare.main([str(old), str(write(tmp_path / "bad.json", ar_doc(14.0, 20.0)))]) == 1
    out = capsys.readouterr().out
    assert "1 regressed" in out and "2.000x -> 1.429x" in out
    other = write(tmp_path / "other.json", gemm_doc(20.0, 20.0))
    assert compare.main([str(old), str(other)]) == 2
    with pytest.raises(SystemExit):
        compare.main([str(old), str(old), "--noise", "1.5"])


def test_directories_pair_files_by_relative_path(tmp_path):
    write(tmp_path / "a" / "h200-w2" / "allreduce.json", ar_doc(10.0, 20.0))
    write(tmp_path / "a" / "h200-w1" / "gemm.json", gemm_doc(20.0, 20.0))
    write(tmp_path / "a" / "h200-w2" / "trace.json", {"meta": {}, "traces": []})
    write(tmp_path / "b" / "h200-w2" / "allreduce.json", ar_doc(10.0, 20.0))
    write(tmp_path / "b" / "h200-w1" / "gemm.json", gemm_doc(30.0, 20.0))
    pairs = compare.pairs(tmp_path / "a", tmp_path / "b")
    assert {p[0].name for p in pairs} == {"allreduce.json", "gemm.json", "trace.json"}
    assert all(p[1].is_file() for p in pairs if p[0].name != "trace.json")
    assert compare.main([str(tmp_path / "a"), str(tmp_path / "b")]) == 1


RESULTS = ROOT / "benchmarks" / "results"


def committed() -> list[tuple[Path, dict]]:
    """Every committed benchmark result (JSON with rows or metrics; traces are not results)."""
    out = []
    for p in sorted(RESULTS.rglob("*.json")):
        doc = json.loads(p.read_text())
        if isinstance(doc, dict) and ("rows" in doc or "metrics" in doc):
            out.append((p, doc))
    return out


def test_every_committed_result_reads_through_the_schema():
    """Each committed result file gives metrics (none is skipped for its row form), each with
    a unique key, a finite value, a direction; the model, TTFT and every op's file among them."""
    files = committed()
    stems = {p.stem for p, _ in files}
    assert {"allreduce", "gemm_comm", "gemm", "gemv", "fp8_linear", "attention",
            "attention_prefill", "add_rmsnorm", "silu_mul", "model", "model-ttft",
            "gemm_waves", "scaling"} <= stems, stems
    for p, doc in files:
        ms = compare.metrics(doc)
        assert ms, f"{p.relative_to(ROOT)}: no metric read"
        assert len({m["key"] for m in ms}) == len(ms)
        assert {m["better"] for m in ms} <= {"higher", "lower"}
    # the model's TTFT: fusedist's prefill against the torch baseline's, higher is better
    ttft = compare.metrics(json.loads((RESULTS / "h200-w1" / "model-ttft.json").read_text()))
    assert any(m["key"].endswith("fusedist vs torch prefill") for m in ttft)


def slower(m: dict, by: float) -> dict:
    """Metric m with fusedist `by` slower: a ratio `by` lower and, where it carries its parts,
    the headline's time 1 / (1 - by) longer (the baseline's unchanged); a time `by` longer."""
    if m["better"] == "lower":
        return dict(m, value=m["value"] / (1 - by))
    out = dict(m, value=m["value"] * (1 - by))
    if m.get("parts"):
        (fd, t), (base, tb) = m["parts"].items()
        out["parts"] = {fd: t / (1 - by), base: tb}
    return out


def degrade(ms: list, by: float) -> list:
    """The metrics with fusedist `by` slower (slower), in the schema's form."""
    return [slower(m, by) for m in ms]


@pytest.mark.parametrize("path", [p for p, _ in committed()], ids=lambda p: p.stem)
def test_a_synthetic_regression_of_every_committed_file_fails(path):
    """Every metric of a committed file 10% worse: each whose noise band is under 10% is a
    regression (the rest are within their measured noise), and every metric 1% past its band
    is one; the same values are not."""
    doc = json.loads(path.read_text())
    ms = compare.metrics(doc)
    rows, n = compare.compare(doc, {"metrics": degrade(ms, 0.10)})
    assert ms and n == len(ms)
    for r in rows:
        assert r["verdict"] == ("regressed" if r["band"] < 0.10 - 1e-9 else "same"), r
    past = [slower(m, b) for m, b in zip(sorted(ms, key=lambda m: m["key"]),
                                         [r["band"] + 0.01 for r in rows])]
    rows, _ = compare.compare(doc, {"metrics": past})
    assert all(r["verdict"] == "regressed" for r in rows)
    rows, _ = compare.compare(doc, {"metrics": [dict(m) for m in ms]})
    assert all(r["verdict"] == "same" for r in rows)


def test_a_10_percent_regression_of_the_committed_set_fails_the_gate(tmp_path, capsys):
    """compare.py over the committed results directory against a new run 10% worse in every
    metric exits 1 and names regressions in every file that has metrics with bands under 10%;
    against a run within the noise it exits 0."""
    for name, by in (("worse", 0.10), ("noisy", 0.03)):
        for p, doc in committed():
            ms = compare.metrics(doc)
            bad = degrade(ms, by) if name == "worse" else \
                [dict(m, value=m["value"] * (1.02 if i % 2 else 0.98)) for i, m in enumerate(ms)]
            write(tmp_path / name / p.relative_to(RESULTS), {"meta": doc.get("meta"),
                                                           "metrics": bad})
    assert compare.main([str(RESULTS), str(tmp_path / "worse")]) == 1
    out = capsys.readouterr().out
    assert "ERROR" not in out
    assert "h200-w2/gemm_comm.json" in out and " regressed" in out
    assert compare.main([str(RESULTS), str(tmp_path / "noisy")]) == 0


def test_lower_is_better_metrics():
    """A time (lower is better) that grew past its band is a regression; one that fell, an
    improvement."""
    old = {"metrics": [compare.metric("waves=1: time_us", 100.0, "lower", 0.02)]}
    for t, verdict in ((110.0, "regressed"), (103.0, "same"), (90.0, "improved")):
        new = {"metrics": [compare.metric("waves=1: time_us", t, "lower", 0.02)]}
        assert compare.compare(old, new)[0][0]["verdict"] == verdict


def test_schema_errors_name_the_entry():
    for bad, match in [([{"key": "a", "value": 1.0, "better": "up"}], "better must be"),
                       ([{"key": "a", "value": float("nan"), "better": "higher"}], "finite"),
                       ([{"key": "a", "value": 1.0, "better": "higher"}] * 2, "appears twice"),
                       ([{"value": 1.0}], "non-empty str 'key'")]:
        with pytest.raises(ValueError, match=match):
            compare.metrics({"metrics": bad})


def test_a_result_file_the_loader_cannot_read_is_an_error(tmp_path, capsys):
    write(tmp_path / "a" / "x.json", {"meta": {}, "rows": [{"what": "unknown", "n": 3}]})
    write(tmp_path / "b" / "x.json", {"meta": {}, "rows": [{"what": "unknown", "n": 3}]})
    write(tmp_path / "a" / "trace.json", {"meta": {}, "traces": []})
    assert compare.main([str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    out = capsys.readouterr().out
    assert "ERROR" in out and "x.json: no metric read" in out and "trace.json: skipped" in out


def test_write_results_writes_the_schema(tmp_path, monkeypatch):
    """benchmarks/_harness.write_results puts the metrics beside the rows: what compare.py
    reads from the rows, so every benchmark writes the schema."""
    import sys

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    monkeypatch.setenv("FUSEDIST_RESULTS_DIR", str(tmp_path))
    sys.modules.pop("_harness", None)
    import _harness

    doc = ar_doc(10.0, 20.0, rounds=[0, 0.01])
    paths = _harness.write_results("allreduce", {"world_size": 2}, doc["rows"], "table")
    got = json.loads(paths[0].read_text())
    assert got["metrics"] == compare.metrics(doc) and len(got["metrics"]) == 1
    assert compare.compare(got, doc)[1] == 1
    explicit = [compare.metric("ttft_ms", 5.0, "lower", 0.01)]
    paths = _harness.write_results("x", {"world_size": 1}, [], "t", metrics=explicit)
    assert json.loads(paths[0].read_text())["metrics"] == explicit
    with pytest.raises(ValueError, match="better must be"):
        _harness.write_results("x", {"world_size": 1}, [], "t",
                               metrics=[{"key": "k", "value": 1.0, "better": "more"}])
    # rows the loader cannot pair (two with one key): written without metrics, which
    # compare.py then reports as an error instead of comparing
    twice = ar_doc(10.0, 20.0)["rows"][:1] * 2 + ar_doc(10.0, 20.0)["rows"][2:]
    paths = _harness.write_results("dup", {"world_size": 2}, twice, "t")
    assert "metrics" not in json.loads(paths[0].read_text())
