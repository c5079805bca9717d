"""The monitoring components: the PodMonitor (or ServiceMonitor) scrapes the daemon pods on their
real metrics port under the job the alerts select, the alerts are the seven docs/deploy.md gives a
runbook entry, every alert and dashboard expression names only metric families, labels and label
values the daemon exports (as daemon/server/metrics.cc and docs/daemon.md list them), and none
mixes the series of two deployments (namespaces).
Whether the expressions parse and the alerts fire is client/python/tests/test_prometheus.py's
business (a real Prometheus); the validator's checks of the Prometheus Operator's CRDs are here."""

from __future__ import annotations

import json
import re
from typing import Dict, Iterator, Optional, Set, Tuple

import pytest
import yaml

import validate
from conftest import DEPLOYMENTS, K8S, ROOT, by_kind, components_of, render_deployment
from test_consistency import flag_values

MONITORING = K8S / "components" / "monitoring"
RESULTS = {"committed", "failed"}
STATES = {"empty", "updating", "ready", "dirty"}
ROLES = {"source", "destination"}
#: The metric families the daemon exports (daemon/server/metrics.cc, docs/daemon.md "Metrics"):
#: type and labels, with the values of each label whose values are a fixed set (None: any).
DAEMON_METRICS: Dict[str, Tuple[str, Dict[str, Optional[Set[str]]]]] = {
    "shardcast_syncs_total": ("counter", {"result": RESULTS}),
    "shardcast_peer_failures_total": ("counter", {"peer": None}),
    "shardcast_bytes_sent_total": ("counter", {}),
    "shardcast_bytes_received_total": ("counter", {}),
    "shardcast_bytes_landed_direct_total": ("counter", {}),
    "shardcast_local_bytes_total": ("counter", {}),
    "shardcast_device_fanout_bytes_total": ("counter", {}),
    "shardcast_delta_saved_bytes_total": ("counter", {}),
    "shardcast_chunks_landed_total": ("counter", {"encoding": {"dense", "delta"}}),
    "shardcast_plan_cache_hits_total": ("counter", {}),
    "shardcast_plan_cache_misses_total": ("counter", {}),
    "shardcast_syncs_expired_total": ("counter", {}),
    "shardcast_sessions_ended_total": ("counter", {}),
    "shardcast_sync_duration_seconds": ("histogram", {"result": RESULTS}),
    "shardcast_sync_phase_duration_seconds": (
        "histogram", {"phase": {"gather", "plan", "prepare", "execute", "finish"}, "result": RESULTS}),
    "shardcast_build_info": ("gauge", {"version": None}),
    "shardcast_syncs_in_flight": ("gauge", {}),
    "shardcast_waits_in_flight": ("gauge", {}),
    "shardcast_delta_base_bytes": ("gauge", {}),
    "shardcast_delta_base_capacity_bytes": ("gauge", {}),
    "shardcast_registered_bytes": ("gauge", {}),
    "shardcast_registered_ranks": ("gauge", {}),
    "shardcast_ranks": ("gauge", {"state": STATES}),
    "shardcast_group_version": ("gauge", {"group": None, "role": ROLES}),
    "shardcast_group_ranks": ("gauge", {"group": None, "role": ROLES, "state": STATES}),
    "shardcast_group_version_lag": ("gauge", {"group": None, "source": None}),
    "shardcast_peer_up": ("gauge", {"peer": None}),
    "shardcast_sessions_active": ("gauge", {}),
    "shardcast_tls_certificate_expiry_timestamp_seconds": ("gauge", {}),
    "shardcast_replica_set_replicas": ("gauge", {"set": None}),
    "shardcast_replicas_cut_total": ("counter", {"set": None}),
}
#: Labels Prometheus gives every series of a target (node: the monitors' relabeling; namespace:
#: the Operator's, which tells deployments apart), and `le`, the bucket label of histograms.
TARGET_LABELS = {"instance", "job", "namespace", "node"}
#: What Prometheus records itself for every target it scrapes, whatever the target exports: only
#: target labels, and only meaningful for the daemons' targets, selected by SCRAPE_JOB.
SCRAPE_SERIES = {"up"}
#: The job of the daemons' targets: both monitors take it from the label app.kubernetes.io/name
#: (jobLabel), and the end-to-end test's Prometheus names its job so.
SCRAPE_JOB = "shardcastd"
#: The alerts: names and `for` are a contract (docs/deploy.md's runbook, the end-to-end test).
ALERTS = {
    "ShardcastDaemonDown": "5m",
    "ShardcastRanksDirty": "5m",
    "ShardcastVersionLag": "10m",
    "ShardcastSyncFailureRatio": "15m",
    "ShardcastPeerUnreachable": "5m",
    "ShardcastNoSyncWhileSourcesPublish": "30m",
    "ShardcastCertificateExpiringSoon": "1h",
}
#: What a runbook entry tells the reader to run.
CLI_COMMANDS = ("shardcast status", "shardcast layouts", "shardcast top")


