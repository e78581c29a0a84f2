"""fusedist/tuning.py: the all-reduce algorithm table (lookup, forced algorithm, where the
table is loaded from). Pure Python, no GPU."""

from __future__ import annotations

import json

import pytest

from fusedist import tuning

KB, MB = 1 << 10, 1 << 20

TABLE = {"allreduce": {
    "2": [{"max_bytes": 8 * MB, "algo": "one_shot"},
          {"max_bytes": None, "algo": "two_shot"}],
    "8": [{"max_bytes": 64 * KB, "algo": "one_shot"},
          {"max_bytes": 4 * MB, "algo": "two_shot"}],  # bounded: NCCL past the last rule
}}


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    """No forced algorithm, no tuning file, and an empty cache directory of our own."""
    monkeypatch.delenv("FUSEDIST_ALLREDUCE_ALGO", raising=False)
    monkeypatch.delenv("FUSEDIST_TUNING_FILE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path


# ------------------------------------------------------------------ choose

@pytest.mark.parametrize("nbytes,algo", [
    (0, "one_shot"), (1, "one_shot"), (8 * MB - 1, "one_shot"), (8 * MB, "one_shot"),
    (8 * MB + 1, "two_shot"), (1 << 40, "two_shot"),  # max_bytes None = unbounded
])
def test_choose_thresholds_world2(nbytes, algo):
    assert tuning.choose(TABLE, nbytes, 2) == algo


@pytest.mark.parametrize("nbytes,algo", [
    (64 * KB, "one_shot"), (64 * KB + 1, "two_shot"), (4 * MB, "two_shot"),
    (4 * MB + 1, "nccl"),  # past every bounded rule
])
def test_choose_thresholds_world8(nbytes, algo):
    assert tuning.choose(TABLE, nbytes, 8) == algo


MODEL = {"alpha_us": {"one_shot": 3.4, "two_shot": 8.0, "nccl": 10.0},
         "GBps": {"one_shot": 282.0, "two_shot": 342.0, "nccl": 287.0}}


@pytest.mark.parametrize("world", [3, 4, 6, 16])
def test_untuned_world_sizes_take_the_model_not_the_nearest_table(world):
    table = {**TABLE, "allreduce_model": MODEL}
    rules = tuning.model_rules(MODEL, world)
    with pytest.warns(RuntimeWarning, match=f"no measured all-reduce table for world size {world}"):
        got = [tuning.choose(table, n, world) for n in (1, 64 * KB + 1, 4 * MB + 1, 8 * MB + 1)]
    want = []
    for n in (1, 64 * KB + 1, 4 * MB + 1, 8 * MB + 1):
        want.append(next(r["algo"] for r in rules if r["max_bytes"] is None or n <= r["max_bytes"]))
    assert got == want


@pytest.mark.parametrize("world", [2, 3, 4, 8, 16])
def test_model_rules_pick_the_fastest_algorithm_of_the_model(world):
    rules = tuning.model_rules(MODEL, world)
    assert rules[-1]["max_bytes"] is None
    bounds = [r["max_bytes"] for r in rules[:-1]]
    assert bounds == sorted(bounds)
    for n in [1, 1000, 64 * KB, 200 * KB, 1 * MB, 7 * MB, 64 * MB, 1 << 30]:
        algo = next(r["algo"] for r in rules if r["max_bytes"] is None or n <= r["max_bytes"])
        t = {a: tuning.model_time_us(MODEL, a, n, world) for a in tuning.ALGOS}
        assert t[algo] == min(t.values()), (world, n, algo, t)


def test_shipped_model_reproduces_the_measured_two_rank_crossover(clean_env):
    t = tuning.load_table("NVIDIA H200", 2)
    rules = tuning.model_rules(t["allreduce_model"], 2)
    measured = t["allreduce"]["2"][0]["max_bytes"]  # one-shot up to 8 MiB on 2x H200
    assert rules[0]["algo"] == "one_shot" and measured / 2 <= rules[0]["max_bytes"] <= 2 * measured
    # More ranks: one-shot reads more peers, so it hands over to two-shot earlier.
    assert tuning.model_rules(t["allreduce_model"], 8)[0]["max_bytes"] < rules[0]["max_bytes"]


def test_untuned_world_size_warns_once_per_table(recwarn):
    table = {**TABLE, "allreduce_model": MODEL}
    for n in (1, 2, 1 << 30):
        tuning.choose(table, n, 4)
    assert len([w for w in recwarn if "world size 4" in str(w.message)]) == 1
    tuning.choose({**TABLE, "allreduce_model": MODEL}, 1, 4)  # another communicator's copy
    assert len([w for w in recwarn if "world size 4" in str(w.message)]) == 2
    tuning.choose(table, 1, 2)  # measured: no warning
    tuning.choose(table, 1, 8)
    assert len(recwarn) == 2


def test_warn_once_per_communicator_and_key(recwarn):
    class Comm:
        def __init__(self, name):
            self.name = name

    a, b = Comm("tp/0"), Comm("tp/1")
    assert tuning.warn_once(a, "rmsnorm_unfused", "slow path")
    assert not tuning.warn_once(a, "rmsnorm_unfused", "slow path")
    assert tuning.warn_once(a, "other", "another slow path")
    assert tuning.warn_once(b, "rmsnorm_unfused", "slow path")
    msgs = [str(w.message) for w in recwarn]
    assert msgs == ["fusedist (tp/0): slow path", "fusedist (tp/0): another slow path",
                    "fusedist (tp/1): slow path"]
    assert all(w.category is RuntimeWarning for w in recwarn)


def test_model_is_validated():
    with pytest.raises(ValueError, match="allreduce_model.GBps"):
        tuning._valid({"allreduce_model": {"alpha_us": MODEL["alpha_us"],
                                           "GBps": {"one_shot": 1.0}}})
    with pytest.raises(ValueError, match="allreduce_model.alpha_us"):
        tuning._valid({"allreduce_model": {"alpha_us": {**MODEL["alpha_us"], "nccl": 0},
                                           "GBps": MODEL["GBps"]}})


@pytest.mark.parametrize("table", [{}, {"allreduce": {}}])
def test_choose_empty_table_default(table):
    assert tuning.choose(table, 1, 4) == "one_shot"
    assert tuning.choose(table, 256 * KB, 4) == "one_shot"
    assert tuning.choose(table, 256 * KB + 1, 4) == "two_shot"
    assert tuning.choose(table, 1 << 30, 2) == "two_shot"


# ------------------------------------------------------------------ forced_algo

def test_forced_algo_unset_and_auto(monkeypatch):
    monkeypatch.delenv("FUSEDIST_ALLREDUCE_ALGO", raising=False)
    assert tuning.forced_algo() is None
    monkeypatch.setenv("FUSEDIST_ALLREDUCE_ALGO", "auto")
    assert tuning.forced_algo() is None


@pytest.mark.parametrize("algo", tuning.ALGOS)
def test_forced_algo_valid(monkeypatch, algo):
    monkeypatch.setenv("FUSEDIST_ALLREDUCE_ALGO", algo)
    assert tuning.forced_algo() == algo


@pytest.mark.parametrize("algo", ["three_shot", "ONE_SHOT", "one_shot "])
def test_forced_algo_invalid(monkeypatch, algo):
    monkeypatch.setenv("FUSEDIST_ALLREDUCE_ALGO", algo)
    with pytest.raises(ValueError) as e:
        tuning.forced_algo()
    msg = str(e.value)
    assert "FUSEDIST_ALLREDUCE_ALGO" in msg
    assert repr(algo) in msg
    for a in tuning.ALGOS:
        assert a in msg


# ------------------------------------------------------------------ load_table

def test_load_table_from_tuning_file(clean_env, monkeypatch):
    path = clean_env / "table.json"
    path.write_text(json.dumps(TABLE))
    monkeypatch.setenv("FUSEDIST_TUNING_FILE", str(path))
    t = tuning.load_table("NVIDIA H200", 8)
    assert t["source"] == str(path)
    assert t["allreduce"] == TABLE["allreduce"]
    assert tuning.choose(t, 4 * MB + 1, 8) == "nccl"


def test_load_table_tuning_file_wins_over_cache(clean_env, monkeypatch):
    cache = tuning.cache_path("NVIDIA H200", 2)
    cache.parent.mkdir(parents=True)
    cache.write_text(json.dumps({"allreduce": {"2": [{"max_bytes": None, "algo": "nccl"}]}}))
    assert tuning.load_table("NVIDIA H200", 2)["source"] == str(cache)
    path = clean_env / "table.json"
    path.write_text(json.dumps(TABLE))
    monkeypatch.setenv("FUSEDIST_TUNING_FILE", str(path))
    assert tuning.load_table("NVIDIA H200", 2)["source"] == str(path)


def _tune_table_of_the_benchmark():
    """benchmarks/allreduce.py's --tune writer, on rows of a made-up two-rank run."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "allreduce.py"
    spec = importlib.util.spec_from_file_location("bench_allreduce", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = [{"op": "all_reduce", "status": "ok", "backend": b, "bytes": n, "time_us": t}
            for n, ts in ((4096, (3, 5, 9)), (1 << 24, (60, 50, 80)))
            for b, t in zip(("fd_one_shot", "fd_two_shot", "nccl4py"), ts)]
    return mod.tune_table(rows, 2)


def test_tune_cache_keeps_the_shipped_gemm_dispatch(clean_env):
    shipped = tuning.load_table("NVIDIA H200", 2)
    cache = tuning.cache_path("NVIDIA H200", 2)
    cache.parent.mkdir(parents=True)
    cache.write_text(json.dumps(_tune_table_of_the_benchmark()))
    t = tuning.load_table("NVIDIA H200", 2)
    assert t["source"] == str(cache)
    # The tuned all-reduce rules are in force ...
    assert t["allreduce"]["2"] == [{"max_bytes": 4096, "algo": "one_shot"},
                                   {"max_bytes": None, "algo": "two_shot"}]
    # ... and so are the shipped GEMM + collective rules and wave model.
    assert tuning.choose_gemm(t, "gemm_ar", 1, 8192, 4096, 2, fused_ok=True) == "fused"
    assert tuning.gemm_waves(t) is not None
    assert t["gemm_comm"] == shipped["gemm_comm"]
    assert t["sources"]["allreduce"] == str(cache)
    assert t["sources"]["gemm_comm"] == str(tuning._DEFAULT)
    assert t["allreduce_model"] == shipped["allreduce_model"]


def test_tuning_files_merge_per_world_size(clean_env, monkeypatch):
    cache = tuning.cache_path("NVIDIA H200", 8)
    cache.parent.mkdir(parents=True)
    cache.write_text(json.dumps({"allreduce": {"8": [{"max_bytes": None, "algo": "nccl"}]}}))
    path = clean_env / "table.json"
    path.write_text(json.dumps({"allreduce": {"4": [{"max_bytes": None, "algo": "two_shot"}]}}))
    monkeypatch.setenv("FUSEDIST_TUNING_FILE", str(path))
    t = tuning.load_table("NVIDIA H200", 8)
    assert sorted(t["allreduce"], key=int) == ["2", "4", "8"]  # shipped, file, cache
    assert tuning.choose(t, 1, 8) == "nccl" and tuning.choose(t, 1, 4) == "two_shot"
    assert tuning.choose(t, 1, 2) == "one_shot"


def test_cache_path_slug(clean_env):
    p = tuning.cache_path("NVIDIA H200 (141GB) PCIe", 4)
    assert p == clean_env / "cache" / "fusedist" / "allreduce-nvidia-h200-141gb-pcie-w4.json"


def test_load_table_shipped_default(clean_env):
    t = tuning.load_table("NVIDIA H200", 2)
    assert t["source"] == str(tuning._DEFAULT)
    assert tuning._DEFAULT.name == "tuning_default.json" and tuning._DEFAULT.is_file()
    with open(tuning._DEFAULT) as f:
        shipped = json.load(f)
    assert t["allreduce"] == shipped["allreduce"]
    tuning._valid(shipped)
    # The measured 2x H200 table: one-shot up to 8 MiB, two-shot above.
    assert tuning.choose(t, 8 * MB, 2) == "one_shot"
    assert tuning.choose(t, 8 * MB + 1, 2) == "two_shot"


def test_load_table_rejects_unknown_algo_in_file(clean_env, monkeypatch):
    path = clean_env / "bad.json"
    path.write_text(json.dumps({"allreduce": {"2": [{"max_bytes": None, "algo": "ring"}]}}))
    monkeypatch.setenv("FUSEDIST_TUNING_FILE", str(path))
    with pytest.raises(ValueError, match="unknown algo 'ring'"):
        tuning.load_table("NVIDIA H200", 2)


# ------------------------------------------------------------------ _valid

def test_valid_accepts_every_algo_and_returns_table():
    t = {"allreduce": {str(w): [{"max_bytes": None, "algo": a}]
                       for w, a in zip((2, 4, 8), tuning.ALGOS)}}
    assert tuning._valid(t) is t
    assert tuning._valid({}) == {}


@pytest.mark.parametrize("algo", ["three_shot", "NCCL", None])
def test_valid_rejects_unknown_algo(algo):
    with pytest.raises(ValueError, match="unknown algo"):
        tuning._valid({"allreduce": {"2": [{"max_bytes": 1, "algo": "one_shot"},
                                           {"max_bytes": None, "algo": algo}]}})


def test_valid_rejects_non_integer_world_size():
    with pytest.raises(ValueError):
        tuning._valid({"allreduce": {"two": [{"max_bytes": None, "algo": "nccl"}]}})


def test_missing_tuning_file_is_an_error(clean_env, monkeypatch):
    monkeypatch.setenv("FUSEDIST_TUNING_FILE", str(clean_env / "nope.json"))
    with pytest.raises(ValueError, match="FUSEDIST_TUNING_FILE=.*does not exist"):
        tuning.load_table("NVIDIA H200", 2)


# ---- GEMM + collective engine choice ---------------------------------------------------------
GEMM_TABLE = {"gemm_comm": {"gemm_ar": {"min_mnk": 1 << 38, "chunks": 2, "fused_max_m": 32},
                            "gemm_rs": {"min_mnk": None}}}


@pytest.mark.parametrize("m,fused_ok,engine", [
    (1, True, "fused"), (32, True, "fused"), (33, True, "unfused"), (1, False, "unfused"),
    (8192, True, "overlap"), (8192, False, "overlap")])
def test_choose_gemm_ar_fused_window(m, fused_ok, engine):
    assert tuning.choose_gemm(GEMM_TABLE, "gemm_ar", m, 8192, 4096, 2, fused_ok=fused_ok) == engine


def test_choose_gemm_never_fused_without_a_rule_or_a_peer():
    assert tuning.choose_gemm({}, "gemm_ar", 1, 8192, 4096, 2, fused_ok=True) == "unfused"
    assert tuning.choose_gemm(GEMM_TABLE, "gemm_ar", 1, 8192, 4096, 1, fused_ok=True) == "unfused"
    assert tuning.choose_gemm(GEMM_TABLE, "gemm_rs", 8192, 8192, 8192, 2) == "unfused"


def test_shipped_table_picks_fused_for_decode_gemm_ar(clean_env):
    table = tuning.load_table("NVIDIA H200", 2)
    assert tuning.choose_gemm(table, "gemm_ar", 1, 8192, 4096, 2, fused_ok=True) == "fused"
    assert tuning.choose_gemm(table, "gemm_ar", 1, 8192, 4096, 2, fused_ok=False) == "unfused"


def test_choose_gemm_copy_engine_threshold():
    table = {"gemm_comm": {"gemm_rs": {"min_mnk": None, "ce_min_mnk": 1 << 35}}}
    assert tuning.choose_gemm(table, "gemm_rs", 2048, 8192, 8192, 2) == "unfused"
    assert tuning.choose_gemm(table, "gemm_rs", 2048, 8192, 8192, 2,
                              copy_engine_ok=True) == "overlap"
    assert tuning.choose_gemm(table, "gemm_rs", 16, 64, 64, 2, copy_engine_ok=True) == "unfused"


def test_shipped_table_gemm_rs_overlaps_only_with_the_copy_engine(clean_env):
    table = tuning.load_table("NVIDIA H200", 2)
    assert tuning.choose_gemm(table, "gemm_rs", 4096, 8192, 8192, 2) == "unfused"
    assert tuning.choose_gemm(table, "gemm_rs", 4096, 8192, 8192, 2,
                              copy_engine_ok=True) == "overlap"


def test_shipped_table_gemm_ar_prefill_overlaps_with_the_copy_engine(clean_env):
    table = tuning.load_table("NVIDIA H200", 2)
    assert tuning.choose_gemm(table, "gemm_ar", 2048, 8192, 4096, 2) == "unfused"
    assert tuning.choose_gemm(table, "gemm_ar", 2048, 8192, 4096, 2,
                              copy_engine_ok=True) == "overlap"


def test_shipped_table_copy_engine_thresholds_follow_the_measured_crossovers(clean_env):
    # 2x H200 (gemm_comm_thresholds-*): gemm_ar with the copy engine lost at M=1024 (N=8192,
    # K=4096, 2^35) and won from M=2048.
    table = tuning.load_table("NVIDIA H200", 2)
    assert tuning.choose_gemm(table, "gemm_ar", 1024, 8192, 4096, 2,
                              copy_engine_ok=True) == "unfused"
    assert tuning.choose_gemm(table, "ag_gemm", 512, 8192, 8192, 2,
                              copy_engine_ok=True) == "overlap"


def test_choose_gemm_fused_from_fused_min_mnk():
    """Prefill fused kernels (ag_gemm) take over from the rule's fused_min_mnk, only where the
    fused engine takes the call; without the key the table never picks them."""
    table = {"gemm_comm": {"ag_gemm": {"min_mnk": 1 << 35, "fused_min_mnk": 1 << 36}}}
    assert tuning.choose_gemm(table, "ag_gemm", 8192, 8192, 8192, 2, fused_ok=True) == "fused"
    assert tuning.choose_gemm(table, "ag_gemm", 8192, 8192, 8192, 2, fused_ok=False) == "overlap"
    assert tuning.choose_gemm(table, "ag_gemm", 512, 8192, 8192, 2, fused_ok=True) == "overlap"
    assert tuning.choose_gemm(table, "ag_gemm", 256, 8192, 8192, 2, fused_ok=True) == "unfused"
    plain = {"gemm_comm": {"ag_gemm": {"min_mnk": 1 << 35}}}
    assert tuning.choose_gemm(plain, "ag_gemm", 8192, 8192, 8192, 2, fused_ok=True) == "overlap"


# ---- wave-aware GEMM pieces ------------------------------------------------------------------
import itertools  # noqa: E402

H200 = {"tile_m": 128, "tile_n": 256, "sms": 132}


def _sizes(b):
    return [y - x for x, y in zip(b, b[1:])]


def _all_aligned_splits(rows, parts, tm):
    """Every split of rows into `parts` non-empty ranges whose inner bounds are on tile rows."""
    cuts = range(tm, rows, tm)
    for inner in itertools.combinations(cuts, parts - 1):
        yield [0, *inner, rows]


@pytest.mark.parametrize("model", [{"tile_m": 4, "tile_n": 8, "sms": 3},
                                   {"tile_m": 3, "tile_n": 5, "sms": 7},
                                   {"tile_m": 8, "tile_n": 8, "sms": 2}])
@pytest.mark.parametrize("rows", [1, 7, 24, 37, 50])
@pytest.mark.parametrize("cols", [8, 21, 40])
@pytest.mark.parametrize("parts", [1, 2, 3, 4])
def test_wave_row_bounds_against_brute_force(model, rows, cols, parts):
    got = tuning.wave_row_bounds(rows, cols, parts, model)
    even = tuning.even_bounds(rows, parts)
    assert len(got) == parts + 1 and got[0] == 0 and got[-1] == rows
    assert all(a <= b for a, b in zip(got, got[1:]))
    cost = tuning._cost(got, cols, model)
    cands = [even, *_all_aligned_splits(rows, parts, model["tile_m"])]
    best = min(tuning._cost(b, cols, model) for b in cands)
    assert cost == best
    if tuning._cost(even, cols, model) == best:
        assert got == even  # never uneven without a gain
    else:  # the most even of the cheapest aligned splits
        sq = min(sum(s * s for s in _sizes(b)) for b in cands
                 if tuning._cost(b, cols, model) == best)
        assert sum(s * s for s in _sizes(got)) == sq


@pytest.mark.parametrize("rows,cols,parts,want", [
    (1024, 8192, 2, [512, 512]), (2048, 8192, 2, [1024, 1024]), (4096, 8192, 2, [2048, 2048]),
    (1024, 14336, 2, [512, 512]), (2048, 14336, 2, [896, 1152]),
    (4096, 14336, 2, [2048, 2048]), (8192, 14336, 2, [4096, 4096])])
def test_wave_row_bounds_on_the_h200_model(rows, cols, parts, want):
    """gemm_rs's blocks at the benchmark shapes: only 2048 x 14336 changes (1024-row pieces are
    3.4 waves each, 4 + 4 per side against 3 + 4 for 896 + 1152 rows)."""
    assert _sizes(tuning.wave_row_bounds(rows, cols, parts, H200)) == want


def test_wave_row_bounds_without_a_model_are_even():
    assert tuning.wave_row_bounds(2048, 14336, 2, None) == [0, 1024, 2048]


@pytest.mark.parametrize("bad", [{"tile_m": 0, "tile_n": 8, "sms": 4},
                                 {"tile_m": 8, "tile_n": 8, "sms": 4, "min_gain": 1.0},
                                 {"tile_m": 8, "tile_n": 8, "sms": 4, "min_gain": -0.1},
                                 {"tile_m": 8, "sms": 4}])
def test_gemm_waves_reads_and_checks_the_table(clean_env, bad):
    assert tuning.gemm_waves({}) is None
    assert tuning.gemm_waves(tuning.load_table("NVIDIA H200", 2)) == {**H200, "min_gain": 0.1}
    with pytest.raises(ValueError, match="gemm_comm.waves needs"):
        tuning.gemm_waves({"gemm_comm": {"waves": bad}})


def test_min_gain_keeps_small_wave_gains_even(clean_env):
    """The shipped model asks a cut to save 10% of the waves: gemm_rs 4096 x 14336 (16 -> 14
    waves) is cut. A toy model shows the threshold: saving 1 of 4 waves passes min_gain 0.25,
    not 0.26."""
    model = tuning.gemm_waves(tuning.load_table("NVIDIA H200", 2))
    assert tuning.wave_row_bounds(2048, 14336, 2, model) == [0, 896, 2048]
    toy = {"tile_m": 1, "tile_n": 1, "sms": 10}
    # 22 rows x 1 column in 2 parts: even 11 + 11 = 2 + 2 waves, 10 + 12 = 1 + 2: a 25% gain.
    assert tuning.wave_row_bounds(22, 1, 2, {**toy, "min_gain": 0.25}) == [0, 10, 22]
    assert tuning.wave_row_bounds(22, 1, 2, {**toy, "min_gain": 0.26}) == [0, 11, 22]


def test_choose_gemm_fused_only_up_to_fused_max_n(clean_env):
    """The shipped H200 x2 rule: ag_gemm's fused engine from M*N*K = 2^40 (16384 x 8192 x 8192)
    at N <= 8192: it won there in 4 of 7 paced runs, lost to the copy-engine overlap at
    8192^3 in 6 of 7, and lost at N = 14336."""
    table = tuning.load_table("NVIDIA H200", 2)
    kw = {"fused_ok": True, "copy_engine_ok": True}
    assert tuning.choose_gemm(table, "ag_gemm", 8192, 8192, 8192, 2, **kw) == "overlap"
    assert tuning.choose_gemm(table, "ag_gemm", 16384, 8192, 8192, 2, **kw) == "fused"
    assert tuning.choose_gemm(table, "ag_gemm", 16384, 14336, 8192, 2, **kw) == "overlap"
    assert tuning.choose_gemm(table, "ag_gemm", 8192, 14336, 8192, 2, **kw) == "overlap"
    assert tuning.choose_gemm(table, "ag_gemm", 4096, 8192, 8192, 2, **kw) == "overlap"
    assert tuning.choose_gemm(table, "ag_gemm", 8192, 8192, 8192, 2, fused_ok=False,
                              copy_engine_ok=True) == "overlap"
    assert tuning.choose_gemm(table, "gemm_rs", 8192, 8192, 8192, 2, **kw) == "overlap"


# ---- the decode planner's section ----------------------------------------------------------
def test_shipped_decode_section_is_the_planner_default(clean_env):
    table = tuning.load_table("NVIDIA H200", 1)
    assert tuning.decode_rule(table) == tuning.DECODE_DEFAULT
    assert {k for k in table["decode"] if k not in ("comment", "benchmark")} == \
        set(tuning.DECODE_DEFAULT)


def test_decode_section_from_a_tuning_file_changes_the_split_rule(clean_env, monkeypatch,
                                                                  tmp_path):
    from fusedist.ops.attention import _decode as ad
    f = tmp_path / "t.json"
    f.write_text(json.dumps({"decode": {"long_split_slabs": 8, "max_merge_splits": 16}}))
    monkeypatch.setenv("FUSEDIST_TUNING_FILE", str(f))
    rule = tuning.decode_rule(tuning.load_table("NVIDIA H200", 1))
    assert rule["long_split_slabs"] == 8 and rule["max_merge_splits"] == 16
    assert rule["min_slabs_per_split"] == tuning.DECODE_DEFAULT["min_slabs_per_split"]
    # batch 1 x 4 kv heads at 4K: the shipped rule keeps one CTA per SM (32 splits of 8
    # slabs); this one caps at 16 splits
    assert ad.choose_num_splits(1, 4, 1, 4096, 132) == 32
    assert ad.choose_num_splits(1, 4, 1, 4096, 132, rule) == 16
    # 4 x 4 heads at 4K: 16 splits of 16 slabs count as long under long_split_slabs = 8
    assert ad.choose_num_splits(4, 4, 1, 4096, 132) == 8
    assert ad.choose_num_splits(4, 4, 1, 4096, 132, rule) == 16


@pytest.mark.parametrize("section, match", [
    ({"max_merge_splits": 0}, r"decode.max_merge_splits must be an int in \[1, 128\]"),
    ({"max_merge_splits": 129}, "max_merge_splits"),
    ({"long_split_slabs": 2.5}, "long_split_slabs must be an int"),
    ({"cluster_merge_max_splits": 17}, r"cluster_merge_max_splits must be an int in \[0, 16\]"),
    ({"min_slabs_per_split": True}, "min_slabs_per_split"),
    ({"splits": 4}, "unknown key 'splits'"),
])
def test_decode_section_is_checked(section, match):
    with pytest.raises(ValueError, match=match):
        tuning.decode_rule({"decode": section})


# ---- one place decides: the knob sections, and no measured threshold as a module constant ---
import ast as _ast  # noqa: E402
import pathlib as _pathlib  # noqa: E402

import fusedist as _fusedist  # noqa: E402

_PKG = _pathlib.Path(_fusedist.__file__).parent
# Module-level numbers that are NOT measured crossovers: limits of a kernel (mirroring a _C
# constant), formats and protocol constants, defaults of an API. A new number in fusedist/ops,
# nn or models that decides between kernels belongs in the tuning table instead
# (tuning.declare, docs/tuning.md).
_NOT_MEASURED = {
    "ops/add_rmsnorm.py": {"MAX_VECTORS"},                  # _C.ADD_RMSNORM_MAX_VECTORS
    "ops/allreduce_rmsnorm.py": {"MAX_FUSED_VECTORS"},      # the kernel's row in registers
    "ops/quantize_rows.py": {"MIN_AMAX"},                   # the FP8 scale convention
    "ops/_rows.py": {"FP8_MIN_AMAX"},                       # ... of the layer kernels
    "models/llama/config.py": {"FP8_BLOCK"},                # the checkpoint format's block
    "ops/gemv.py": {"MAX_M", "MAX_M_FP8_X", "STAGES_AUTO", "MAX_STAGES"},   # _C.GEMV_*
    "ops/attention/_decode.py": {"SLAB", "TILE_HEADS", "MAX_SPLITS", "MAX_CLUSTER_SPLITS",
                                 "HEAD_DIMS"},              # _C.ATTENTION_DECODE_*
    "ops/attention/_prefill.py": {"PREFILL_MAX_SPLITS", "PREFILL_GATHER_TOKENS"},
    "ops/device_errors.py": {"_MOE_OPS"},                   # op codes of the error record
    "models/runner.py": {"PREFILL_GRAPH_TOKENS"},           # an API default (a capture size)
    "models/sampler.py": {"_M32"},                          # the noise hash's 32-bit mask
}


def _numeric_constants(path: _pathlib.Path) -> set:
    """Names bound at module level to a number (or an arithmetic of numbers)."""
    names = set()
    for node in _ast.parse(path.read_text()).body:
        targets = node.targets if isinstance(node, _ast.Assign) else \
            [node.target] if isinstance(node, _ast.AnnAssign) and node.value is not None else []
        value = getattr(node, "value", None)
        if value is None or not targets:
            continue
        leaves = [n for n in _ast.walk(value) if isinstance(n, (_ast.Constant, _ast.Name,
                                                                 _ast.Attribute, _ast.Call))]
        numeric = leaves and all(isinstance(n, _ast.Constant) and
                                 isinstance(n.value, (int, float)) and
                                 not isinstance(n.value, bool) for n in leaves)
        if numeric:
            names.update(t.id for t in targets if isinstance(t, _ast.Name))
    return names


def test_no_measured_threshold_is_a_module_constant():
    found = []
    for area in ("ops", "nn", "models"):
        for p in (_PKG / area).rglob("*.py"):
            rel = str(p.relative_to(_PKG))
            extra = _numeric_constants(p) - _NOT_MEASURED.get(rel, set())
            found += [f"{rel}: {name}" for name in sorted(extra)]
    assert not found, ("numbers that decide between kernels live in the tuning table "
                       "(tuning.declare + fusedist/tuning_default.json), not in:\n" +
                       "\n".join(found))


def test_the_constant_scan_finds_a_threshold(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("X = 2400\nY = 2.6e11\nZ = 1 << 19\nOK = ('a', 'b')\nW = f(3)\n")
    assert _numeric_constants(p) == {"X", "Y", "Z"}


def test_every_shipped_section_is_declared_and_names_its_benchmark(clean_env):
    table = tuning.load_table("NVIDIA H200", 1)
    import fusedist.ops  # noqa: F401  (the ops declare their sections at import)
    for section in tuning.KNOBS:
        if section in table:
            tuning.section_values(table, section)        # every value checked
            assert table[section].get("benchmark"), f"{section}: which benchmark measured it?"
    for section in ("decode", "prefill", "fp8_linear", "gemm", "gemm_comm"):
        assert table[section].get("benchmark"), section


def test_knobs_come_from_a_tuning_file(clean_env, monkeypatch, tmp_path):
    import fusedist.ops  # noqa: F401
    f = tmp_path / "t.json"
    f.write_text(json.dumps({"prefill": {"paged_fresh_max_tokens": 1000},
                             "fp8_linear": {"w8a8_gemv_max_m": 0}}))
    monkeypatch.setenv("FUSEDIST_TUNING_FILE", str(f))
    tuning.clear_cache()
    try:
        assert tuning.knobs("prefill")["paged_fresh_max_tokens"] == 1000
        assert tuning.knobs("prefill")["paged_max_flops"] == 2.6e11      # the shipped value
        assert tuning.knobs("fp8_linear")["w8a8_gemv_max_m"] == 0
        f.write_text(json.dumps({"prefill": {"paged_fresh_max_tokens": -1}}))
        tuning.clear_cache()
        with pytest.raises(ValueError, match=r"prefill.paged_fresh_max_tokens must be an int"):
            tuning.knobs("prefill")
        with pytest.raises(KeyError, match="no knob section 'nope'"):
            tuning.knobs("nope")
    finally:
        tuning.clear_cache()


def test_gpu_table_is_read_once_per_device_and_cleared(clean_env, monkeypatch):
    """gpu_table remembers each CUDA device's table (the ops ask on every call) until
    clear_cache(), after which a changed FUSEDIST_TUNING_FILE is read."""
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tuning, "_gpu_name", lambda index: "NVIDIA H200")
    tuning.clear_cache()
    try:
        first = tuning.gpu_table(torch.device("cuda", 0))
        assert tuning.gpu_table(torch.device("cuda", 0)) is first
        path = clean_env / "table.json"
        path.write_text(json.dumps({"prefill": {"paged_fresh_max_tokens": 77}}))
        monkeypatch.setenv("FUSEDIST_TUNING_FILE", str(path))
        assert tuning.knobs("prefill", torch.device("cuda", 0))["paged_fresh_max_tokens"] != 77
        tuning.clear_cache()
        assert tuning.knobs("prefill", torch.device("cuda", 0))["paged_fresh_max_tokens"] == 77
    finally:
        monkeypatch.delenv("FUSEDIST_TUNING_FILE")
        tuning.clear_cache()
