"""python -m fusedist.generate: its flags and defaults, the JSON and text reports of a run, every
user mistake as one line (flags, checkpoints, positions, memory), the hand-over of benchmark
flags to the harness (tests/benchmarks/test_model_run.py tests the harness itself). CPU
tier, the tiny config."""

from __future__ import annotations

import json
import os
import sys
from statistics import median

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fusedist.generate import _defaults, parse_args, parse_baselines  # noqa: E402
from launch import ROOT, python  # noqa: E402
from model_fixtures import rt  # noqa: E402,F401 - the shared runtime fixture

CPU_ENV = {"CUDA_VISIBLE_DEVICES": ""}


def test_parse_baselines():
    assert parse_baselines("torch") == ["torch"]
    assert parse_baselines("torch,torch-compile") == ["torch", "torch-compile"]
    assert parse_baselines(" torch-compile , torch ") == ["torch-compile", "torch"]
    assert parse_baselines("none") == []
    for bad in ("cuda", "torch,torch", "none,torch", "", ",", "torch-compiled"):
        with pytest.raises(SystemExit, match="--baseline takes 'none' or a comma-separated"):
            parse_baselines(bad)


def test_defaults_pick_baselines():
    a = _defaults(parse_args([]), cuda=False, harness=True)      # the embedded default
    assert a.config == "tiny" and a.baselines == ["torch"]
    a = _defaults(parse_args([]), cuda=False, harness=False)     # an installed package alone
    assert a.config == "tiny" and a.baselines == []
    a = _defaults(parse_args(["--config", "tiny", "--random-weights"]), cuda=False)
    assert a.baselines == [] and a.prefill_reps == 3 and a.compile_backend == "inductor"
    a = _defaults(parse_args(["--baseline", "torch-compile,torch"]), cuda=False)
    assert a.baselines == ["torch-compile", "torch"]
    with pytest.raises(SystemExit, match="--prefill-reps must be >= 1"):
        _defaults(parse_args(["--prefill-reps", "0"]), cuda=False)


def _cli(args, json_out=True, timeout=240):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **CPU_ENV)
    p = python(["-P", "-m", "fusedist.generate", *args, "--quiet", "--device", "cpu"]
               + (["--json"] if json_out else []), env=env, timeout=timeout)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1]) if json_out else p.stdout


TINY = ["--config", "tiny", "--random-weights", "--batch", "2", "--prompt-len", "9",
        "--max-new-tokens", "7"]


def test_cli_runs_the_model_and_reports(rt):
    """A plain run: the ids are the Runner's for the same request, the JSON has the run's
    timings and no baseline; --dtype takes the short names it lists; the text report too."""
    from fusedist.models import LlamaConfig, Runner, build_model
    from fusedist.models.llama import RandomWeights

    out = _cli(TINY + ["--dtype", "fp32"])
    assert out["baselines"] == [] and list(out["timings"]) == ["fusedist"]
    t = out["timings"]["fusedist"]
    assert t["decode_steps"] == 6 and t["prefill_ms"] > 0 and t["tokens_per_s"] > 0
    cfg = LlamaConfig.named("tiny")
    m = build_model(cfg, RandomWeights(cfg, seed=0), dtype=torch.float32, device="cpu",
                    max_position=16)
    prompts = torch.randint(0, cfg.vocab_size, (2, 9),
                            generator=torch.Generator().manual_seed(0)).tolist()
    assert prompts[0] == out["prompt_ids"]
    assert Runner(m, max_batch=2, max_seq_len=16).generate(prompts, 7).ids == out["ids"]
    assert _cli(TINY + ["--dtype", "bf16"])["dtype"] == "bfloat16"
    text = _cli(TINY, json_out=False)
    assert "model tiny" in text and "ms/token" in text and "ids[0]:" in text


@pytest.mark.skipif(getattr(torch, "float8_e4m3fn", None) is None, reason="no float8_e4m3fn")
def test_cli_fp8_kv_cache():
    """--kv-dtype fp8: the cache in e4m3 (half the bytes of bf16 plus the scales)."""
    t = _cli(TINY + ["--kv-dtype", "fp8"])["timings"]["fusedist"]
    assert t["kv_dtype"] == "float8_e4m3fn" and t["decode_steps"] == 6


