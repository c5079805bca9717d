"""Every shipped daemon's memory request and limit follow from the budgets it is configured with,
by the arithmetic docs/deploy.md ("Memory") states: a budget changed without the limit fails here."""

from __future__ import annotations

import re
from typing import Dict

import pytest

from conftest import ROOT, by_kind
from test_consistency import SHIPPED, daemon_container, env_of

#: The daemon's own memory beside its budgets (code, UCX, layouts, plans and the plan cache, the
#: CUDA runtime): an allowance, not a measurement of a loaded daemon (docs/deploy.md says so).
DAEMON_MIB = 1024

BUDGETS = ("SHARDCAST_STAGING_MIB", "SHARDCAST_DELTA_CACHE_MIB", "SHARDCAST_GRPC_MEMORY_MIB")


def expected_memory_mib(env: Dict[str, str]) -> int:
    """Landing arena + staging (each at most the staging budget per wave: docs/daemon.md, "A sync"),
    the delta cache, gRPC's quota and the daemon itself."""
    return (2 * int(env["SHARDCAST_STAGING_MIB"]) + int(env["SHARDCAST_DELTA_CACHE_MIB"])
            + int(env["SHARDCAST_GRPC_MEMORY_MIB"]) + DAEMON_MIB)


def mib(quantity: str) -> float:
    """A Kubernetes memory quantity in MiB."""
    m = re.fullmatch(r"([0-9.]+)(Ki|Mi|Gi|Ti|k|M|G|T)?", quantity)
    assert m, f"memory quantity {quantity!r}"
    factor = {None: 1, "Ki": 2 ** 10, "Mi": 2 ** 20, "Gi": 2 ** 30, "Ti": 2 ** 40,
              "k": 10 ** 3, "M": 10 ** 6, "G": 10 ** 9, "T": 10 ** 12}[m.group(2)]
    return float(m.group(1)) * factor / 2 ** 20


def memory_problem(where: str, container: dict, env: Dict[str, str]) -> str:
    """Why the container's memory does not follow from its budgets, or ""."""
    missing = [b for b in BUDGETS if b not in env]
    if missing:
        return f"{where}: {missing} not set: the daemon's defaults would hide what the limit is computed from"
    want = expected_memory_mib(env)
    resources = container["resources"]
    for kind in ("requests", "limits"):
        got = mib(resources.get(kind, {}).get("memory", "0"))
        if got != want:
            return (f"{where}: {kind}.memory is {got:g} MiB, but 2 x {env['SHARDCAST_STAGING_MIB']} + "
                    f"{env['SHARDCAST_DELTA_CACHE_MIB']} + {env['SHARDCAST_GRPC_MEMORY_MIB']} + {DAEMON_MIB} = "
                    f"{want} MiB")
    return ""


@pytest.mark.parametrize("where", SHIPPED)
def test_memory_request_and_limit_follow_from_the_budgets(kubectl, where):
    _, container, objects = daemon_container(where)
    assert memory_problem(where, container, env_of(container, objects)) == ""


@pytest.mark.parametrize("budget", BUDGETS)
def test_a_budget_changed_without_the_limit_is_caught(kubectl, budget):
    _, container, objects = daemon_container("base")
    config = by_kind(objects, "ConfigMap")["shardcastd-config"]["data"]
    config[budget] = str(int(config[budget]) + 512)
    assert "but 2 x" in memory_problem("base", container, env_of(container, objects))
    del config[budget]
    assert "not set" in memory_problem("base", container, env_of(container, objects))


def test_the_docs_state_the_arithmetic_of_the_shipped_limits(kubectl):
    """docs/deploy.md gives each shipped sum; it must be the one the manifests compute."""
    text = (ROOT / "docs" / "deploy.md").read_text()
    for where in ("base", "dev"):
        _, container, objects = daemon_container(where)
        env = env_of(container, objects)
        line = (f"2 x {env['SHARDCAST_STAGING_MIB']} + {env['SHARDCAST_DELTA_CACHE_MIB']} + "
                f"{env['SHARDCAST_GRPC_MEMORY_MIB']} + {DAEMON_MIB} = {expected_memory_mib(env)} MiB")
        assert line in text, f"docs/deploy.md does not say {line!r} ({where})"
