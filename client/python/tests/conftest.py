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


def pytest_configure(config):
    # scripts/test.sh --quick runs -m "not slow"; the complete suite runs everything.
    config.addinivalue_line("markers", "slow: left out of the quick tier (scripts/test.sh --quick)")
