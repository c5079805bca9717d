"""The client as a user gets it: `pip install ./client/python` into a fresh venv pulls current
grpcio, protobuf and numpy from PyPI, and the shipped stubs load under that protobuf runtime and
run a real sync there. The test venv itself runs the pip-installed package, not the source tree."""

from __future__ import annotations

import os
import subprocess
import textwrap
import venv

import google.protobuf

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


def test_the_tests_run_the_pip_installed_package():
    assert "site-packages" in shardcast.__file__, shardcast.__file__
    assert int(google.protobuf.__version__.split(".")[0]) >= 4  # PyPI's runtime, not Debian 12's 3.21


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
