"""The client as a user gets it: `pip install ./client/python` into a fresh venv pulls current
grpcio, protobuf and numpy from PyPI, and the shipped stubs load under that protobuf runtime and
run a real sync there. The test venv itself runs the pip-installed package, not the source tree.
`import shardcast` alone gives every module, and a process with a client forks quietly."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import venv

import google.protobuf
import pytest

import shardcast
from conftest import ROOT, shardcastd_path

SYNC_SCRIPT = textwrap.dedent("""
    import sys
    import google.protobuf, grpc, numpy as np
    import shardcast
    from shardcast.local import LocalCluster
    print("shardcast", shardcast.__file__, "protobuf", google.protobuf.__version__, "grpcio", grpc.__version__)
    layout = lambda group, node, dim: {"group": group, "mesh": {"shape": [2]}, "nodes": [node, node],
        "tensors": [{"name": "w", "shape": [6, 4], "dtype": "float32", "placements": [{"shard": {"dim": dim}}]}]}
    full = np.arange(24, dtype=np.float32).reshape(6, 4)
    with LocalCluster(["a", "b"], binary=sys.argv[1]) as c:
        src, dst = shardcast.Client(c.target("a")), shardcast.Client(c.target("b"))
        regs = [src.register("t", r, 2, {"w": full[3 * r:3 * r + 3]}, layout("t", "a", 0), role="source", version=1)
                for r in range(2)]
        outs = [dst.register("i", r, 2, {"w": np.zeros((6, 2), np.float32)}, layout("i", "b", 1)) for r in range(2)]
        src.sync("t", "i", 1, verify=True)
        assert all((o.tensors["w"] == full[:, 2 * r:2 * r + 2]).all() for r, o in enumerate(outs))
        for reg in regs + outs:
            reg.close()
    print("synced: every element matches")
""")


FORK_SCRIPT = textwrap.dedent("""
    import multiprocessing, os, sys
    import shardcast
    from shardcast.local import LocalCluster
    with LocalCluster(["n0"], binary=sys.argv[1], extra=["--insecure"]) as c, shardcast.Client(c.target("n0")) as client:
        client.status()
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
        child = multiprocessing.get_context("fork").Process(target=os.getpid)
        child.start()
        child.join()
        assert child.exitcode == 0
        client.status()
    print("forked twice")
""")


def _fresh_python(*args: str, env: dict, cwd) -> subprocess.CompletedProcess:
    """This venv's python, isolated (-I: not the current directory, no PYTHONPATH, no user site)."""
    return subprocess.run([sys.executable, "-I", *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=120)


def test_the_tests_run_the_pip_installed_package():
    assert "site-packages" in shardcast.__file__, shardcast.__file__
    assert int(google.protobuf.__version__.split(".")[0]) >= 4  # PyPI's runtime, not Debian 12's 3.21


@pytest.mark.slow
def test_pip_install_into_a_fresh_venv_and_sync(tmp_path):
    daemon = str(shardcastd_path())
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = str(env_dir / "bin" / "python")
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    install = subprocess.run([python, "-m", "pip", "install", "-q", str(ROOT / "client" / "python")],
                             capture_output=True, text=True, env=clean, timeout=900)
    assert install.returncode == 0, f"pip install ./client/python failed (is PyPI reachable?): {install.stderr[-3000:]}"
    script = tmp_path / "sync.py"
    script.write_text(SYNC_SCRIPT)
    # -I: isolated (no user site, no PYTHONPATH, not the current directory): only what pip installed.
    run = subprocess.run([python, "-I", str(script), daemon], capture_output=True, text=True, env=clean,
                         cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert str(env_dir) in run.stdout.split()[1]  # the package pip installed, not the source tree
    assert "synced: every element matches" in run.stdout
    print(run.stdout.splitlines()[0])


def test_fp8_comes_with_import_shardcast(tmp_path):
    pytest.importorskip("torch")
    run = _fresh_python("-c", "import shardcast, torch\n"
                        "q, scale = shardcast.fp8.block_quantize(torch.full((4, 4), 448.0), (2, 2))\n"
                        "print(q.dtype, scale.tolist())", env=dict(os.environ), cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["torch.float8_e4m3fn", "[[1.0,", "1.0],", "[1.0,", "1.0]]"]


def test_forking_a_process_with_a_client_prints_no_grpc_fork_warning(tmp_path):
    # This test process imported shardcast, which set the variable: the child must start without it.
    env = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    script = tmp_path / "fork.py"
    script.write_text(FORK_SCRIPT)
    run = _fresh_python(str(script), str(shardcastd_path()), env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "forked twice" in run.stdout
    for warning in ("fork() handlers", "GRPC_ENABLE_FORK_SUPPORT", "fork_posix"):
        assert warning not in run.stderr, run.stderr
    # An application's own choice wins.
    run = _fresh_python("-c", "import os, shardcast; print(os.environ['GRPC_ENABLE_FORK_SUPPORT'])",
                        env=dict(env, GRPC_ENABLE_FORK_SUPPORT="1"), cwd=tmp_path)
    assert run.stdout.strip() == "1", run.stderr
