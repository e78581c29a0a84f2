"""Start multi-process test workers and Python subprocesses; a worker that hangs is killed at
the timeout (the test fails, the suite goes on).

CPU runs (CUDA_VISIBLE_DEVICES="" in their environment, or a host without GPUs) start from a
pre-imported process: a forkserver that imported torch and fusedist once per test session
forks each rank or subprocess, which then runs its script, module or -c code as `python` would
(its own environment, argv, sys.path, working directory, stdin / stdout / stderr files, exit
status, atexit handlers). That saves each process the interpreter's and torch's start-up
(seconds of CPU each), which was most of the multi-rank tests' time. GPU runs, and tests of a
launcher itself (torchrun(..., launcher=True), mpirun), start real processes; FUSEDIST_TEST_POOL
=0 makes every run a real process.

Ports are bound, never guessed: a pooled multi-rank run's rendezvous store is a TCP store this
process creates on port 0 and holds for the run (the ranks join it as torchrun's agent store);
real torchrun runs take --standalone (torchrun's own rendezvous binds port 0 and hands its
store to the ranks).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
DIST = Path(__file__).resolve().parent / "dist"
# What the forkserver imports once (each pooled process starts with these loaded). fusedist does
# not import torch._dynamo (~2 s of CPU); the CLI runs that compile (--baseline compile) would.
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "fusedist", "fusedist.models",
           "fusedist.generate", "safetensors.torch", "transformers", "launch")


def free_port() -> int:
    """A port that was free a moment ago. Only for launchers that must be given a port and
    cannot take a bound socket or pick one themselves (mpirun's, a separate rendezvous test's);
    another process may take it before the launcher binds it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(extra: dict | None) -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    seed = os.environ.get("FUSEDIST_TEST_SEED") or _session_seed()
    if seed is not None:
        env.setdefault("FUSEDIST_TEST_SEED", str(seed))
    env.update({k: str(v) for k, v in (extra or {}).items()})
    return env


def _session_seed() -> Optional[int]:
    """The pytest session's seed (tests/conftest.py), handed to the workers it starts."""
    conftest = sys.modules.get("conftest")
    return getattr(conftest, "SESSION_SEED", None)


def _log_file(cmd) -> tuple[Path, bool]:
    """The output file of a run and whether it is kept: with FUSEDIST_WORKER_LOG_DIR set one
    kept there, written as the workers print, so a run killed from outside (a CI stage's
    timeout) still leaves their per-check lines behind; else a temporary one."""
    log_dir = os.environ.get("FUSEDIST_WORKER_LOG_DIR")
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
        name = next((Path(c).stem for c in map(str, cmd) if c.endswith(".py")), "worker")
        path = Path(log_dir) / f"{name}-{os.getpid()}-{time.monotonic_ns()}.log"
        path.touch()
        return path, True
    fd, name = tempfile.mkstemp(prefix="fusedist-run-", suffix=".log")
    os.close(fd)
    return Path(name), False


def _run(cmd, env, timeout, pool: bool = True) -> subprocess.CompletedProcess:
    """Run cmd, its output (stdout and stderr) captured through a file. `python ...` commands
    (a script, -m, -c, or one node's torchrun) take the pool where pooled(env) allows it
    (pool=False: a real process, as for a test of the launcher)."""
    cmd = [str(c) for c in cmd]
    path, keep = _log_file(cmd)
    try:
        args = cmd[1:] if cmd[0] == sys.executable else None
        ranks = spec = None
        if pool and args is not None and pooled(env):
            ranks = _torchrun_form(args)
            spec = None if ranks is not None else _spec(args, env, ROOT)
        if ranks is not None:
            status = pooled_ranks(ranks[1], ranks[0], env, timeout, path)
        elif spec is not None:
            out = (str(path), "w")
            spec.update(stdin=(os.devnull, "r"), stdout=out, stderr=out)
            status = _wait(_start_pooled([spec]), timeout)
        else:
            with open(path, "w") as log:
                try:
                    status = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            timeout=timeout, cwd=ROOT).returncode
                except subprocess.TimeoutExpired:
                    status = None
        text = path.read_text()
    finally:
        if not keep:
            path.unlink(missing_ok=True)
    if status is None:
        where = f" (log: {path})" if keep else ""
        raise AssertionError(f"{' '.join(cmd)} timed out after {timeout}s{where}\n{text}")
    return subprocess.CompletedProcess(cmd, status, text, None)


