"""Real shardcastd processes for the Python client's tests (shardcast.local), started per test."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

from shardcast.local import LocalCluster, find_shardcastd  # noqa: E402


def build_dir() -> Path:
    return Path(find_shardcastd()).parent.parent


def shardcastd_path() -> Path:
    try:
        return Path(find_shardcastd())
    except FileNotFoundError as e:
        pytest.fail(str(e))


@pytest.fixture
def cluster():
    """Two daemons, nodes n0 and n1, that know each other."""
    shardcastd_path()
    # --metrics-names: tests read /metrics series by group and peer name.
    with LocalCluster(["n0", "n1"], extra=["--metrics-names"]) as c:
        yield [c.daemons["n0"], c.daemons["n1"]]


# The order files run in (each file's own order kept). Those whose tests spend most of their time
# waiting (on frozen or partitioned peers, leases, chaos rounds, a terminal) run first, and those
# that keep both cores busy (real torch ranks, the examples, a fresh venv) last: the complete suite
# runs this beside the vLLM tests and ctest, whose work fills the waits, and it ends on work that
# uses the whole machine rather than on a core left idle.
WAITING_FIRST = ("test_replica_chaos.py", "test_replica_sets.py", "test_chaos.py", "test_prometheus.py",
                 "test_cli_usage.py", "test_cli_top.py")
BUSY_LAST = ("test_dtensor.py", "test_examples.py", "test_package.py")


def pytest_collection_modifyitems(session, config, items):
    name = lambda item: item.path.name  # noqa: E731
    items.sort(key=lambda item: 0 if name(item) in WAITING_FIRST else 2 if name(item) in BUSY_LAST else 1)


def pytest_configure(config):
    # scripts/test.sh --quick runs -m "not slow"; the complete suite runs everything.
    config.addinivalue_line("markers", "slow: left out of the quick tier (scripts/test.sh --quick)")