def series_names() -> Dict[str, str]:
    """Every series name a family exports: a histogram's _bucket, _sum and _count too."""
    names = {}
    for family, (kind, _) in DAEMON_METRICS.items():
        names[family] = family
        if kind == "histogram":
            names.update({f"{family}{s}": family for s in ("_bucket", "_sum", "_count")})
    return names


def rules() -> list:
    doc = yaml.safe_load((MONITORING / "prometheusrule.yaml").read_text())
    return [r for g in doc["spec"]["groups"] for r in g["rules"]]


def dashboard() -> dict:
    return json.loads((MONITORING / "shardcast-dashboard.json").read_text())


def panel_expressions() -> Iterator[Tuple[str, str]]:
    for panel in dashboard()["panels"]:
        for target in panel["targets"]:
            yield f'panel "{panel["title"]}" {target["refId"]}', target["expr"]


_SELECTOR = re.compile(r"(?<![\w.:])([A-Za-z_:][A-Za-z0-9_:]*)\s*(\{[^}]*\})?")
_MATCHER = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*("(?:[^"\\]|\\.)*")')
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset",
             "inf", "nan"}


def vocabulary(expr: str) -> Tuple[Dict[str, Dict[str, str]], Set[str]]:
    """What a PromQL expression names: {series name: {label: value matched with =}} (label ->
    "" for other matchers), and the labels of its by/without/on/ignoring/group_x clauses. A small
    reading of PromQL, enough for our expressions: test_prometheus.py has a real Prometheus parse
    them."""
    grouping = {label.strip() for m in _GROUPING.finditer(expr) for label in m.group(2).split(",") if label.strip()}
    text = _GROUPING.sub(" ", re.sub(r"\[[^\]]*\]", "", expr))  # range and subquery brackets, label lists
    selectors: Dict[str, Dict[str, str]] = {}
    for m in _SELECTOR.finditer(text):
        name, matchers = m.group(1), m.group(2) or ""
        if name in _KEYWORDS or text[m.end(1):].lstrip().startswith("("):
            continue  # an operator or a function
        labels = selectors.setdefault(name, {})
        for label, op, value in _MATCHER.findall(matchers):
            labels[label] = json.loads(value) if op == "=" else ""
    return selectors, grouping


def expression_problem(expr: str) -> str:
    """Why an expression names something the daemon does not export, or ""."""
    names = series_names()
    selectors, grouping = vocabulary(expr)
    known_labels = set(TARGET_LABELS)
    for name, matched in selectors.items():
        if name in SCRAPE_SERIES:
            if matched.get("job") != SCRAPE_JOB:
                return f'{name} without job="{SCRAPE_JOB}" selects every target Prometheus scrapes'
            unknown = set(matched) - TARGET_LABELS
            if unknown:
                return f"{name} has only target labels, not {sorted(unknown)}"
            continue
        if name not in names:
            return f"{name} is not a metric the daemon exports"
        labels = DAEMON_METRICS[names[name]][1]
        known_labels |= set(labels) | ({"le"} if name.endswith("_bucket") else set())
        for label, value in matched.items():
            if label not in labels and label not in TARGET_LABELS:
                return f'{name} has no label "{label}"'
            allowed = labels.get(label)
            if value and allowed is not None and value not in allowed:
                return f'{name}{{{label}="{value}"}}: the daemon exports {sorted(allowed)}'
    unknown = grouping - known_labels
    return f"groups by labels no series here has: {sorted(unknown)}" if unknown else ""


_AGGREGATION = re.compile(r"\b(sum|min|max|avg|group|count|count_values|stddev|stdvar|topk|bottomk|quantile)"
                          r"\s*(?:(by|without)\s*\(([^)]*)\))?\s*\(")
_VECTOR_MATCHING = re.compile(r"\b(on|ignoring)\s*\(([^)]*)\)")