# ---- the pool: processes forked from a pre-imported forkserver ------------------------------
_POOL: dict = {}


def pooled(env: dict) -> bool:
    """Whether a run with this environment starts from the pre-imported forkserver: CPU runs
    (no GPU on the host, or CUDA_VISIBLE_DEVICES empty) unless FUSEDIST_TEST_POOL=0, and
    only with the forkserver's values of the variables fusedist reads at import."""
    if os.environ.get("FUSEDIST_TEST_POOL", "1") == "0" or sys.platform != "linux":
        return False
    if env.get("CUDA_VISIBLE_DEVICES", None) not in ("", "-1"):
        import conftest
        if "gpus" not in _POOL:
            _POOL["gpus"] = conftest.listed_gpus()
        if _POOL["gpus"] > 0:
            return False
    return all(env.get(name) == value for name, value in _import_env().items())


def _import_env() -> dict:
    """The forkserver's values of the variables fusedist reads at import (this process's
    until the forkserver starts)."""
    if "import_env" in _POOL:
        return _POOL["import_env"]
    import fusedist.envs as envs
    return {v.name: os.environ.get(v.name) for v in envs.VARS.values() if "at import" in v.read}


def _clean_sys_path() -> list:
    """sys.path of a fresh interpreter started with -P and without PYTHONPATH: the entries a
    pooled process keeps after its own first entry and its PYTHONPATH."""
    if "sys_path" not in _POOL:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        out = subprocess.run([sys.executable, "-P", "-c", "import json, sys; "
                              "print(json.dumps(sys.path))"], env=env, capture_output=True,
                             text=True, timeout=120, check=True).stdout
        _POOL["sys_path"] = json.loads(out)
    return _POOL["sys_path"]


def _context():
    """The forkserver context, started once: CPU-only (it never sees a GPU), torch and fusedist
    imported before any fork."""
    if "ctx" not in _POOL:
        import multiprocessing
        from multiprocessing import forkserver

        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(list(PRELOAD))
        _POOL["import_env"] = _import_env()
        keep = os.environ.get("CUDA_VISIBLE_DEVICES")
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        try:
            forkserver.ensure_running()
        finally:
            if keep is None:
                del os.environ["CUDA_VISIBLE_DEVICES"]
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = keep
        _clean_sys_path()
        _POOL["ctx"] = ctx
    return _POOL["ctx"]


def shutdown_pool() -> None:
    """Stop the forkserver and wait for it (its CPU time then counts as this process's
    children's); pytest's session end calls it (tests/conftest.py)."""
    _POOL.pop("import_env", None)
    shutdown_zygote()
    if _POOL.pop("ctx", None) is not None:
        from multiprocessing import forkserver

        stop = getattr(forkserver._forkserver, "_stop", None)
        if stop is not None:
            stop()


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _become(spec: dict) -> None:
    """Make this forked process the one the spec describes, as `python` would start it: its
    own process group, environment, working directory, stdin / stdout / stderr files, address
    space limit, torch's thread count from OMP_NUM_THREADS (torch is imported already, so it
    would not read it), sys.path (the script's directory or the working directory first unless
    safe_path, then PYTHONPATH, then the interpreter's own) and argv. The pool's children
    (_child) and the zygote's both start here."""
    import io

    os.setsid()                      # its own process group: a timeout kills its children too
    os.environ.clear()
    os.environ.update(spec["env"])
    os.chdir(spec["cwd"])
    for fd, (path, mode) in enumerate((spec["stdin"], spec["stdout"], spec["stderr"])):
        f = os.open(path, os.O_RDONLY if mode == "r" else os.O_WRONLY | os.O_APPEND)
        os.dup2(f, fd)
        os.close(f)
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True,
                                  write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True,
                                  write_through=True)
    if spec.get("rlimit_as"):
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (spec["rlimit_as"], spec["rlimit_as"]))
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    first = [] if spec["safe_path"] else [spec["path0"]]
    sys.path[:] = first + extra + [p for p in spec["sys_path"] if p not in extra]
    sys.argv = list(spec["argv"])


