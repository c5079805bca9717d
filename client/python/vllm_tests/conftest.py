"""The shardcast.vllm backend's tests, against a real vLLM on the CPU: they run in the vLLM venv
(`bash scripts/test-vllm.sh`, which `scripts/deps.sh vllm` prepares)."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
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


def run_script(script: str, *args: str, timeout: float = 600, tp: int = 1, env_extra: dict | None = None) -> dict:
    """Runs a script of this directory in its own process (vLLM starts its engine processes) and
    returns the JSON it printed on its RESULT line."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    if tp == 2:
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per TP rank
    env.update(env_extra or {})
    proc = subprocess.run([sys.executable, str(HERE / script), *args], capture_output=True, text=True,
                          timeout=timeout, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise AssertionError(f"{script} {' '.join(args)} printed no result (exit {proc.returncode}):\n"
                         f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")


class Fresh:
    """The references: what a vLLM started fresh serves. At TP=1 (every engine in process) they are
    asked of fresh_server.py, one process for the session, which imports vLLM once; at TP >= 2,
    full weights come from run_generate.py's ranks under vLLM's external launcher (`_ranks`), and
    adapters from run_lora_generate.py (one engine: its worker processes cost what the ranks
    would)."""

    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path
        self.proc = None
        self.lines: queue.Queue = queue.Queue()

    def served(self, tp, *models: str) -> list:
        """What a fresh vLLM at `tp` serves from each model directory, in order."""
        if str(tp) != "1":
            return self._ranks(int(str(tp).rstrip("ep")), "run_generate.py", str(tp), *models)["served"]
        return self._ask({"served": list(models)})["served"]

    def _ranks(self, world: int, script: str, *args: str, timeout: float = 600) -> dict:
        """Runs `script` as `world` processes, the ranks of vLLM's "external_launcher" (each a
        tensor-parallel rank that stays from engine to engine: the worker processes vLLM would start
        for each engine, and their imports, saved), one core each; returns rank 0's RESULT. A rank
        that fails or outlives the timeout stops them all, and its output is named."""
        from engines import free_port

        port = free_port()
        logs = [open(self.log_path.with_name(f"{script}.{port}.rank{r}.log"), "w+") for r in range(world)]
        procs = []
        for r in range(world):
            env = dict(os.environ, **IN_PROCESS, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(map(str, range(world))))  # a core per rank
            env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
            procs.append(subprocess.Popen([sys.executable, str(HERE / script), *args], stdout=logs[r],
                                          stderr=subprocess.STDOUT, env=env))
        deadline = time.monotonic() + timeout
        try:
            while any(p.poll() is None for p in procs):
                failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    r = failed[0] if failed else 0
                    logs[r].seek(0)
                    raise AssertionError(f"{script} {' '.join(args)}, rank {r} of {world}: "
                                         f"{'exit ' + str(procs[r].returncode) if failed else 'no result in time'}:\n"
                                         f"{logs[r].read()[-8000:]}")
                time.sleep(0.5)
            for r, p in enumerate(procs):
                logs[r].seek(0)
                assert p.returncode == 0, f"{script}, rank {r} of {world}: exit {p.returncode}:\n" \
                                          f"{logs[r].read()[-8000:]}"
            logs[0].seek(0)
            for line in logs[0].read().splitlines():
                if line.startswith("RESULT "):
                    return json.loads(line[len("RESULT "):])
            raise AssertionError(f"{script} {' '.join(args)}: rank 0 printed no result")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            for log in logs:
                log.close()

    def served_lora(self, tp, model: str, *adapters: str) -> dict:
        """A fresh vLLM at `tp` on `model` serving each adapter directory, then none."""
        if str(tp) != "1":
            return run_script("run_lora_generate.py", str(tp), model, *adapters, tp=int(tp), env_extra=IN_PROCESS)
        return self._ask({"lora": model, "adapters": list(adapters)})

    def _ask(self, request: dict, timeout: float = 600) -> dict:
        if self.proc is None:
            env = dict(os.environ, **IN_PROCESS)
            env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
            self.log = open(self.log_path, "w")
            self.proc = subprocess.Popen([sys.executable, str(HERE / "fresh_server.py")], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
            threading.Thread(target=self._read, daemon=True).start()
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"fresh_server.py gave no result in {timeout:.0f} s: see {self.log_path}")
            if line is None:
                raise AssertionError(f"fresh_server.py exited ({self.proc.wait()}): see {self.log_path}")
            if line.startswith("RESULT "):
                result = json.loads(line[len("RESULT "):])
                assert "error" not in result, f"a fresh vLLM for {request}: {result['error']}"
                return result

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.log.close()


@pytest.fixture(scope="session")
def fresh(tmp_path_factory):
    """The references, a fresh vLLM's (Fresh)."""
    f = Fresh(tmp_path_factory.mktemp("fresh") / "fresh_server.log")
    yield f
    f.close()


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    from models import make_llama, make_qwen3_moe

    root = tmp_path_factory.mktemp("models")
    return {
        # GQA (4 query heads, 2 KV heads), untied lm_head, a vocab of 512 (no padding)
        "llama": make_llama(str(root / "llama")),
        # tied embeddings, one KV head (replicated at TP=2), a vocab of 500 (padded to 512)
        "llama_tied": make_llama(str(root / "llama_tied"), vocab=500, layers=1, kv_heads=1, tied=True, seed=1),
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