def test_harness_of_an_installed_package_is_the_working_directory_checkouts(monkeypatch, tmp_path):
    """An installed fusedist (no benchmarks/ beside the package) run from a checkout finds the
    checkout's harness; run elsewhere, none (and the package's own checkout wins when it has
    one)."""
    import fusedist.generate as g

    checkout = ROOT / "benchmarks" / "_model_run.py"
    monkeypatch.setattr(g, "__file__", str(ROOT / "fusedist" / "generate.py"))  # imported here
    monkeypatch.chdir(tmp_path)
    assert g._find_harness() == checkout          # the package's own checkout, from anywhere
    site = tmp_path / "site-packages" / "fusedist"
    site.mkdir(parents=True)
    monkeypatch.setattr(g, "__file__", str(site / "generate.py"))                # installed
    monkeypatch.chdir(ROOT)
    assert g._find_harness() == checkout
    monkeypatch.chdir(tmp_path)
    assert not g._find_harness().is_file()


def test_benchmark_flags_without_the_harness(monkeypatch, tmp_path):
    """An installation without benchmarks/, run outside a checkout: a benchmark flag is one
    line saying where to run it; the embedded default runs alone. The lookup is the run's,
    not the import's: this process imported fusedist.generate where a harness was found."""
    import fusedist.generate as g

    site = tmp_path / "site-packages" / "fusedist"
    site.mkdir(parents=True)
    monkeypatch.setattr(g, "__file__", str(site / "generate.py"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match="--baseline, --compile-backend, --profile, "
                                         "--prefill-reps run the model benchmark's harness"):
        g.main(["--baseline", "torch", "--device", "cpu"])
    assert not g._uses_harness([], parse_args([]))
    assert not g._uses_harness(["--baseline", "none"], parse_args(["--baseline", "none"]))


def _run(args, code=None, timeout=240):
    """The CLI in a subprocess (or `python -c code` with these arguments), its address space
    capped at 8 GiB so that a run that would allocate too much fails instead of swapping."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **CPU_ENV)
    head = ["-c", code] if code is not None else ["-m", "fusedist.generate"]
    return python(["-P", *head, *args, "--quiet", "--device", "cpu"], env=env,
                  timeout=timeout, rlimit_as=8 << 30)


def _user_error(args, *needles):
    """A user mistake: exit status 1 or 2, one line on stderr naming it, no traceback."""
    p = _run(args)
    assert p.returncode in (1, 2), (p.returncode, p.stdout[-2000:], p.stderr[-4000:])
    assert "Traceback" not in p.stderr, p.stderr[-4000:]
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fusedist.generate: "), p.stderr[-4000:]
    for n in needles:
        assert n in lines[0], (n, lines[0])
    assert p.stdout == ""
    return lines[0]


BAD_FLAGS = {
    "batch": (["--batch", "0"], "--batch must be >= 1, got 0"),
    "page_size": (["--page-size", "0"], "--page-size must be >= 1, got 0"),
    "prefill_chunk": (["--prefill-chunk", "0"], "--prefill-chunk must be >= 1, got 0"),
    "context_fill": (["--context-fill", "-1"], "--context-fill must be >= 0, got -1"),
    "max_new_tokens": (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    "prompt_len": (["--prompt-len", "0"], "--prompt-len must be >= 1, got 0"),
    "top_p_0": (["--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
    "top_p_big": (["--top-p", "1.5"], "--top-p must be in (0, 1], got 1.5"),
    "top_p_nan": (["--top-p", "nan"], "--top-p must be in (0, 1], got nan"),
    "top_k": (["--top-k", "-1"], "--top-k must be >= 0, got -1"),
    "tp": (["--tp", "0"], "--tp must be >= 1, got 0"),
    "temperature": (["--temperature", "-0.5"],
                    "--temperature must be a finite number >= 0, got -0.5"),
    "temperature_nan": (["--temperature", "nan"],
                        "--temperature must be a finite number >= 0, got nan"),
    "temperature_inf": (["--temperature", "inf"],
                        "--temperature must be a finite number >= 0, got inf"),
    "kv_budget": (["--kv-budget-gb", "0"], "--kv-budget-gb must be a finite number > 0, got 0.0"),
    "model_missing": (["--model", "/nonexistent/ckpt"],
                      "--model '/nonexistent/ckpt' is not a directory"),
}


@pytest.mark.parametrize("case", list(BAD_FLAGS))
def test_bad_flag_is_refused(case):
    argv, msg = BAD_FLAGS[case]
    with pytest.raises(SystemExit) as e:
        _defaults(parse_args(argv), cuda=False)
    assert str(e.value).startswith("fusedist.generate: ") and msg in str(e.value), str(e.value)


def test_config_and_model_together(tmp_path):
    with pytest.raises(SystemExit, match="--config and --model both given; drop --config"):
        _defaults(parse_args(["--model", str(tmp_path), "--config", "tiny"]), cuda=False)


def _one_layer_config(d, **kw):
    (d / "config.json").write_text(json.dumps(dict(
        architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=32, intermediate_size=48,
        num_hidden_layers=1, num_attention_heads=4, **kw)))


def _bad_tensor_checkpoint(d):
    from safetensors.torch import save_file

    from fusedist.models import LlamaConfig
    from fusedist.models.llama import RandomWeights
    from fusedist.models.llama.weights import hf_names

    _one_layer_config(d)
    cfg = LlamaConfig.from_dir(str(d))
    t = {n: RandomWeights(cfg).read(n, dtype=torch.float32, device="cpu") for n in hf_names(cfg)}
    t["model.layers.0.mlp.up_proj.weight"] = torch.zeros(47, 32)
    save_file(t, str(d / "model.safetensors"))


USER_ERRORS = {
    "model_missing": (None, ["--model", "{d}/nope"], ["is not a directory"]),
    "batch": (None, ["--config", "tiny", "--random-weights", "--batch", "0"],
              ["--batch must be >= 1"]),
    "architecture": (lambda d: (d / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"]})), ["--model", "{d}"],
        ["architecture 'GPT2LMHeadModel' is not supported"]),
    "rope_type": (lambda d: _one_layer_config(d, rope_scaling={"rope_type": "yarn",
                                                               "factor": 4.0}),
                  ["--model", "{d}", "--random-weights"], ["rope_scaling type 'yarn'"]),
    # a checkpoint whose tensor disagrees with its config.json: named, with its file
    "tensor_shape": (_bad_tensor_checkpoint, ["--model", "{d}"],
                     ["'model.layers.0.mlp.up_proj.weight'", "model.safetensors", "[47, 32]"]),
}


@pytest.mark.parametrize("case", list(USER_ERRORS))
def test_cli_user_error_is_one_line(tmp_path, case):
    make, argv, needles = USER_ERRORS[case]
    if make is not None:
        make(tmp_path)
    _user_error([a.replace("{d}", str(tmp_path)) for a in argv], *needles)


def test_cli_too_many_positions():
    """prompt + new tokens past max_position_embeddings: refused up front, naming it."""
    line = _user_error(["--config", "tiny", "--random-weights", "--prompt-len", "2040",
                        "--max-new-tokens", "16"], "max_position_embeddings", "2048")
    assert "2056" in line and "sliding window" not in line, line


def test_cli_memory_estimate_refuses_before_allocating():
    """A KV cache no host holds (4096 x 100K tokens of Llama-3.1-8B): refused before the model
    is built, naming the estimate's parts (the 8 GiB address-space cap would fail an attempt)."""
    _user_error(["--config", "llama-3.1-8b", "--random-weights", "--batch", "4096",
                 "--context-fill", "100000", "--prompt-len", "1", "--max-new-tokens", "1"],
                "memory", "KV cache", "weights", "--batch")


def test_memory_estimate_matches_the_model(rt):
    from fusedist.generate import memory_estimate
    from fusedist.models import LlamaConfig, Runner, build_model
    from fusedist.models.llama import RandomWeights

    tiny = LlamaConfig.named("tiny").replace(vocab_size=509)      # padded to 512 rows
    for cfg, max_position, batch, seq, page in (
            (tiny, 50, 3, 50, 16), (tiny, 300, 1, 300, 7),
            (tiny.replace(qkv_bias=True, o_bias=True), 40, 2, 40, 16)):   # attention_bias
        m = build_model(cfg, RandomWeights(cfg), dtype=torch.float32, device="cpu",
                        max_position=max_position)
        est = memory_estimate(cfg, tp=1, dtype=torch.float32, batch=batch, seq_len=seq,
                              page_size=page, prefill_chunk=64)
        held = sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()])
        assert est["weights"] == held
        assert est["kv_cache"] == Runner(m, max_batch=batch, max_seq_len=seq,
                                         page_size=page).kv_bytes
        assert est["activations"] > 0
        assert est["total"] == est["weights"] + est["kv_cache"] + est["activations"]
    cfg = tiny
    # TP 2 holds half the sharded weights; the embedding and norms stay whole
    half = memory_estimate(cfg, tp=2, dtype=torch.float32, batch=1, seq_len=50, page_size=16,
                           prefill_chunk=64)
    full = memory_estimate(cfg, tp=1, dtype=torch.float32, batch=1, seq_len=50, page_size=16,
                           prefill_chunk=64)
    assert half["kv_cache"] * 2 == full["kv_cache"]
    assert full["weights"] / 2 < half["weights"] < full["weights"]
    if getattr(torch, "float8_e4m3fn", None) is not None:   # --kv-dtype fp8: as Runner sizes it
        m = build_model(cfg, RandomWeights(cfg), dtype=torch.float32, device="cpu",
                        max_position=50)
        est = memory_estimate(cfg, tp=1, dtype=torch.float32, batch=3, seq_len=50, page_size=16,
                              prefill_chunk=64, kv_fp8=True)
        assert est["kv_cache"] == Runner(m, max_batch=3, max_seq_len=50, page_size=16,
                                         kv_dtype=torch.float8_e4m3fn).kv_bytes


