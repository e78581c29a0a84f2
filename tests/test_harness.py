"""The test harness itself (CPU tier): the session's seed (FUSEDIST_TEST_SEED, printed in the
header and with every failure, each test's generators seeded from it and the test's name),
and tests/launch.py's pool (processes forked from a pre-imported forkserver run as `python`
would run them: argv, environment, sys.path, files, exit status, atexit; timeouts; ranks
joining a store on a bound port); the tests' own references to the library (every name they
read from fusedist exists, GPU tests included)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import launch

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
CPU = {"CUDA_VISIBLE_DEVICES": ""}


def _pytest(tmp_path, seed: str):
    t = tmp_path / "test_draw.py"
    t.write_text("import torch\n\n\ndef test_draw():\n"
                 "    print('draw', torch.rand(1).item())\n    assert False\n")
    env = dict(os.environ, FUSEDIST_TEST_SEED=seed, **CPU,
               PYTHONPATH=os.pathsep.join([str(TESTS), str(ROOT)]))
    p = launch.python(["-P", "-m", "pytest", "-s", "-p", "no:cacheprovider", "-p",
                       "conftest", str(t)], env=env, cwd=tmp_path, timeout=300)
    import re

    draw = re.search(r"draw ([0-9.e-]+)", p.stdout)
    assert draw, p.stdout[-3000:]
    return p, draw[1]


def test_seed_printed_with_a_failure_and_reproducible(tmp_path):
    """FUSEDIST_TEST_SEED=77: the header and the failure name it (with the rerun command), and
    two runs draw the same numbers; unset, each run draws fresh ones."""
    p, draw = _pytest(tmp_path, "77")
    assert p.returncode == 1, p.stdout[-3000:]
    assert "fusedist: FUSEDIST_TEST_SEED=77" in p.stdout
    assert "rerun: FUSEDIST_TEST_SEED=77 python3 -P -m pytest" in p.stdout, p.stdout[-3000:]
    assert _pytest(tmp_path, "77")[1] == draw
    fresh = {_pytest(tmp_path, "")[1] for _ in range(2)}
    assert len(fresh) == 2, fresh


def test_seed_shared_by_xdist_workers(tmp_path):
    """Under pytest-xdist (tests/run.sh runs the CPU suite on one worker per core) the seed
    the header prints is the one every worker's failures name: the controller hands its
    session seed to the workers."""
    import re

    pytest.importorskip("xdist")
    t = tmp_path / "test_two.py"
    t.write_text("def test_a():\n    assert False\n\n\ndef test_b():\n    assert False\n")
    env = dict(os.environ, FUSEDIST_TEST_SEED="", **CPU,
               PYTHONPATH=os.pathsep.join([str(TESTS), str(ROOT)]))
    p = launch.python(["-P", "-m", "pytest", "-p", "no:cacheprovider", "-p", "conftest",
                       "-n", "2", str(t)], env=env, cwd=tmp_path, timeout=300)
    assert p.returncode == 1, p.stdout[-3000:]
    header = re.search(r"fusedist: FUSEDIST_TEST_SEED=(\d+)", p.stdout)
    assert header, p.stdout[-3000:]
    named = re.findall(r"rerun: FUSEDIST_TEST_SEED=(\d+) ", p.stdout)
    assert named == [header[1]] * 2, (header[1], named, p.stdout[-3000:])


def test_seed_differs_per_test_and_not_per_order():
    import conftest

    assert conftest.test_seed("a.py::t1") != conftest.test_seed("a.py::t2")
    assert conftest.test_seed("a.py::t1") == conftest.test_seed("a.py::t1")


# ---- the pool --------------------------------------------------------------------------------
PROBE = """
import atexit, json, os, sys, threading
atexit.register(lambda: print("atexit ran", flush=True))
print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(),
                  "env": os.environ.get("PROBE_VALUE"), "cuda": os.environ.get(
                  "CUDA_VISIBLE_DEVICES"), "stdin": sys.stdin.read(),
                  "torch": "torch" in sys.modules, "pid": os.getpid()}), flush=True)
