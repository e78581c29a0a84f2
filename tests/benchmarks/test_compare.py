"""benchmarks/compare.py on small synthetic result files: same-run ratios, the noise band,
both row forms, directory pairing and the exit status."""

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
    with pytest.raises(ValueError, match="not a benchmark result"):
        compare.cases({"meta": {}, "traces": []})


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
    assert {p[0].name for p in pairs} == {"allreduce.json", "gemm.json"}
    assert compare.main([str(tmp_path / "a"), str(tmp_path / "b")]) == 1


def test_the_committed_results_agree_with_themselves():
    results = ROOT / "benchmarks" / "results"
    files = [p for p in results.rglob("*.json") if "rows" in json.loads(p.read_text())]
    assert files, "no committed benchmark results found"
    for p in files:
        doc = json.loads(p.read_text())
        if compare.ratios(doc):
            rows, n = compare.compare(doc, doc)
            assert n > 0 and all(r["verdict"] == "same" for r in rows), p