def _child(spec: dict) -> None:
    """A pooled process: become `python [-P] (script | -m module | -c code) args` with the
    spec's environment and files, run, and exit as that interpreter would."""
    import atexit
    import runpy
    import threading
    import traceback

    _become(spec)
    code = 0
    try:
        kind, target = spec["kind"], spec["target"]
        if kind == "module":
            # preloaded: run it afresh, as `python -m` would (a package: its __main__)
            import importlib.util
            found = importlib.util.find_spec(target)
            package = found is not None and found.submodule_search_locations is not None
            sys.modules.pop(target + ".__main__" if package else target, None)
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        elif kind == "code":
            import types
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(target, "<string>", "exec"), main.__dict__)
        else:
            runpy.run_path(target, run_name="__main__")
    except SystemExit as e:
        code = _exit_code(e.code)
    except BaseException:  # noqa: BLE001 - reported as the interpreter would, exit status 1
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()        # non-daemon threads end first, then atexit, as at exit
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        code = code or 1
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(code)


def _spec(args, env, cwd) -> Optional[dict]:
    """The spec of `python *args` for _child, or None for a form it does not take."""
    args = [str(a) for a in args]
    safe = False
    while args and args[0] in ("-P", "-u", "-B"):
        safe = safe or args[0] == "-P"
        args = args[1:]
    if not args:
        return None
    if args[0] == "-m" and len(args) > 1:
        import importlib.util
        spec = importlib.util.find_spec(args[1])
        origin = spec.origin if spec is not None else args[1]
        return dict(kind="module", target=args[1], argv=[origin] + args[2:], path0=str(cwd),
                    safe_path=safe, env=env, cwd=str(cwd))
    if args[0] == "-c" and len(args) > 1:
        return dict(kind="code", target=args[1], argv=["-c"] + args[2:], path0="",
                    safe_path=safe, env=env, cwd=str(cwd))
    if args[0].startswith("-"):
        return None
    script = Path(cwd, args[0])
    return dict(kind="path", target=str(script), argv=args, safe_path=safe,
                path0=str(script.resolve().parent), env=env, cwd=str(cwd))


def _kill(procs) -> None:
    for p in procs:
        if p.exitcode is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    for p in procs:
        p.join(10)


def _start_pooled(specs: list) -> list:
    """A forked process per spec. They do not import this process's __main__ (pytest's, or a
    script's) as multiprocessing children otherwise do: a pooled process is a fresh `python`."""
    from multiprocessing import spawn

    ctx = _context()
    procs = []
    real = spawn.get_preparation_data

    def without_main(name):
        data = real(name)
        data.pop("init_main_from_name", None)
        data.pop("init_main_from_path", None)
        return data

    spawn.get_preparation_data = without_main
    try:
        for spec in specs:
            spec["sys_path"] = _clean_sys_path()
            p = ctx.Process(target=_child, args=(spec,), daemon=False)
            p.start()
            procs.append(p)
    finally:
        spawn.get_preparation_data = real
    return procs


