"""The monitoring component against the real Prometheus (Debian's `prometheus` package, which
scripts/deps.sh installs): promtool accepts its rules, and its rule tests on synthetic series show
the alerts that need no daemons (a daemon down, syncs in one namespace while another publishes)
fire for the deployment they concern and no other; Prometheus parses every dashboard expression,
and Prometheus scraping two local daemons sees their syncs (committed and failed, the phase
histogram, the destination group's version and its lag behind the failed sync) while the alert
ShardcastRanksDirty, loaded from the shipped PrometheusRule with a test-sized `for`, fires on the
rank a failed sync left dirty and clears once a sync repairs it. deploy/tests/test_monitoring.py
checks the manifests themselves; docs/deploy.md, "Monitoring", says how they are used."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import grpc
import numpy as np
import pytest
import yaml

import shardcast
from shardcast.local import LocalDaemon, find_shardcastd, free_port, mint_certificates, stop_process
from shardcast.v1 import service_pb2

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
MONITORING = ROOT / "deploy" / "k8s" / "components" / "monitoring"
#: Scrapes and rule evaluations every second, and a `for` of seconds instead of minutes for the
#: one alert the test drives: the test's pace, not the shipped one.
INTERVAL = "1s"
TEST_FOR = {"ShardcastRanksDirty": "2s"}
#: The labels the Operator and the monitors give every target: its job (jobLabel) and namespace.
JOB, NAMESPACE = "shardcastd", "shardcast"
#: How long to wait for anything Prometheus should see after the next scrape or two: generous, as
#: a loaded machine may be slow, and never slept through: every wait polls.
SEE_TIMEOUT = 60.0


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed: run scripts/deps.sh (it installs Debian's prometheus package, "
                    "which brings prometheus and promtool)")
    return path


def rule_groups(for_: Optional[Dict[str, str]] = None) -> dict:
    """The shipped PrometheusRule's spec, which is a Prometheus rules file as it stands, with the
    `for` of the alerts named in `for_` replaced."""
    doc = yaml.safe_load((MONITORING / "prometheusrule.yaml").read_text())
    assert doc["kind"] == "PrometheusRule"
    spec = doc["spec"]
    for group in spec["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") in (for_ or {}):
                rule["for"] = for_[rule["alert"]]
    return spec


def dashboard_expressions() -> Dict[str, str]:
    dashboard = json.loads((MONITORING / "shardcast-dashboard.json").read_text())
    return {f'{p["title"]} {t["refId"]}': t["expr"] for p in dashboard["panels"] for t in p["targets"]}


def wait_for(what: str, probe: Callable[[], Any], ok: Callable[[Any], bool] = bool,
             timeout: float = SEE_TIMEOUT) -> Any:
    """Polls `probe` until `ok` says yes to what it returns, and returns that; fails naming `what`
    and the last thing seen."""
    deadline = time.monotonic() + timeout
    while True:
        seen = probe()
        if ok(seen):
            return seen
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not seen within {timeout:.0f} s; last seen: {seen!r}")
        time.sleep(0.2)


# ---- the processes ----

class Prometheus:
    """A real Prometheus scraping `targets` (node -> host:port) as job JOB, each target given the
    labels node=<node> (the monitors' relabeling) and namespace=NAMESPACE (the Operator's), and
    evaluating `rules`, every INTERVAL, on a free port."""

    def __init__(self, directory: Path, targets: Dict[str, str], rules: dict) -> None:
        (directory / "rules.yaml").write_text(yaml.safe_dump(rules))
        config = {
            "global": {"scrape_interval": INTERVAL, "scrape_timeout": INTERVAL, "evaluation_interval": INTERVAL},
            "rule_files": [str(directory / "rules.yaml")],
            "scrape_configs": [{"job_name": JOB, "static_configs": [
                {"targets": [address], "labels": {"node": node, "namespace": NAMESPACE}}
                for node, address in targets.items()]}],
        }
        (directory / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log_path = directory / "prometheus.log"
        self.url = ""
        for attempt in range(3):  # a port another process took meanwhile: take another one
            port = free_port()
            self.url = f"http://127.0.0.1:{port}"
            with open(self.log_path, "w") as log:
                self.proc = subprocess.Popen(
                    [tool("prometheus"), f"--config.file={directory / 'prometheus.yml'}",
                     f"--storage.tsdb.path={directory / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                    stdout=log, stderr=subprocess.STDOUT)
            deadline = time.monotonic() + 60
            while self.proc.poll() is None and time.monotonic() < deadline and not self._ready():
                time.sleep(0.1)
            if self.proc.poll() is None and self._ready():
                return
            self.stop()
            if "address already in use" not in self.log_path.read_text():
                break
        pytest.fail(f"prometheus did not become ready:\n{self.log_path.read_text()[-3000:]}")

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def api(self, path: str, **params: str) -> dict:
        """GET /api/v1/<path>: the whole answer, errors (HTTP 400 and the like) included."""
        url = f"{self.url}/api/v1/{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                return json.load(r)
        except urllib.error.HTTPError as e:
            return json.load(e)

    def query(self, expr: str) -> List[dict]:
        """An instant query's result vector; fails on an error answer."""
        answer = self.api("query", query=expr)
        assert answer["status"] == "success", f"{expr}: {answer}"
        return answer["data"]["result"]

    def values(self, expr: str, by: str) -> Dict[str, float]:
        """{value of label `by`: value} of an instant query."""
        return {s["metric"].get(by, ""): float(s["value"][1]) for s in self.query(expr)}

    def alerts(self, name: str, **labels: str) -> List[dict]:
        """Active (pending or firing) alerts called `name` with these labels."""
        return [a for a in self.api("alerts")["data"]["alerts"]
                if a["labels"].get("alertname") == name and labels.items() <= a["labels"].items()]

    def stop(self) -> None:
        stop_process(self.proc)