# ---- flags that reach the run -----------------------------------------------------------------
FLAGS = ["--config", "tiny", "--random-weights", "--batch", "2", "--prompt-ids", "3,1,4,1,5",
         "--max-new-tokens", "8"]


def test_cli_seed_drives_sampling():
    """--seed: the same seed samples the same ids, another seed other ids (temperature 1 over
    random weights: 16 draws from a 512-token vocabulary agreeing by chance is ~0)."""
    runs = {seed: _cli(FLAGS + ["--temperature", "1.0", "--seed", seed])["ids"]
            for seed in ("1", "2")}
    assert _cli(FLAGS + ["--temperature", "1.0", "--seed", "1"])["ids"] == runs["1"]
    assert runs["1"] != runs["2"], runs


def test_cli_weights_seed_picks_the_random_weights():
    """--weights-seed: the same seed builds the same random weights (same greedy ids), another
    seed other weights (other ids); --seed does not change greedy ids."""
    a = _cli(FLAGS + ["--greedy", "--weights-seed", "0"])["ids"]
    assert _cli(FLAGS + ["--greedy", "--weights-seed", "0", "--seed", "9"])["ids"] == a
    assert _cli(FLAGS + ["--greedy", "--weights-seed", "3"])["ids"] != a


RECORD_RUNNER = """
import json, sys
import fusedist.models as models
import fusedist.generate as generate
seen = []
class Recorded(models.Runner):
    def __init__(self, *a, **kw):
        seen.append({k: kw.get(k) for k in ("cuda_graphs", "prefill_graph_tokens")})
        super().__init__(*a, **kw)
models.Runner = Recorded
rc = generate.main(sys.argv[1:])
print("RUNNERS " + json.dumps(seen), flush=True)
sys.exit(rc)
"""


def _runner_kwargs(extra):
    p = _run(FLAGS + ["--json"] + extra, code=RECORD_RUNNER)
    assert p.returncode == 0, p.stderr[-3000:]
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("RUNNERS "))
    return json.loads(line[len("RUNNERS "):])


def test_cli_graph_flags_reach_the_runner():
    """--no-graphs gives every Runner cuda_graphs=False (unset: None, graphs where the device
    has them), --prefill-graph-tokens N its prefill_graph_tokens (default 512); a negative one
    is one line naming the flag."""
    assert _runner_kwargs([]) == [{"cuda_graphs": None, "prefill_graph_tokens": 512}]
    assert _runner_kwargs(["--no-graphs", "--prefill-graph-tokens", "96"]) == \
        [{"cuda_graphs": False, "prefill_graph_tokens": 96}]
    assert _runner_kwargs(["--prefill-graph-tokens", "0", "--baseline", "torch"]) == \
        [{"cuda_graphs": None, "prefill_graph_tokens": 0}] * 2
    p = _run(FLAGS + ["--prefill-graph-tokens", "-1"])
    assert p.returncode != 0 and "prefill" in p.stderr and "Traceback" not in p.stderr, \
        p.stderr[-2000:]