def _wait(procs, timeout: Optional[float], grace_s: float = 30.0) -> Optional[int]:
    """Wait for every process; when one fails, the others get grace_s to end (a rank waiting in
    a collective the failed one left) and are then killed, as torchrun stops its workers. The
    first non-zero status, 0, or None at the timeout (every process killed)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    failed_at, status = None, 0
    while True:
        alive = [p for p in procs if p.exitcode is None]
        for p in procs:
            if p.exitcode not in (None, 0) and status == 0:
                status, failed_at = p.exitcode, time.monotonic()
        if not alive:
            return status
        now = time.monotonic()
        if deadline is not None and now > deadline:
            _kill(procs)
            return None
        if failed_at is not None and now > failed_at + grace_s:
            _kill(procs)
            return status
        from multiprocessing.connection import wait
        wait([p.sentinel for p in alive], timeout=0.5)


def _torchrun_form(args) -> Optional[tuple[int, list]]:
    """(nproc, target) of `-m torch.distributed.run [options] target...` when its options are
    only one node's (--nproc-per-node, --master-addr / --master-port, --standalone), else
    None."""
    args = [str(a) for a in args]
    while args and args[0] in ("-P", "-u", "-B"):
        args = args[1:]
    if args[:2] != ["-m", "torch.distributed.run"]:
        return None
    rest, nproc = args[2:], 1
    while rest and rest[0].startswith("--"):
        opt = rest[0].replace("_", "-")
        if opt == "--standalone":
            rest = rest[1:]
        elif opt in ("--nproc-per-node", "--master-addr", "--master-port") and len(rest) > 1:
            if opt == "--nproc-per-node":
                if not rest[1].isdigit():
                    return None
                nproc = int(rest[1])
            rest = rest[2:]
        else:
            return None
    return (nproc, rest) if rest else None


def python(args, env: Optional[dict] = None, timeout: Optional[float] = None, cwd=ROOT,
           input: Optional[str] = None, rlimit_as: Optional[int] = None
           ) -> subprocess.CompletedProcess:
    """subprocess.run([sys.executable, *args], capture_output=True, text=True, ...) with
    `env` the whole environment (default: this process's): pooled where pooled(env) allows it
    and the arguments are a script, -m module or -c code (optionally after -P / -u), or
    `-m torch.distributed.run` of one node (its ranks pooled); a real process otherwise.
    rlimit_as caps the address space (bytes). subprocess.TimeoutExpired at the timeout, as
    subprocess.run raises."""
    env = dict(os.environ if env is None else env)
    cmd = [sys.executable, *map(str, args)]
    ok = pooled(env)
    ranks = _torchrun_form(args) if ok else None
    spec = _spec(args, env, cwd) if ok and ranks is None else None
    if spec is None and ranks is None:
        def cap():
            import resource
            resource.setrlimit(resource.RLIMIT_AS, (rlimit_as, rlimit_as))
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                              cwd=cwd, input=input, preexec_fn=cap if rlimit_as else None)
    with tempfile.TemporaryDirectory(prefix="fusedist-py-") as tmp:
        files = {name: Path(tmp, name) for name in ("stdin", "stdout", "stderr")}
        files["stdin"].write_text(input or "")
        files["stdout"].touch()
        files["stderr"].touch()
        if ranks is not None:
            status = pooled_ranks(ranks[1], ranks[0], env, timeout, files["stdout"],
                                  files["stderr"], rlimit_as=rlimit_as)
        else:
            spec.update(stdin=(str(files["stdin"]), "r"), stdout=(str(files["stdout"]), "w"),
                        stderr=(str(files["stderr"]), "w"), rlimit_as=rlimit_as)
            status = _wait(_start_pooled([spec]), timeout)
        out, err = files["stdout"].read_text(), files["stderr"].read_text()
    if status is None:
        raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err)
    return subprocess.CompletedProcess(cmd, status, out, err)


class PooledProcess:
    """A pooled process with the parts of subprocess.Popen's interface tests use."""

    def __init__(self, proc, args):
        self._p, self.args, self.pid = proc, args, proc.pid

    @property
    def returncode(self) -> Optional[int]:
        return self._p.exitcode

    def poll(self) -> Optional[int]:
        return self._p.exitcode

    def wait(self, timeout: Optional[float] = None) -> int:
        self._p.join(timeout)
        if self._p.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._p.exitcode

    def send_signal(self, sig) -> None:
        if self._p.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def spawn(args, env: dict, stdout, cwd=ROOT):
    """subprocess.Popen([sys.executable, *args], env=env, stdout=stdout,
    stderr=subprocess.STDOUT, cwd=cwd) for a file object `stdout` with a name (its output
    appended there); pooled where pooled(env) allows it (a PooledProcess), else a Popen."""
    spec = _spec(args, env, cwd) if pooled(env) else None
    if spec is None:
        return subprocess.Popen([sys.executable, *map(str, args)], env=env, stdout=stdout,
                                stderr=subprocess.STDOUT, cwd=cwd)
    out = (str(stdout.name), "w")
    spec.update(stdin=(os.devnull, "r"), stdout=out, stderr=out)
    return PooledProcess(_start_pooled([spec])[0], [sys.executable, *map(str, args)])


class RendezvousStore:
    """A TCP store this process holds on a port bound for its lifetime (port 0: the kernel
    picks a free one, no other process can take it), which ranks join as torchrun's agent
    store: env() gives them MASTER_ADDR / MASTER_PORT and TORCHELASTIC_USE_AGENT_STORE."""

    def __init__(self, timeout_s: float = 300):
        from datetime import timedelta

        import torch.distributed as dist

        self.store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=timeout_s),
                                   wait_for_workers=False)
        self.port = self.store.port

    def env(self) -> dict:
        return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.port),
                "TORCHELASTIC_USE_AGENT_STORE": "True"}

    def close(self) -> None:
        self.store = None

    def __enter__(self) -> "RendezvousStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _rank_env(env: dict, rank: int, nproc: int, port: int, run_id: str) -> dict:
    """What torchrun (one node, its c10d rendezvous sharing the agent store) gives a worker."""
    e = dict(env)
    e.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank),
             ROLE_NAME="default", WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
             GROUP_WORLD_SIZE="1", ROLE_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1",
             MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True",
             TORCHELASTIC_RUN_ID=run_id, TORCHELASTIC_RESTART_COUNT="0",
             TORCHELASTIC_MAX_RESTARTS="0", TORCH_NCCL_ASYNC_ERROR_HANDLING="1")
    return e