class Stack:
    """Daemons for nodes n0 and n1 that know each other, and a Prometheus scraping both with the
    shipped rules (ShardcastRanksDirty's `for` test-sized)."""

    def __init__(self) -> None:
        self.daemons: Dict[str, LocalDaemon] = {}
        self.prometheus: Optional[Prometheus] = None

    def start(self, directory: Path) -> None:
        daemon_tls, _ = mint_certificates(str(directory / "certs"), find_shardcastd())
        ports = {node: free_port() for node in ("n0", "n1")}
        peers = [f"127.0.0.1:{p}" for p in ports.values()]
        for node, port in ports.items():
            # --metrics-names: the rules' alerts are checked by group and peer name.
            self.daemons[node] = LocalDaemon(node, port, peers, str(directory), find_shardcastd(), tls=daemon_tls,
                                             extra=["--metrics-names"])
            assert self.daemons[node].metrics_port > 0
        targets = {node: f"127.0.0.1:{d.metrics_port}" for node, d in self.daemons.items()}
        self.prometheus = Prometheus(directory, targets, rule_groups(TEST_FOR))
        wait_for("both daemons scraped", lambda: self.prometheus.values("up", "node"),
                 lambda up: up == {"n0": 1.0, "n1": 1.0})

    def stop(self) -> None:
        if self.prometheus is not None:
            self.prometheus.stop()
        for d in self.daemons.values():
            d.stop()


@pytest.fixture(scope="module")
def stack():
    """One stack for the module: Prometheus sees its first targets about 5 s after it starts (its
    discovery manager sends updates every 5 s), too long to pay per test. The tests stay
    independent: each syncs groups of its own, coordinated by a daemon of its own, and reads the
    figures of that daemon (syncs are counted where they are coordinated)."""
    tool("prometheus")
    try:
        find_shardcastd()
    except FileNotFoundError as e:
        pytest.fail(str(e))
    directory = Path(tempfile.mkdtemp(prefix="shardcast-prometheus-"))
    started = Stack()
    try:
        started.start(directory)
        yield started
    finally:
        started.stop()
        shutil.rmtree(directory, ignore_errors=True)


# ---- the groups the daemons sync ----

SHAPE = (64, 64)  # 16 KiB of float32: one chunk, so one changed element makes it a delta


def layout(group: str, node: str) -> dict:
    return {"group": group, "mesh": {"shape": [1]}, "nodes": [node],
            "tensors": [{"name": "w", "shape": list(SHAPE), "dtype": "float32", "placements": [{"replicate": {}}]}]}


