"""`shardcast top` in a real terminal: tmux at 80x24 runs it against a daemon, and the test reads
the screen. It shows both nodes' groups with their versions and rank states, the syncs any node
coordinated with the failure's reason, fits 80 columns, and redraws in place as versions change."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
import uuid

import numpy as np
import pytest
import rank_worker
import shardcast

from conftest import shardcastd_path


class Terminal:
    """A tmux server of its own with one 80x24 window running `command`."""

    def __init__(self, command: str) -> None:
        if shutil.which("tmux") is None:
            pytest.fail("tmux is needed to read `shardcast top` off a terminal: run scripts/deps.sh")
        self.socket = f"shardcast-top-{uuid.uuid4().hex[:8]}"
        # If the command exits, its last screen stays readable, with its exit status.
        self._tmux("new-session", "-d", "-x", "80", "-y", "24", f"{command}; echo EXITED $?; sleep 600")

    def _tmux(self, *args: str) -> str:
        return subprocess.run(["tmux", "-L", self.socket, "-f", "/dev/null", *args], capture_output=True, text=True,
                              check=True, timeout=30).stdout

    def screen(self) -> str:
        return self._tmux("capture-pane", "-p")

    def wait_for(self, what: str, pattern: str, timeout: float = 60.0) -> str:
        """The screen once `pattern` (a regular expression, multiline) is on it."""
        deadline = time.monotonic() + timeout
        screen = ""
        while time.monotonic() < deadline:
            screen = self.screen()
            if re.search(pattern, screen, re.M):
                return screen
            time.sleep(0.2)
        raise AssertionError(f"`shardcast top` never showed {what} ({pattern!r}); the screen:\n{screen}")

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True, timeout=30)


def test_top_shows_the_cluster_its_syncs_and_failures_in_80_columns(cluster):
    n0, n1 = cluster
    src, dst = shardcast.Client(n0.target), shardcast.Client(n1.target)
    trainers = rank_worker.register_trainers(src)
    infers = rank_worker.register_inference(dst)
    src.sync("trainer", "infer", 1)
    with pytest.raises(shardcast.ShardcastError, match="not newer"):
        src.sync("trainer", "infer", 1)  # refused: a failure for top to name

    cli = shardcastd_path().parent / "shardcast"
    # Asked of n1, which coordinated nothing: the syncs are n0's.
    term = Terminal(f"{cli} top --daemon {n1.target} --interval-s 0.5")
    try:
        screen = term.wait_for("the failed sync", r"^RECENT FAILURES")
        lines = screen.splitlines()
        assert all(len(line) <= 80 for line in lines), screen
        assert len([line for line in lines if line.startswith("shardcast top - node n1")]) == 1, screen
        assert "peers 1/1 reachable" in lines[0], screen
        # Groups across both nodes: role, version, ranks of the world, READY/UPDATING/DIRTY/EMPTY, nodes.
        assert re.search(r"^trainer\s+src\s+1\s+2/2\s+2\s+0\s+0\s+0\s+1$", screen, re.M), screen
        assert re.search(r"^infer\s+dst\s+1\s+2/2\s+2\s+0\s+0\s+0\s+1$", screen, re.M), screen
        assert re.search(r"trainer -> infer\s+1 committed\s+done", screen), screen
        assert re.search(r"trainer -> infer\s+1 failed", screen), screen
        assert re.search(r"^  \S+ v1 \(trainer -> infer, on n0\):$", screen, re.M), screen
        assert re.search(r"^    sync: group \"infer\" rank \d on node \"n1\" is at version 1", screen, re.M), screen

        # A new version while it runs: the same screen, redrawn in place.
        for t in trainers:
            with t.writing(2):
                for name, x in t.tensors.items():
                    x[...] = rank_worker.shard("trainer", name, t.rank, 2)
        src.sync("trainer", "infer", 2)
        # Both on one screen: a capture may catch a redraw half done (the groups of the new frame,
        # the syncs of the last: "2 executing" in a CI run), which the next one completes.
        screen = term.wait_for("version 2, committed", r"(?s)^infer\s+dst\s+2\s.*trainer -> infer\s+2 committed")
        assert len([line for line in screen.splitlines() if line.startswith("shardcast top")]) == 1, screen
        for i in infers:
            assert np.array_equal(i.tensors["w"], rank_worker.shard("infer", "w", i.rank, 2))
    finally:
        term.close()
        for r in trainers + infers:
            r.close()


def test_top_goes_on_while_a_peer_is_down_and_says_so(cluster):
    """n1's daemon dies: top on n0 still draws, names n1 unreachable and shows n0's own ranks; and
    n0's metrics report the peer down."""
    import urllib.request

    n0, n1 = cluster
    src = shardcast.Client(n0.target)
    trainers = rank_worker.register_trainers(src)
    assert src.list()  # n0 has described n1 once: it names it when it stops answering
    n1.stop()
    cli = shardcastd_path().parent / "shardcast"
    term = Terminal(f"{cli} top --daemon {n0.target} --interval-s 0.5")
    try:
        screen = term.wait_for("n1 unreachable", r"^  unreachable: n1 ")
        assert "peers 0/1 reachable" in screen.splitlines()[0], screen
        assert re.search(r"^  ranks of this node only: ", screen, re.M), screen
        assert re.search(r"^trainer\s+src\s+1\s+2/2\s+2\s+0\s+0\s+0\s+1$", screen, re.M), screen
        assert all(len(line) <= 80 for line in screen.splitlines()), screen
    finally:
        term.close()

    def peer_up() -> str:
        text = urllib.request.urlopen(f"http://127.0.0.1:{n0.metrics_port}/metrics", timeout=10).read().decode()
        return "".join(line for line in text.splitlines() if line.startswith('shardcast_peer_up{peer="n1"}'))

    deadline = time.monotonic() + 60
    while peer_up() != 'shardcast_peer_up{peer="n1"} 0' and time.monotonic() < deadline:
        time.sleep(0.2)
    assert peer_up() == 'shardcast_peer_up{peer="n1"} 0'
    for t in trainers:
        t.close()


def test_top_once_prints_one_screen_and_fails_for_an_unreachable_daemon(cluster, tmp_path):
    n0, _ = cluster
    cli = shardcastd_path().parent / "shardcast"
    once = subprocess.run([str(cli), "top", "--once", "--daemon", n0.target], capture_output=True, text=True,
                          timeout=60)
    assert once.returncode == 0, once.stderr
    assert once.stdout.startswith("shardcast top - node n0") and "(nothing registered)" in once.stdout
    gone = subprocess.run([str(cli), "top", "--once", "--daemon", f"unix:{tmp_path}/none.sock"], capture_output=True,
                          text=True, timeout=60)
    assert gone.returncode != 0 and "shardcast top" in gone.stderr