def pooled_ranks(target: list, nproc: int, env: dict, timeout: Optional[float],
                 stdout: Path, stderr: Optional[Path] = None,
                 rlimit_as: Optional[int] = None) -> Optional[int]:
    """`torchrun --nproc-per-node nproc *target` on the pool: nproc ranks of `python *target`
    whose rendezvous is a TCP store this process holds on a port bound for the run. Their
    stdout (and stderr, unless given its own file) is appended to `stdout`. The first non-zero
    exit status, 0, or None at the timeout."""
    with RendezvousStore(timeout or 300) as store, \
            tempfile.NamedTemporaryFile(prefix="fusedist-stdin-") as stdin:
        run_id = uuid.uuid4().hex
        out = (str(stdout), "w")
        err = (str(stderr), "w") if stderr is not None else out
        specs = []
        for r in range(nproc):
            spec = _spec(target, _rank_env(env, r, nproc, store.port, run_id), ROOT)
            assert spec is not None, f"pooled_ranks: cannot run {target}"
            spec.update(stdin=(stdin.name, "r"), stdout=out, stderr=err, rlimit_as=rlimit_as)
            specs.append(spec)
        return _wait(_start_pooled(specs), timeout)


# ---- real interpreters from a pre-imported one: the zygote ----------------------------------
# A process that imported PRELOAD once (CPU-only) and forks a child per requested rank. The
# child leaves the zygote's loop and runs its script at the top level of the zygote's main
# program, so that when the script ends the interpreter finalizes as `python script` does
# (threads joined, atexit, modules torn down, Py_FinalizeEx), not os._exit as the forkserver's
# processes end. Requests and replies are JSON lines on the zygote's stdin / stdout. It imports
# less than the forkserver: every module loaded is torn down again at each child's exit (with
# transformers loaded too, an empty script's exit took 1.4 s instead of 0.8).
ZYGOTE_PRELOAD = ("torch", "torch.distributed", "fusedist", "fusedist.models")
_ZYGOTE = r"""
import json, os, sys
replies = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)                        # what the imports print goes to stderr, not the replies
for name in json.loads(sys.argv[1]):
    __import__(name)


def _serve():
    while True:
        line = sys.stdin.buffer.readline()
        if not line:
            os._exit(0)
        pids = []
        for spec in json.loads(line):
            pid = os.fork()
            if pid == 0:
                replies.close()
                return spec
            pids.append(pid)
        replies.write(json.dumps({"pids": pids}) + "\n")
        replies.flush()
        codes = [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids]
        replies.write(json.dumps({"codes": codes}) + "\n")
        replies.flush()


_spec = _serve()
sys.path.insert(0, _spec["tests_dir"])
from launch import _become           # the pool's children start the same way
_become(_spec)
del replies, _serve, _become
import runpy
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _zygote() -> subprocess.Popen:
    z = _POOL.get("zygote")
    if z is None or z.poll() is not None:
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
        z = subprocess.Popen([sys.executable, "-P", "-c", _ZYGOTE, json.dumps(ZYGOTE_PRELOAD)],
                             env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT,
                             bufsize=0)
        _POOL["zygote"], _POOL["zygote_buf"] = z, bytearray()
    return z


def _zygote_reply(z, timeout: Optional[float]) -> Optional[dict]:
    """The zygote's next reply line, or None at the timeout."""
    import select

    buf, fd = _POOL["zygote_buf"], z.stdout.fileno()
    deadline = None if timeout is None else time.monotonic() + timeout
    while b"\n" not in buf:
        left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        if not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            raise RuntimeError(f"the test zygote exited (status {z.wait()}); its stderr is "
                               "in pytest's captured output")
        buf += chunk
    line, _, rest = bytes(buf).partition(b"\n")
    buf[:] = rest
    return json.loads(line)