def mixing_problem(expr: str) -> str:
    """Why an expression would mix the series of two Shardcast deployments scraped by one
    Prometheus, or "": every aggregation must keep `namespace` (by, written before its argument,
    naming it; without, not naming it), and every vector matching must match on it."""
    for m in _AGGREGATION.finditer(expr):
        clause, labels = m.group(2), {label.strip() for label in (m.group(3) or "").split(",")}
        if clause is None or (clause == "by") != ("namespace" in labels):
            return f'"{m.group(0)}" aggregates across namespaces'
    for m in _VECTOR_MATCHING.finditer(expr):
        labels = {label.strip() for label in m.group(2).split(",")}
        if (m.group(1) == "on") != ("namespace" in labels):
            return f'"{m.group(0)}" matches series of different namespaces'
    return ""


# ---- the families themselves ----

def test_the_metric_list_is_the_daemons():
    """DAEMON_METRICS names exactly the families daemon/server/metrics.cc registers or renders."""
    source = (ROOT / "daemon" / "server" / "metrics.cc").read_text()
    assert set(re.findall(r'"(shardcast_[a-z0-9_]+)"', source)) == set(DAEMON_METRICS)


def test_the_metric_list_is_the_one_docs_daemon_md_gives():
    """Names, types and labels as the table in docs/daemon.md, "Metrics", states them."""
    text = (ROOT / "docs" / "daemon.md").read_text()
    section = text[text.index("## Metrics"):text.index("\n## ", text.index("## Metrics") + 1)]
    documented = {}
    for names, kind, labels in re.findall(r"^\| (`shardcast_[^|]+)\|\s*(\w+)\s*\|([^|]*)\|", section, re.M):
        for name in re.findall(r"`(shardcast_\w+)`", names):
            documented[name] = (kind, set(re.findall(r"`(\w+)`", labels)))
    assert documented == {name: (kind, set(labels)) for name, (kind, labels) in DAEMON_METRICS.items()}


@pytest.mark.parametrize("expr, problem", [
    ('sum by (group) (shardcast_group_ranks{state="dirty"}) > 0', ""),
    ("histogram_quantile(0.99, sum by (le, phase) (rate(shardcast_sync_phase_duration_seconds_bucket[5m])))", ""),
    ("sum(rate(shardcast_bytes_received_total[5m])) / 1e9", ""),
    ("sum(rate(shardcast_bytes_recieved_total[5m]))", "shardcast_bytes_recieved_total is not a metric"),
    ('shardcast_syncs_total{result="commited"}', "the daemon exports ['committed', 'failed']"),
    ('shardcast_group_version{rol="source"}', 'has no label "rol"'),
    ("max by (group) (shardcast_peer_up)", "groups by labels no series here has: ['group']"),
    ("sum by (le) (rate(shardcast_syncs_total[5m]))", "['le']"),
    ('up{job="shardcastd"} == 0', ""),
    ("up == 0", 'up without job="shardcastd" selects every target'),
    ('up{job=~"shardcast.*"}', 'up without job="shardcastd"'),
    ('up{job="shardcastd", group="a"}', "up has only target labels, not ['group']"),
])
def test_the_expression_reader_catches_names_labels_and_values_the_daemon_lacks(expr, problem):
    found = expression_problem(expr)
    assert (problem in found) if problem else found == "", found


@pytest.mark.parametrize("expr, problem", [
    ("sum by (namespace, group) (shardcast_group_ranks) > 0", ""),
    ("sum without (node, instance) (shardcast_group_ranks)", ""),
    ("(sum by (namespace, group) (shardcast_group_version) > 0) unless on (namespace) (sum by (namespace) (x) > 0)",
     ""),
    ('up{job="shardcastd"} == 0', ""),
    ("count_values by (namespace) (\"v\", shardcast_build_info)", ""),
    ("sum(rate(shardcast_syncs_total[5m]))", '"sum(" aggregates across namespaces'),
    ("max by (group) (shardcast_group_version_lag) > 2", '"max by (group) (" aggregates'),
    ("sum without (namespace) (shardcast_ranks)", "aggregates across namespaces"),
    ("sum(shardcast_ranks) by (namespace)", '"sum(" aggregates'),  # `by` after the argument: not read
    ("a unless on () b", '"on ()" matches series of different namespaces'),
    ("a / ignoring (namespace) b", "matches series of different namespaces"),
])
def test_the_mixing_reader_catches_aggregations_and_matchings_across_namespaces(expr, problem):
    found = mixing_problem(expr)
    assert (problem in found) if problem else found == "", found


# ---- alerts ----

