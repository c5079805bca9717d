"""README.md's by-hand quickstart, run as a reader would paste it (in a temporary directory, on
free ports): certificates, two daemons, a registration from Python, one sync, a wait, `status`."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

from shardcast.local import free_port

from conftest import ROOT, build_dir


def test_the_readme_quickstart_runs_as_written(tmp_path):
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## By hand"):]
    script = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    p0, p1 = free_port(), free_port()
    script = (script.replace("/tmp/sc", str(tmp_path / "sc")).replace("7070", str(p0)).replace("7071", str(p1))
              .replace("$PWD/build/bin", str(build_dir() / "bin")).replace(".venv/bin/python", sys.executable))
    proc = subprocess.Popen(["bash", "-c", script], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever the script left running
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, out
    assert "[[16. 17. 18. 19.]" in out and "[28. 29. 30. 31.]]" in out, out  # rows 4..7, synced
    # The other daemon counted as `shardcast top` counts it; this one listed as itself.
    assert "node        n1" in out and "peers       1/1 reachable" in out and "this daemon" in out, out
    assert "Traceback" not in out, out