def weights(version: int) -> np.ndarray:
    """The source's weights at `version`: one element differs from one version to the next."""
    w = np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE)
    w[0, 0] = version
    return w


class Groups:
    """A source group (one rank on n0, at version 1) and a destination group (one rank on n1,
    empty), whose syncs the daemon on `coordinator` coordinates. `fail_next_sync()` makes the next
    delta sync fail: the destination's weights are written outside a sync, so the delta does not
    rebuild the source's bytes there (DATA_LOSS) and the rank is left dirty (docs/delta.md)."""

    def __init__(self, stack: Stack, src: str, dst: str, coordinator: str = "n0") -> None:
        self.src_name, self.dst_name = src, dst
        self.clients = {n: shardcast.Client(d.target) for n, d in stack.daemons.items()}
        self.coordinator = self.clients[coordinator]
        self.src = self.clients["n0"].register(src, 0, 1, {"w": weights(1)}, layout(src, "n0"), role="source",
                                               version=1)
        self.dst = self.clients["n1"].register(dst, 0, 1, {"w": np.zeros(SHAPE, np.float32)}, layout(dst, "n1"))

    def publish(self, version: int) -> None:
        """A training step."""
        with self.src.writing(version):
            self.src.tensors["w"][...] = weights(version)

    def sync(self, version: int) -> service_pb2.SyncResponse:
        return self.coordinator.sync(self.src_name, self.dst_name, version, delta="auto")

    def fail_next_sync(self) -> None:
        self.dst.tensors["w"][5, 7] += 1  # an engine wrote its weights

    def dirty(self) -> bool:
        return self.dst.state().state == service_pb2.RANK_DIRTY

    def close(self) -> None:
        self.dst.close()
        self.src.close()
        for c in self.clients.values():
            c.close()


def fail_sync(groups: Groups, version: int) -> None:
    groups.fail_next_sync()
    with pytest.raises(shardcast.ShardcastError) as failed:
        groups.sync(version)
    assert failed.value.code == grpc.StatusCode.DATA_LOSS, failed.value
    assert groups.dirty()


# ---- the tests ----

