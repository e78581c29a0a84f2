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


@pytest.mark.parametrize("world,like", [(1, 2), (3, 2), (4, 2), (6, 8), (7, 8), (16, 8)])
def test_choose_falls_back_to_nearest_world_size(world, like):
    for nbytes in (1, 64 * KB + 1, 4 * MB + 1, 8 * MB + 1):
        assert tuning.choose(TABLE, nbytes, world) == tuning.choose(TABLE, nbytes, like), \
            (world, nbytes)


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