def test_the_alerts_are_the_contract():
    found = {r["alert"]: r for r in rules()}
    assert {name: r["for"] for name, r in found.items()} == ALERTS
    for name, rule in found.items():
        assert set(rule["annotations"]) == {"summary", "description"}, f"{name}: runbooks live in docs/deploy.md"
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        assert expression_problem(rule["expr"]) == "", f"{name}: {expression_problem(rule['expr'])}"
        assert mixing_problem(rule["expr"]) == "", f"{name}: {mixing_problem(rule['expr'])}"


def runbook() -> Dict[str, str]:
    """docs/deploy.md's runbook: alert name -> its entry."""
    text = (ROOT / "docs" / "deploy.md").read_text()
    start = text.index("### Alerts and runbook")
    section = text[start:text.index("\n#", start + 1)]
    return {m.group(1): m.group(0) for m in re.finditer(r"^- \*\*(\w+)\*\*.*(?:\n  .*)*", section, re.M)}


def test_every_alert_has_a_runbook_entry_with_a_command_to_run():
    entries = runbook()
    assert set(entries) == set(ALERTS), "one runbook entry per alert, and none for an alert that is gone"
    for name, entry in entries.items():
        assert any(f"`{c}" in entry for c in CLI_COMMANDS), f"{name}: the entry names no shardcast command"
        assert ALERTS[name] in entry, f"{name}: the entry does not say how long the condition must hold"


# ---- the dashboard ----

def test_every_panel_expression_names_only_what_the_daemon_exports():
    problems = {where: expression_problem(expr) for where, expr in panel_expressions() if expression_problem(expr)}
    assert not problems, problems
    mixing = {where: mixing_problem(expr) for where, expr in panel_expressions() if mixing_problem(expr)}
    assert not mixing, mixing
    # Grafana's variables ($__rate_interval, ...) would have to be substituted before Prometheus
    # could parse the expressions (test_prometheus.py queries them as they are).
    assert not any("$" in expr for _, expr in panel_expressions())


def test_the_dashboard_is_a_grafana_dashboard_with_a_data_source_variable():
    d = dashboard()
    assert d["uid"] == "shardcast" and d["title"]
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for panel in d["panels"]:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]


def test_the_docs_describe_every_panel():
    text = (ROOT / "docs" / "deploy.md").read_text()
    start = text.index("### The dashboard")
    section = text[start:text.index("\n#", start + 1)]
    described = set(re.findall(r"^\| ([^|]+?) \|", section, re.M)) - {"Panel"}
    assert described == {p["title"] for p in dashboard()["panels"]}


@pytest.mark.parametrize("where", [d for d in DEPLOYMENTS if components_of(d) & {"monitoring", "monitoring-service"}])
def test_the_dashboard_configmap_holds_the_file_for_grafanas_sidecar(kubectl, where):
    config_map = by_kind(render_deployment(where), "ConfigMap")["shardcast-dashboard"]
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["namespace"] == "shardcast"
    assert json.loads(config_map["data"]["shardcast-dashboard.json"]) == dashboard()


# ---- the monitors ----

