"""The RL example with a real vLLM (client/examples/vllm_rl/run.py) runs as a user runs it: vLLM
samples, the trainer learns from the rollouts, and every step's rollouts come from the weights the
trainer held at that step."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_rl_example_with_vllm_stays_on_policy():
    out = subprocess.run([sys.executable, str(ROOT / "client" / "examples" / "vllm_rl" / "run.py"), "--steps", "2"],
                         capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-8000:]
    steps = re.findall(r"step (\d): mean reward ([0-9.]+), \|vLLM - trainer\| logprob (\S+), weights to vLLM in "
                       r"[0-9.]+ s \(version (\d+)\)", out.stdout)
    assert [s[0] for s in steps] == ["1", "2"], out.stdout
    # Each update reached vLLM as the version it names, and every step's rollouts were sampled from
    # exactly the trainer's weights of that step (vLLM's logprobs are the trainer's).
    assert [s[3] for s in steps] == ["1", "2"]
    assert all(float(s[2]) <= 1e-3 for s in steps), out.stdout
    assert "on-policy: the largest gap" in out.stdout
