"""The shardcast.vllm backend's tests, against a real vLLM on the CPU: they run in the vLLM venv
(`bash scripts/test-vllm.sh`, which `scripts/deps.sh vllm` prepares)."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

try:
    import vllm  # noqa: F401
except ImportError:  # the main test venv: these tests are scripts/test-vllm.sh's
    collect_ignore_glob = ["test_*.py"]


# A vLLM whose engine runs in the calling process (no engine-core process; at TP=1 the scripts add
# the "uni" executor: no worker process either): the same model code and numbers, a third of the
# start-up. For fresh references and probes; the backend's own tests run vLLM as deployed.
IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


class Zygote:
    """The tests' scripts, each run as a fork of zygote.py: one process for the session that imports
    vLLM, torch and transformers once (11-13 CPU-seconds each script paid before), then runs each
    script as `python SCRIPT ARGS...` would, in a session of its own. Started on first use, and
    again after it died (the scripts it ran are then reported, not waited for)."""

    def __init__(self) -> None:
        self.proc = None
        self.log_dir: Path | None = None  # the session's (the `_zygote` fixture)
        self.lock = threading.Condition()
        self.exits: dict = {}  # pid -> exit code (a pid started again: forgotten when it starts)
        self.running: set = set()  # pids started and not yet exited

    def start(self, script: str, args, env: dict, stdout: Path, stderr: Path) -> int:
        """Starts `script` (a file of this directory) with `args` and environment `env` in this
        directory, its output in `stdout` and `stderr`; returns its pid (its process group's too)."""
        if self.proc is None or self.proc.poll() is not None:
            self._spawn()
        request = {"run": str(HERE / script), "args": list(args), "env": env, "cwd": os.getcwd(),
                   "stdout": str(stdout), "stderr": str(stderr)}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        try:
            pid = self.started.get(timeout=300)  # the first: once vLLM is imported
        except queue.Empty:
            raise AssertionError(f"zygote.py did not start {script} within 300 s: see {self.log_path}")
        assert pid is not None, f"zygote.py exited ({self.proc.poll()}) before starting {script}: see {self.log_path}"
        return pid

    def wait(self, pid: int, timeout: float | None) -> int | None:
        """The exit code of `pid` (minus a signal's number), or None when it still runs after `timeout`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.lock:
            while pid not in self.exits:
                if pid not in self.running:
                    raise AssertionError(f"zygote.py exited while pid {pid} ran: see {self.log_path}")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self.lock.wait(timeout=1.0 if left is None else min(left, 1.0))
            return self.exits[pid]

    def end(self, pid: int, grace: float = 60) -> list:
        """Ends what is left of `pid`'s process group (the vLLM processes its script started): waits
        up to `grace` seconds for them to exit, then kills them. Returns the pids killed."""
        deadline = time.monotonic() + grace
        while True:
            left = [int(d) for d in os.listdir("/proc") if d.isdigit() and _process_group(int(d)) == pid]
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        _kill_group(pid)
        return left

    def kill(self, pid: int) -> None:
        """Kills `pid`'s process group (the script and the vLLM processes it started) and reaps it."""
        _kill_group(pid)
        try:
            self.wait(pid, timeout=60)
        except AssertionError:
            pass  # the zygote died: nothing left to reap

    def _spawn(self) -> None:
        self.log_path = (self.log_dir or Path(tempfile.mkdtemp(prefix="zygote-"))) / "zygote.log"
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
        self.log = open(self.log_path, "w")
        self.started: queue.Queue = queue.Queue()  # this zygote's: a dead one's end is not the next one's
        with self.lock:
            self.running.clear()  # the dead zygote's scripts: their waits raise
            self.lock.notify_all()
        self.proc = subprocess.Popen([sys.executable, str(HERE / "zygote.py")], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
        threading.Thread(target=self._read, args=(self.proc, self.started), daemon=True).start()

    def _read(self, proc, started: queue.Queue) -> None:
        try:
            for line in proc.stdout:
                message = json.loads(line)
                with self.lock:
                    if "started" in message:
                        self.exits.pop(message["started"], None)  # a pid used again
                        self.running.add(message["started"])
                    else:
                        self.running.discard(message["exited"])
                        self.exits[message["exited"]] = message["code"]
                    self.lock.notify_all()
                if "started" in message:
                    started.put(message["started"])
        finally:
            started.put(None)
            with self.lock:
                if self.proc is proc:
                    self.running.clear()
                self.lock.notify_all()

    def close(self) -> None:
        """Ends the zygote, and kills whatever it started that still runs."""
        if self.proc is not None:
            with self.lock:
                running = list(self.running)
            for pid in running:
                self.kill(pid)
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.log.close()


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # nothing left in it


def _process_group(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return None if fields[0] == "Z" else int(fields[2])  # a zombie holds nothing


ZYGOTE = Zygote()


@pytest.fixture(scope="session", autouse=True)
def _zygote(tmp_path_factory):
    # vLLM's ZeroMQ sockets outlive its processes that are killed: they go to this session's
    # directory (pytest keeps the last three), not to /tmp.
    saved = os.environ.get("VLLM_RPC_BASE_PATH")
    os.environ["VLLM_RPC_BASE_PATH"] = str(tmp_path_factory.mktemp("zmq"))
    ZYGOTE.log_dir = tmp_path_factory.mktemp("zygote")
    yield ZYGOTE
    ZYGOTE.close()
    if saved is None:
        os.environ.pop("VLLM_RPC_BASE_PATH")
    else:
        os.environ["VLLM_RPC_BASE_PATH"] = saved


def script_env(tp: int = 1, env_extra: dict | None = None) -> dict:
    """The environment a script of this directory runs in: this one's, this directory on the path, a
    core per rank at TP=2, then `env_extra`."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    if tp == 2:
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per TP rank
    env.update(env_extra or {})
    return env


def run_script(script: str, *args: str, timeout: float = 600, tp: int = 1, env_extra: dict | None = None) -> dict:
    """Runs a script of this directory in its own process, a fork of the zygote (vLLM starts its
    engine processes), and returns the JSON it printed on its RESULT line. A script still running
    after `timeout` seconds is killed with every process it started; a script that leaves processes
    running for a minute after it exited fails (they are killed), as one whose pipes they held did."""
    with tempfile.TemporaryDirectory(prefix="run_script-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        pid = ZYGOTE.start(script, args, script_env(tp, env_extra), out, err)
        code, left = None, []
        try:
            code = ZYGOTE.wait(pid, timeout)
        finally:
            if code is None:  # past its timeout, or this test was interrupted
                ZYGOTE.kill(pid)
            else:
                left = ZYGOTE.end(pid)
        stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
    said = f"still running after {timeout:.0f} s, killed" if code is None else f"exit {code}"
    if left:
        raise AssertionError(f"{script} {' '.join(args)} ({said}) left processes {left} running a minute "
                             f"after it exited (killed):\n{what_failed(stderr)}\n{stdout[-4000:]}\n{stderr[-8000:]}")
    for line in stdout.splitlines():
        if code is not None and line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise AssertionError(f"{script} {' '.join(args)} printed no result ({said}):\n{what_failed(stderr)}\n"
                         f"{stdout[-4000:]}\n{stderr[-8000:]}")


def what_failed(stderr: str) -> str:
    """A failed script's story first, ahead of vLLM's log (which may push it out of a CI report):
    the daemons' and the package's warnings, then the script's last traceback."""
    said = [line for line in stderr.splitlines()
            if "[shardcast]" in line or line.startswith("shardcast:") or "shardcast: " in line[:80]]
    start = stderr.rfind("Traceback (most recent call last)")
    traceback = stderr[start:][-4000:] if start >= 0 else "(no traceback)"
    return "== shardcast said:\n" + "\n".join(line[:600] for line in said[-30:]) + "\n== the traceback:\n" + \
        traceback + "\n== the output's tails:"


class Fresh:
    """The references: what a vLLM started fresh serves. At TP=1 every engine runs in the script's
    process (run_generate.py, run_lora_generate.py); at TP >= 2, full weights come from
    run_generate.py's ranks under vLLM's external launcher (`_ranks`), and adapters from
    run_lora_generate.py (one engine: its worker processes cost what the ranks would)."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir

    def served(self, tp, *models: str) -> list:
        """What a fresh vLLM at `tp` serves from each model directory, in order."""
        if str(tp) != "1":
            return self._ranks(int(str(tp).rstrip("ep")), "run_generate.py", str(tp), *models)["served"]
        return run_script("run_generate.py", "1", *models, env_extra=IN_PROCESS)["served"]

    def served_lora(self, tp, model: str, *adapters: str) -> dict:
        """A fresh vLLM at `tp` on `model` serving each adapter directory, then none."""
        return run_script("run_lora_generate.py", str(tp), model, *adapters, tp=int(tp), env_extra=IN_PROCESS)

    def _ranks(self, world: int, script: str, *args: str, timeout: float = 600) -> dict:
        """Runs `script` as `world` processes, the ranks of vLLM's "external_launcher" (each a
        tensor-parallel rank that stays from engine to engine: the worker processes vLLM would start
        for each engine, and their imports, saved), one core each; returns rank 0's RESULT. A rank
        that fails or outlives the timeout stops them all, and its output is named. Rank 0 serves
        the ranks' store on a free port it binds only later (vLLM's env:// rendezvous): one taken by
        another socket meanwhile (CI saw EADDRINUSE) runs them again on another, twice at most."""
        from engines import free_port

        for attempt in range(3):
            try:
                return self._ranks_once(world, free_port(), script, *args, timeout=timeout)
            except _PortTaken:
                if attempt == 2:
                    raise

    def _ranks_once(self, world: int, port: int, script: str, *args: str, timeout: float) -> dict:
        logs = [self.log_dir / f"{script}.{port}.rank{r}.log" for r in range(world)]
        pids = []
        try:
            for r in range(world):
                env = script_env(env_extra=dict(IN_PROCESS, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world),
                                                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
                env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(map(str, range(world))))  # a core per rank
                pids.append(ZYGOTE.start(script, args, env, logs[r], logs[r]))
            deadline = time.monotonic() + timeout
            codes = [None] * world
            while None in codes:
                codes = [ZYGOTE.wait(pid, timeout=0) for pid in pids]
                failed = [r for r, code in enumerate(codes) if code not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    r = failed[0] if failed else codes.index(None)
                    said = logs[r].read_text(errors="replace")
                    taken = failed and "EADDRINUSE" in logs[0].read_text(errors="replace")  # rank 0 serves the store
                    error = _PortTaken if taken else AssertionError
                    raise error(f"{script} {' '.join(args)}, rank {r} of {world}: "
                                f"{'exit ' + str(codes[r]) if failed else 'no result in time'}:\n{said[-8000:]}")
                time.sleep(0.5)
            for line in logs[0].read_text(errors="replace").splitlines():
                if line.startswith("RESULT "):
                    return json.loads(line[len("RESULT "):])
            raise AssertionError(f"{script} {' '.join(args)}: rank 0 printed no result")
        finally:
            for pid in pids:
                ZYGOTE.kill(pid)  # a rank still running (another failed), or what an exited one left


class _PortTaken(AssertionError):
    """The rendezvous port of Fresh's ranks was taken before rank 0 bound it."""


@pytest.fixture(scope="session")
def fresh(tmp_path_factory):
    """The references, a fresh vLLM's (Fresh)."""
    return Fresh(tmp_path_factory.mktemp("fresh"))


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    from models import make_llama, make_qwen3_moe

    root = tmp_path_factory.mktemp("models")
    return {
        # GQA (4 query heads, 2 KV heads), untied lm_head, a vocab of 512 (no padding)
        "llama": make_llama(str(root / "llama")),
        # tied embeddings, one KV head (replicated at TP=2), a vocab of 500 (padded to 512)
        "llama_tied": make_llama(str(root / "llama_tied"), vocab=500, layers=1, kv_heads=1, tied=True, seed=1),
        # the same in 2 layers: pipeline stages, the embedding on the first and (tied) the last
        "llama_tied_2": make_llama(str(root / "llama_tied_2"), vocab=500, kv_heads=1, tied=True, seed=3),
        # 4 experts per layer, 2 per token; the trainer's transformers keeps them fused
        "qwen3_moe": make_qwen3_moe(str(root / "qwen3_moe")),
    }


DP = 2  # the data-parallel server's engines


@pytest.fixture(scope="session")
def run_dp(models, tmp_path_factory):
    """`vllm serve` with DP data-parallel engines of the tied model, through run_recovery.py's
    cases for full weights (test_recovery.py), then through an adapter's steps (test_lora.py): one
    server start (about a minute on 2 cores) for both."""
    out = tmp_path_factory.mktemp("recovery-dp")
    return run_script("run_recovery.py", models["llama_tied"], "1", str(out), str(DP), timeout=900)