def _zygote_run(specs: list, timeout: float) -> list:
    """Each spec ({argv, env, cwd, log}) run by a child of the zygote; their exit codes
    (negative: the signal), or None for every one at the timeout (all killed)."""
    z = _zygote()
    for spec in specs:
        spec.update(sys_path=_clean_sys_path(), tests_dir=str(Path(__file__).resolve().parent),
                    stdin=(os.devnull, "r"), stdout=(spec["log"], "w"),
                    stderr=(spec["log"], "w"), safe_path=False,
                    path0=os.path.dirname(os.path.abspath(spec["argv"][0])))
    z.stdin.write(json.dumps(specs).encode() + b"\n")
    started = _zygote_reply(z, 120)
    if started is None:
        raise RuntimeError("the test zygote did not fork the ranks within 120 s")
    pids = started["pids"]
    reply = _zygote_reply(z, timeout)
    if reply is not None:
        return reply["codes"]
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    _zygote_reply(z, None)
    return [None] * len(pids)


def shutdown_zygote() -> None:
    z = _POOL.pop("zygote", None)
    if z is not None and z.poll() is None:
        z.stdin.close()
        z.wait(30)


def real_ranks(worker: str, nproc: int, env: dict | None = None, timeout: int = 600,
               args=()) -> subprocess.CompletedProcess:
    """tests/dist/<worker> on nproc ranks, each a real interpreter (run and finalized as
    `python worker` is: for tests of what happens at interpreter exit), with torchrun's
    environment and a rendezvous store this process holds on a bound port; no launcher
    process. CPU runs fork the interpreters from the zygote (pre-imported, see _ZYGOTE),
    others start them. Output (stdout and stderr of every rank) in .stdout."""
    e = _env(env)
    cmd = [sys.executable, "-u", str(DIST / worker), *map(str, args)]
    path, keep = _log_file(cmd)
    try:
        with RendezvousStore(timeout) as store:
            run_id = uuid.uuid4().hex
            envs = [_rank_env(e, r, nproc, store.port, run_id) for r in range(nproc)]
            if pooled(e):
                codes = _zygote_run([dict(argv=cmd[2:], env=v, cwd=str(ROOT), log=str(path))
                                     for v in envs], timeout)
                status = None if None in codes else next((c for c in codes if c), 0)
            else:
                status = _popen_ranks(cmd, envs, path, timeout)
        text = path.read_text()
    finally:
        if not keep:
            path.unlink(missing_ok=True)
    if status is None:
        raise AssertionError(f"{' '.join(cmd)} x {nproc} timed out after {timeout}s\n{text}")
    return subprocess.CompletedProcess(cmd, status, text, None)