# Started after the JSON line: a print from the thread could otherwise land inside it.
threading.Thread(target=lambda: print("thread joined", flush=True)).start()
print("to stderr", file=sys.stderr)
sys.exit(int(os.environ.get("PROBE_EXIT", "0")))
"""


def test_pooled_python_runs_as_python_would(tmp_path):
    """A script run through the pool: its argv, sys.path[0] (the script's folder; none under
    -P), working directory, environment (its own, not the pool's), stdin, stdout and stderr
    apart, exit status, and at exit its threads joined and atexit handlers run; forked from
    the pre-imported server (torch already loaded), each run its own process."""
    import json

    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    env = dict(os.environ, PROBE_VALUE="v1", PROBE_EXIT="3", **CPU)
    assert launch.pooled(env)
    p = launch.python([str(script), "a", "b"], env=env, cwd=tmp_path, input="in")
    out = json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("{")))
    assert p.returncode == 3 and p.stderr == "to stderr\n", (p.returncode, p.stderr)
    assert out["argv"] == [str(script), "a", "b"] and out["path0"] == str(tmp_path)
    assert out["cwd"] == str(tmp_path) and out["env"] == "v1" and out["stdin"] == "in"
    assert out["cuda"] == "" and out["torch"] and out["pid"] != os.getpid()
    assert "thread joined" in p.stdout and p.stdout.rstrip().endswith("atexit ran")
    q = launch.python(["-P", str(script)], env=dict(env, PROBE_EXIT="0"), cwd=tmp_path)
    out2 = json.loads(next(ln for ln in q.stdout.splitlines() if ln.startswith("{")))
    assert q.returncode == 0 and out2["path0"] != str(tmp_path) and out2["pid"] != out["pid"]
    r = launch.python(["-c", "raise ValueError('boom')"], env=env)
    assert r.returncode == 1 and "ValueError: boom" in r.stderr


def test_real_ranks_finalize_as_python_does():
    """real_ranks' CPU ranks, forked from the pre-imported zygote, end as `python worker`
    does: the non-daemon thread joined, atexit run, then the interpreter finalized (an object
    held in sys.modules collected while finalizing, which os._exit never does); each rank
    its own process; sys.exit's status and an uncaught exception's 1 reach the caller; a rank
    that hangs is killed at the timeout."""
    p = launch.real_ranks("worker_finalize.py", 2, CPU, timeout=120, args=("ok",))
    assert p.returncode == 0, p.stdout
    for r in (0, 1):
        lines = [ln.split(": ", 1)[1] for ln in p.stdout.splitlines()
                 if ln.startswith(f"rank {r}: ")]
        assert lines == ["all checks passed", "thread joined", "atexit ran",
                         "collected while finalizing: True"], p.stdout
    assert launch.real_ranks("worker_finalize.py", 2, CPU, 120, ("exit3",)).returncode == 3
    p = launch.real_ranks("worker_finalize.py", 2, CPU, 120, ("raise",))
    assert p.returncode == 1 and "ValueError: rank 0: boom" in p.stdout
    with pytest.raises(AssertionError, match="timed out after 3s"):
        launch.real_ranks("worker_finalize.py", 2, CPU, 3, ("hang",))
    assert launch.real_ranks("worker_finalize.py", 1, CPU, 120, ("ok",)).returncode == 0


def test_pooled_python_times_out_and_kills(tmp_path):
    env = dict(os.environ, **CPU)
    with pytest.raises(subprocess.TimeoutExpired) as e:
        launch.python(["-u", "-c", "print('started', flush=True); import time; time.sleep(60)"],
                      env=env, timeout=3)
    assert "started" in e.value.output


def test_not_pooled_where_it_must_not_be(monkeypatch):
    """GPU runs on a GPU host, FUSEDIST_TEST_POOL=0, and a variable fusedist reads at import
    set otherwise than in the pool, take a real process."""
    import conftest

    env = dict(os.environ, **CPU)
    assert launch.pooled(env)
    assert not launch.pooled(dict(env, FUSEDIST_COMM_STREAMS="4"))
    monkeypatch.setitem(launch._POOL, "gpus", 2)
    assert not launch.pooled(dict(env, CUDA_VISIBLE_DEVICES="0"))
    assert launch.pooled(env)
    monkeypatch.setenv("FUSEDIST_TEST_POOL", "0")
    assert not launch.pooled(env)


def test_spawned_rank_takes_signals(tmp_path):
    env = dict(os.environ, **CPU)
    with open(tmp_path / "log", "w+") as log:
        p = launch.spawn(["-u", "-c", "print('up', flush=True); import time; time.sleep(60)"],
                         env, log)
        with pytest.raises(subprocess.TimeoutExpired):
            p.wait(timeout=0.5)
        p.send_signal(signal.SIGKILL)
        assert p.wait(timeout=30) == -signal.SIGKILL and p.poll() == -signal.SIGKILL


def test_ranks_rendezvous_on_a_bound_port():
    """torchrun-form runs on the pool: every rank joins the store this process holds (its
    port bound before any rank starts), sees torchrun's environment, and the first failing
    rank's status is the run's."""
    # One write per rank: the ranks share the pipe, and print() writes the text and the
    # newline apart, so lines of ranks that print at once could interleave.
    code = ("import os, fusedist, torch; rt = fusedist.init(backend='gloo'); "
            "x = fusedist.all_reduce(torch.ones(2) * (rt.rank + 1)); "
            "line = f'rank {rt.rank} of {rt.world_size} sum {x.tolist()} ' "
            "+ os.environ['TORCHELASTIC_USE_AGENT_STORE'] + chr(10); "
            "os.write(1, line.encode()); fusedist.shutdown(); "
            "raise SystemExit(5 if rt.rank == 2 and os.environ.get('FAIL') else 0)")
    script = Path(launch.tempfile.mkdtemp()) / "ranks.py"
    script.write_text(code)
    args = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3", str(script)]
    p = launch._run([sys.executable, *args], launch._env(CPU), 120)
    assert p.returncode == 0, p.stdout[-3000:]
    for r in range(3):
        assert f"rank {r} of 3 sum [6.0, 6.0] True" in p.stdout, p.stdout[-3000:]
    p = launch._run([sys.executable, *args], launch._env(dict(CPU, FAIL="1")), 120)
    assert p.returncode == 5, p.stdout[-3000:]


def _library_references(source: str) -> set:
    """(line, module, attribute) for every `alias.name` in a test's source whose alias is a
    fusedist module it imported (`import fusedist.x as a`, `from fusedist.x import m [as a]`,
    `import fusedist`), following submodules (fusedist.ops.attention.plan_kernel)."""
    import ast
    import importlib

    tree = ast.parse(source)
    alias = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "fusedist":
                    alias[a.asname or a.name.split(".")[0]] = a.name if a.asname else "fusedist"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and \
                (node.module or "").split(".")[0] == "fusedist":
            for a in node.names:
                try:
                    importlib.import_module(f"{node.module}.{a.name}")
                except ImportError:
                    continue            # a function or class, not a submodule
                alias[a.asname or a.name] = f"{node.module}.{a.name}"
    refs = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load)):
            continue
        chain, base = [], node
        while isinstance(base, ast.Attribute):
            chain.insert(0, base.attr)
            base = base.value
        if isinstance(base, ast.Name) and base.id in alias:
            refs.add((node.lineno, alias[base.id], tuple(chain)))
    return refs


def _missing(module: str, chain: tuple) -> str:
    """The first name of chain that module (and the submodules along it) lacks, or ""."""
    import importlib
    import types

    obj = importlib.import_module(module)
    for name in chain:
        if not isinstance(obj, types.ModuleType) or obj.__name__.endswith("._C"):
            return ""                   # past the modules (or the extension's bindings)
        if not hasattr(obj, name):
            try:
                obj = importlib.import_module(f"{obj.__name__}.{name}")
                continue
            except ImportError:
                return f"{obj.__name__}.{name}"
        obj = getattr(obj, name)
    return ""


def test_tests_name_only_what_the_library_has():
    """Every `module.name` a test reads from fusedist exists, GPU tests included: a renamed or
    removed switch fails here on the CPU instead of erroring only where a GPU runs the test
    (a decode test once read a removed fusedist.ops.attention._decode.CLUSTER_MERGE)."""
    gone = []
    for f in sorted(TESTS.rglob("*.py")):
        for line, module, chain in sorted(_library_references(f.read_text())):
            name = _missing(module, chain)
            if name:
                gone.append(f"{f.relative_to(ROOT)}:{line}: {name}")
    assert not gone, "tests read names the library does not have:\n" + "\n".join(gone)


def test_library_references_see_a_removed_name():
    src = ("from fusedist.ops.attention import _decode as ad\nimport fusedist\n"
           "x = ad.CLUSTER_MERGE\ny = fusedist.ops.attention._decode.plan_kernel\n"
           "z = fusedist.no_such_thing\n")
    missing = {_missing(m, c) for _, m, c in _library_references(src)} - {""}
    assert missing == {"fusedist.ops.attention._decode.CLUSTER_MERGE",
                       "fusedist.no_such_thing"}


def test_rare_count_bound_is_the_binomial_tail():
    """tolerances.rare_count_bound against the binomial tail summed exactly (fractions): the
    smallest k with P(X > k) < tail, for small and large n."""
    import math
    from fractions import Fraction

    from tolerances import rare_count_bound

    def exact(n, p, tail):
        p = Fraction(p)
        cdf = Fraction(0)
        for k in range(n + 1):
            cdf += math.comb(n, k) * p ** k * (1 - p) ** (n - k)
            if 1 - cdf < tail:
                return k
        return n

    for n, p, tail in ((512, 1e-3, 1e-6), (100, 0.05, 1e-3), (7, 0.5, 0.01), (1, 1e-3, 1e-6),
                       (3000, 1e-3, 1e-6)):
        assert rare_count_bound(n, p, tail) == exact(n, p, tail), (n, p, tail)
    assert rare_count_bound(10**6, 1e-3) > 1000     # no underflow to "every element"
    assert rare_count_bound(10**6, 1e-3) < 1200


def test_worker_check_selection_refuses_typos(monkeypatch):
    """tests/dist/_checks.selected: FUSEDIST_TEST_ONLY picks the checks whose name contains it
    and FUSEDIST_TEST_SKIP leaves whole names out; a selection that matches nothing, or a
    skipped name no check has, stops the worker (a typo must not make a run that checks
    nothing and passes)."""
    monkeypatch.syspath_prepend(str(TESTS / "dist"))
    import _checks

    def alpha():
        pass

    def beta_fused():
        pass

    monkeypatch.setattr(_checks, "CHECKS", [alpha, beta_fused])
    monkeypatch.delenv("FUSEDIST_TEST_ONLY", raising=False)
    monkeypatch.delenv("FUSEDIST_TEST_SKIP", raising=False)
    assert _checks.selected() == [alpha, beta_fused]
    monkeypatch.setenv("FUSEDIST_TEST_ONLY", "fused")
    assert _checks.selected() == [beta_fused]
    assert _checks.selected("alp") == [alpha]  # the argument wins over the environment
    monkeypatch.setenv("FUSEDIST_TEST_ONLY", "fsued")
    with pytest.raises(SystemExit, match="FUSEDIST_TEST_ONLY='fsued' matches no check"):
        _checks.selected()
    monkeypatch.delenv("FUSEDIST_TEST_ONLY")
    monkeypatch.setenv("FUSEDIST_TEST_SKIP", "alpha, beta")
    with pytest.raises(SystemExit, match=r"FUSEDIST_TEST_SKIP names no check.*'beta'"):
        _checks.selected()
    monkeypatch.setenv("FUSEDIST_TEST_SKIP", "alpha")
    assert _checks.selected() == [beta_fused]