@pytest.mark.parametrize("where", [d for d in DEPLOYMENTS if components_of(d) & {"monitoring", "monitoring-service"}])
def test_the_monitor_scrapes_the_daemon_pods_on_their_metrics_port(kubectl, where):
    """The PodMonitor selects the DaemonSet's pods and names the container port the daemon's
    --metrics listens on; the ServiceMonitor selects the metrics Service alone (not the peers
    Service, which has the same name label) and names its port that leads there. Both live in the
    daemons' namespace (a monitor looks in its own unless told otherwise), give their targets the
    job the alerts select `up` by, and the NetworkPolicy lets the scraper reach that port
    (test_daemonset_daemon asks /metrics on it)."""
    objects = render_deployment(where)
    ds = by_kind(objects, "DaemonSet")["shardcastd"]
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    container = ds["spec"]["template"]["spec"]["containers"][0]
    metrics_port = int(flag_values(container)["metrics"].rsplit(":", 1)[1])
    container_ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    monitors = [*by_kind(objects, "PodMonitor").values(), *by_kind(objects, "ServiceMonitor").values()]
    assert len(monitors) == 1, f"{where}: one monitor, or every daemon is scraped twice"
    monitor = monitors[0]
    assert monitor["kind"] == ("PodMonitor" if "monitoring" in components_of(where) else "ServiceMonitor")
    assert monitor["metadata"]["namespace"] == ds["metadata"]["namespace"]
    assert "namespaceSelector" not in monitor["spec"]
    selector = monitor["spec"]["selector"]
    assert set(selector) == {"matchLabels"}

    if monitor["kind"] == "PodMonitor":
        assert selector["matchLabels"].items() <= pod_labels.items()
        endpoints = monitor["spec"]["podMetricsEndpoints"]
        assert [container_ports[e["port"]] for e in endpoints] == [metrics_port]
    else:
        services = [s for s in by_kind(objects, "Service").values()
                    if selector["matchLabels"].items() <= s["metadata"].get("labels", {}).items()]
        assert [s["metadata"]["name"] for s in services] == ["shardcastd-metrics"]
        assert services[0]["spec"]["selector"].items() <= pod_labels.items()
        endpoints = monitor["spec"]["endpoints"]
        service_ports = {p["name"]: p["targetPort"] for p in services[0]["spec"]["ports"]}
        targets = [service_ports[e["port"]] for e in endpoints]
        assert [container_ports.get(t, t) for t in targets] == [metrics_port]
    for e in endpoints:
        assert e["path"] == "/metrics" and e.get("scheme", "http") == "http"  # plain HTTP (docs/daemon.md)
        # job and namespace are the Operator's (jobLabel below; the target's namespace).
        assert not {r.get("targetLabel") for r in e.get("relabelings", [])} & {"job", "namespace"}

    # The Operator sets job to the value of the label jobLabel names, on the pod (PodMonitor) or
    # on the Service (ServiceMonitor); without one it would be "<namespace>/<PodMonitor name>" or
    # the Service's name, which differ.
    labelled = pod_labels if monitor["kind"] == "PodMonitor" else services[0]["metadata"]["labels"]
    assert labelled.get(monitor["spec"].get("jobLabel")) == SCRAPE_JOB

    policy = by_kind(objects, "NetworkPolicy")["shardcastd"]
    scraper_ports = {p["port"] for rule in policy["spec"]["ingress"]
                     if any("namespaceSelector" in peer for peer in rule["from"]) for p in rule.get("ports", [])}
    assert metrics_port in scraper_ports


# ---- the validator's Prometheus Operator checks ----

@pytest.mark.parametrize("kind, change, message", [
    ("PodMonitor", lambda s: s["podMetricsEndpoints"][0].update(prot="metrics"),
     ".spec.podMetricsEndpoints[0].prot: unknown field"),
    ("PodMonitor", lambda s: s.pop("selector"), ".spec: 'selector' is a required property"),
    ("PodMonitor", lambda s: s["podMetricsEndpoints"][0].update(interval="15 s"),
     ".spec.podMetricsEndpoints[0].interval: '15 s' is not a duration"),
    ("PodMonitor", lambda s: s["podMetricsEndpoints"][0]["relabelings"][0].update(action="rename"),
     ".spec.podMetricsEndpoints[0].relabelings[0].action: 'rename' is not one of"),
    ("PodMonitor", lambda s: s["selector"].update(matchLabels={"a": 1}),
     ".spec.selector.matchLabels: {'a': 1} is not a mapping of strings to strings"),
    ("ServiceMonitor", lambda s: s.pop("endpoints"), ".spec: 'endpoints' is a required property"),
    ("ServiceMonitor", lambda s: s.update(podMetricsEndpoints=[]), ".spec.podMetricsEndpoints: unknown field"),
    ("PrometheusRule", lambda s: s["groups"][0]["rules"][0].pop("expr"),
     ".spec.groups[0].rules[0]: 'expr' is a required property"),
    ("PrometheusRule", lambda s: s["groups"][0]["rules"][0].update({"for": "5"}),
     ".spec.groups[0].rules[0].for: '5' is not a duration"),
    ("PrometheusRule", lambda s: s["groups"][0]["rules"][0].update(record="x"),
     ".spec.groups[0].rules[0]: a rule has exactly one of alert or record"),
    ("PrometheusRule", lambda s: s["groups"][0]["rules"][0].update(runbook="x"),
     ".spec.groups[0].rules[0].runbook: unknown field"),
    ("PrometheusRule", lambda s: s["groups"][0].pop("name"), ".spec.groups[0]: 'name' is a required property"),
])
def test_validator_checks_the_prometheus_operator_resources(kind, change, message):
    files = {"PodMonitor": MONITORING / "podmonitor.yaml", "PrometheusRule": MONITORING / "prometheusrule.yaml",
             "ServiceMonitor": K8S / "components" / "monitoring-service" / "servicemonitor.yaml"}
    doc = yaml.safe_load(files[kind].read_text())
    assert doc["kind"] == kind and validate.problem(doc) == ""
    change(doc["spec"])
    assert message in validate.problem(doc)