def _popen_ranks(cmd, envs, path, timeout) -> Optional[int]:
    with open(path, "a") as log:
        procs = [subprocess.Popen(cmd, env=v, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                  start_new_session=True) for v in envs]
        deadline = time.monotonic() + timeout
        status = 0
        for p in procs:
            try:
                rc = p.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                status = None
                break
            status = status or rc
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return status


def torchrun(worker: str, nproc: int, env: dict | None = None, timeout: int = 600,
             args=(), launcher: bool = False) -> subprocess.CompletedProcess:
    """tests/dist/<worker> on nproc ranks as `torchrun --standalone` starts them, its output
    (stdout and stderr) in .stdout: on the pool for CPU runs, torchrun itself for GPU runs and
    with launcher=True (tests of the launch environment torchrun makes)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(nproc), str(DIST / worker), *map(str, args)]
    return _run(cmd, _env(env), timeout, pool=not launcher)


def emulate(worker: str, world: int, env: dict | None = None,
            timeout: int = 600) -> subprocess.CompletedProcess:
    """The worker's checks marked @emulated on `world` ranks emulated on one GPU, in one
    process (tests/dist/emulate.py)."""
    cmd = [sys.executable, str(DIST / "emulate.py"), worker, "--world", str(world)]
    return _run(cmd, _env(env), timeout)


def mpirun_available() -> bool:
    return shutil.which("mpirun") is not None


def mpirun(worker: str, nproc: int, env: dict | None = None, timeout: int = 600,
           args=()) -> subprocess.CompletedProcess:
    e = _env(env)
    e.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    e.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    e.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
    # No MASTER_ADDR: fusedist bootstraps the rendezvous address through mpi4py.
    e.pop("MASTER_ADDR", None)
    e.pop("MASTER_PORT", None)
    e["PYTHON"] = sys.executable  # launchers/mpirun.sh runs "$PYTHON script args"
    cmd = ["bash", str(ROOT / "launchers" / "mpirun.sh"), "-np", str(nproc), "--",
           str(DIST / worker), *args]
    return _run(cmd, e, timeout)


def assert_passed(p: subprocess.CompletedProcess, nproc: int) -> None:
    passed = p.stdout.count("all checks passed")
    assert p.returncode == 0 and passed == nproc, \
        f"exit {p.returncode}, {passed}/{nproc} ranks passed\n{p.stdout[-6000:]}"
    # Checks that could not run on this tier (tests/dist/_checks.py prints "[skip] name
    # (time): reason"): reported in pytest's warnings summary, never counted as passed.
    skipped = [line[len("[skip] "):] for line in p.stdout.splitlines()
               if line.startswith("[skip] ")]
    if skipped:
        warnings.warn(f"{len(skipped)} worker check(s) skipped: " + "; ".join(skipped),
                      SkippedChecks, stacklevel=2)


class SkippedChecks(UserWarning):
    """Worker checks that were skipped (not passed) in a multi-process test."""