def test_promtool_accepts_the_rules(tmp_path):
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump(rule_groups()))
    out = subprocess.run([tool("promtool"), "check", "rules", str(rules)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    count = sum(len(g["rules"]) for g in rule_groups()["groups"])
    assert f"SUCCESS: {count} rules found" in out.stdout


def series(name: str, values: str, **labels: str) -> dict:
    """An input series of a promtool rule test: `name` with the target labels of a daemon of
    namespace `namespace` (default "a") and `labels`, sampled every minute."""
    labels = {"job": JOB, "namespace": "a", "instance": "10.0.0.1:9464", "node": "n0", **labels}
    return {"series": name + "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}",
            "values": values}


def promtool_test_rules(directory: Path, tests: List[dict]) -> None:
    """Runs `promtool test rules` on the shipped rules. promtool compares annotations too, and
    they are not what these tests are about: the rules are tested without them."""
    spec = rule_groups()
    for group in spec["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    (directory / "rules.yaml").write_text(yaml.safe_dump(spec))
    (directory / "tests.yaml").write_text(yaml.safe_dump(
        {"rule_files": [str(directory / "rules.yaml")], "evaluation_interval": "1m", "tests": tests}))
    out = subprocess.run([tool("promtool"), "test", "rules", str(directory / "tests.yaml")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_daemon_down_fires_for_the_daemons_job_only(tmp_path):
    """up{job="shardcastd"} at 0 for 5 minutes fires, naming the node; another job's target down
    (here node-exporter's on the same node) does not."""
    promtool_test_rules(tmp_path, [{
        "interval": "1m",
        "input_series": [
            series("up", "1 1 0x10"),  # down from minute 2
            series("up", "1x12", node="n1", instance="10.0.0.2:9464"),
            series("up", "0x12", job="node-exporter", instance="10.0.0.1:9100"),
        ],
        "alert_rule_test": [
            {"eval_time": "6m", "alertname": "ShardcastDaemonDown", "exp_alerts": []},  # pending
            {"eval_time": "8m", "alertname": "ShardcastDaemonDown", "exp_alerts": [{"exp_labels": {
                "severity": "critical", "job": JOB, "namespace": "a", "node": "n0", "instance": "10.0.0.1:9464"}}]},
        ],
    }])


def test_another_namespaces_syncs_neither_silence_nor_dilute_a_deployments_alerts(tmp_path):
    """Two deployments in one Prometheus, namespaces a and b. Both sources publish every minute;
    only b's syncs commit: ShardcastNoSyncWhileSourcesPublish fires for a. Every sync of a fails
    while b commits ten a minute: a's failure ratio is 1, though 1 in 11 overall, and
    ShardcastSyncFailureRatio fires for a alone."""
    publishing = [series("shardcast_group_version", "1+1x120", group="trainer", role="source", namespace=ns)
                  for ns in ("a", "b")]
    promtool_test_rules(tmp_path, [
        {"interval": "1m",
         "input_series": [*publishing,
                          series("shardcast_syncs_total", "0x120", result="committed", namespace="a"),
                          series("shardcast_syncs_total", "0+1x120", result="committed", namespace="b")],
         "alert_rule_test": [{"eval_time": "100m", "alertname": "ShardcastNoSyncWhileSourcesPublish",
                              "exp_alerts": [{"exp_labels": {"severity": "critical", "namespace": "a",
                                                             "group": "trainer"}}]}]},
        {"interval": "1m",
         "input_series": [series("shardcast_syncs_total", "0+1x60", result="failed", namespace="a"),
                          series("shardcast_syncs_total", "0x60", result="committed", namespace="a"),
                          series("shardcast_syncs_total", "0x60", result="failed", namespace="b"),
                          series("shardcast_syncs_total", "0+10x60", result="committed", namespace="b")],
         "alert_rule_test": [{"eval_time": "40m", "alertname": "ShardcastSyncFailureRatio",
                              "exp_alerts": [{"exp_labels": {"severity": "warning", "namespace": "a"}}]}]},
    ])


def test_prometheus_parses_every_dashboard_expression(stack):
    """An expression Prometheus cannot parse answers status "error", errorType "bad_data"; the
    first query shows this test would see it."""
    broken = stack.prometheus.api("query", query="sum by (group) (rate(shardcast_syncs_total[5m])")
    assert (broken["status"], broken["errorType"]) == ("error", "bad_data")
    problems = {}
    for where, expr in dashboard_expressions().items():
        answer = stack.prometheus.api("query", query=expr)
        if answer["status"] != "success":
            problems[where] = f'{answer["errorType"]}: {answer["error"]}'
    assert not problems, problems


def test_syncs_are_scraped_and_a_dirty_rank_fires_the_alert_until_a_sync_repairs_it(stack):
    """Two committed syncs (dense, then delta), a delta sync that fails on the destination and
    leaves its rank dirty, then the repairing sync: the alert fires in between and only then. The
    destination's version lag follows: 0 while the latest sync prepared into it committed, 1 after
    the failed sync of version 3 (prepared on n1 while the group there holds 2), 0 again once
    version 3 commits."""
    prom = stack.prometheus
    groups = Groups(stack, "trainer", "infer")
    try:
        groups.sync(1)  # dense: no base yet
        wait_for("the destination group at version 1",
                 lambda: prom.values('max(shardcast_group_version{group="infer"})', ""), lambda v: v == {"": 1.0})
        groups.publish(2)
        assert groups.sync(2).delta_chunks > 0  # the destination holds the base now
        assert not prom.alerts("ShardcastRanksDirty", group="infer")
        lag = 'shardcast_group_version_lag{group="infer"}'
        wait_for("group infer not behind the sync of version 2", lambda: prom.values(lag, "source"),
                 lambda v: v == {"trainer": 0.0})

        groups.publish(3)
        fail_sync(groups, 3)
        wait_for("a dirty rank in group infer",
                 lambda: prom.values('sum by (group) (shardcast_group_ranks{state="dirty"})', "group"),
                 lambda v: v.get("infer") == 1.0)
        firing = wait_for("ShardcastRanksDirty firing for group infer",
                          lambda: [a for a in prom.alerts("ShardcastRanksDirty", group="infer")
                                   if a["state"] == "firing"])
        assert firing[0]["annotations"]["summary"] == "Group infer has 1 dirty rank(s)"
        assert firing[0]["labels"]["severity"] == "critical"
        assert firing[0]["labels"]["namespace"] == NAMESPACE
        wait_for("group infer one version behind the failed sync of version 3", lambda: prom.values(lag, "source"),
                 lambda v: v == {"trainer": 1.0})

        repaired = groups.sync(3)  # the same version again: dense for the dirty rank
        assert repaired.delta_chunks == 0 and not groups.dirty()
        assert np.array_equal(groups.dst.tensors["w"], groups.src.tensors["w"])
        wait_for("ShardcastRanksDirty gone for group infer",
                 lambda: prom.alerts("ShardcastRanksDirty", group="infer"), lambda active: not active)
        wait_for("group infer not behind once version 3 committed", lambda: prom.values(lag, "source"),
                 lambda v: v == {"trainer": 0.0})

        # Coordinated on n0: three committed syncs and the failed one, each phase of each committed
        # sync observed, and the destination at the repaired version.
        wait_for("the syncs counted by result",
                 lambda: prom.values('sum by (result) (shardcast_syncs_total{node="n0"})', "result"),
                 lambda v: v == {"committed": 3.0, "failed": 1.0})
        phases = prom.values('sum by (phase) (shardcast_sync_phase_duration_seconds_count{node="n0"})', "phase")
        for phase in ("gather", "prepare", "execute", "finish"):
            assert phases.get(phase, 0) >= 3, phases
        wait_for("the destination group at version 3",
                 lambda: prom.values('max(shardcast_group_version{group="infer"})', ""), lambda v: v == {"": 3.0})
        assert prom.values('sum by (peer) (shardcast_peer_failures_total{node="n0"})', "peer") == {"n1": 1.0}
    finally:
        groups.close()


def test_every_family_the_rules_and_panels_name_is_exported_and_every_panel_has_data(stack):
    """What an operator sees on a live cluster: each metric family an alert or a panel names is
    scraped from the daemons, and each panel shows data once syncs ran, a failed one included.
    Some families appear only once a peer was reached or a sync reached a destination; all are
    there after these syncs."""
    prom = stack.prometheus
    groups = Groups(stack, "trainer-b", "infer-b", coordinator="n1")
    try:
        groups.sync(1)
        groups.publish(2)
        groups.sync(2)
        groups.publish(3)
        fail_sync(groups, 3)
        groups.sync(3)

        # Scraped after the syncs: n1 (it coordinated them and holds the destination) and n0 (the
        # source at version 3).
        wait_for("the syncs n1 coordinated, by result",
                 lambda: prom.values('sum by (result) (shardcast_syncs_total{node="n1"})', "result"),
                 lambda v: v == {"committed": 3.0, "failed": 1.0})
        wait_for("the groups' versions by role",
                 lambda: prom.values('shardcast_group_version{group=~"trainer-b|infer-b"}', "role"),
                 lambda v: v == {"source": 3.0, "destination": 3.0})

        exprs = {**dashboard_expressions(), **{r["alert"]: r["expr"] for g in rule_groups()["groups"]
                                               for r in g["rules"]}}
        named = {name for expr in exprs.values() for name in re.findall(r"shardcast_[a-z0-9_]+", expr)}
        wait_for("every series name the rules and panels name, scraped (the ones still missing)",
                 lambda: sorted(named - set(prom.api("label/__name__/values")["data"])), lambda missing: not missing)
        for where, expr in dashboard_expressions().items():
            wait_for(f"data in panel {where} ({expr})", lambda: prom.query(expr))  # noqa: B023 (called at once)

        assert prom.values('shardcast_group_version_lag{group="infer-b"}', "source") == {"trainer-b": 0.0}
        up = prom.values('shardcast_peer_up{node="n1"}', "peer")
        assert up.get("n0") == 1.0 and set(up.values()) == {1.0}, up  # n1 reached n0 for every sync
        phases = 'sum by (phase) (shardcast_sync_phase_duration_seconds_count{node="n1", result="%s"})'
        assert prom.values(phases % "committed", "phase") == {
            p: 3.0 for p in ("gather", "plan", "prepare", "execute", "finish")}
        assert prom.values(phases % "failed", "phase"), "the failed sync's phases"
        assert prom.query('shardcast_delta_saved_bytes_total{node="n1"} > 0'), "the delta sync saved bytes"
    finally:
        groups.close()
