"""docs/guide-rl-kubernetes.md as a reader follows it: every kustomization rendered where the page
puts it (beside the checkout) and validated, with the properties each step relies on; every
command's program, subcommands and flags real; the step 4 scripts run as written against local
daemons; the step 5 trainer code tied to the vLLM test that runs it. Any drift of the repository
(a renamed flag or field, a removed manifest, a path that no longer renders) fails here."""

from __future__ import annotations

import ast
import functools
import os
import re
import shlex
import socket
import subprocess
import sys
import types
from pathlib import Path
from typing import Dict, List, NamedTuple

import pytest
import yaml
from shardcast.local import LocalCluster

from conftest import K8S, ROOT, binary, by_kind, daemonset_pod, render, render_deployment, validate

GUIDE = ROOT / "docs" / "guide-rl-kubernetes.md"
REGISTRY = "registry.example.com/rl"


class Block(NamedTuple):
    lang: str
    marker: str  # the `<!-- guide-test: ... -->` comment right above the block, "" for none
    text: str


@functools.lru_cache(maxsize=None)
def blocks() -> List[Block]:
    found = re.findall(r"(?:<!-- guide-test: (.*?) -->\n)?```(\w+)\n(.*?)```", GUIDE.read_text(), re.S)
    return [Block(lang, marker, text) for marker, lang, text in found]


def of(lang: str) -> List[Block]:
    return [b for b in blocks() if b.lang == lang]


def file_block(path: str, variant: str = "") -> str:
    [b] = [b for b in blocks() if b.marker == f"file {path}" + (f", {variant}" if variant else "")]
    return b.text


def test_every_block_is_one_the_test_knows():
    langs = {b.lang for b in blocks()}
    assert langs <= {"bash", "yaml", "python"}, langs
    for b in of("yaml") + of("python"):
        assert b.marker.startswith(("file ", "vllm ")), f"a {b.lang} block without its guide-test marker:\n{b.text}"


# ---- the work directory the page describes: shardcast/ (the checkout) beside cluster/ and rl/ ----

def work_dir(tmp_path: Path, cluster_variant: str = "gpu") -> Path:
    """The reader's directory: the checkout as `shardcast/`, the page's files written where it says
    (the kustomization of `cluster/` in the given variant), and the page's `mkdir`/`cp` run."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "shardcast").symlink_to(ROOT)
    for b in blocks():
        if b.marker.startswith("file "):
            path, _, variant = b.marker[len("file "):].partition(", ")
            if variant and variant != cluster_variant:
                continue
            (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / path).write_text(b.text)
    for command in commands():
        if command.argv[0] in ("mkdir", "cp"):
            subprocess.run(command.argv, cwd=tmp_path / command.cwd, check=True)
    return tmp_path


def validated(objects: List[dict], where: str) -> List[dict]:
    problems = [f"{o['kind']}/{o['metadata'].get('name')}: {validate.problem(o)}" for o in objects if validate.problem(o)]
    assert not problems, f"{where}: " + "; ".join(problems)
    return objects


def load(path: Path) -> List[dict]:
    return validated([d for d in yaml.safe_load_all(path.read_text()) if d], str(path))


@pytest.mark.parametrize("variant", ["gpu", "gpu+rdma"])
def test_the_daemons_kustomization_renders_as_the_shipped_components_do(kubectl, tmp_path, variant):
    """cluster/kustomization.yaml, relative paths into the checkout: the shipped deployment of the
    same components, with the reader's registry; gpu+rdma with the CUDA transports and the NIC list."""
    text = file_block("cluster/kustomization.yaml", variant)
    assert yaml.safe_load(text)["kind"] == "Kustomization"
    assert not any(p.startswith("/") for p in yaml.safe_load(text)["resources"]), "kustomize refuses absolute paths"
    objects = validated(render(work_dir(tmp_path, variant) / "cluster"), variant)
    shipped = render_deployment(variant)
    daemon = daemonset_pod(objects)["containers"][0]
    version = daemonset_pod(shipped)["containers"][0]["image"].split(":")[1]
    assert version.endswith("-cuda")
    assert daemon["image"] == f"{REGISTRY}/shardcastd:{version}"
    # Apart from the registry (and the NIC list, below) what the shipped components render.
    env = {e["name"]: e.get("value") for e in daemon["env"]}
    if variant == "gpu+rdma":
        wanted = re.search(r"name: UCX_NET_DEVICES\n\s+value: (\S+)", text).group(1)
        assert [e["value"] for e in daemon["env"] if e["name"] == "UCX_NET_DEVICES"] == [wanted]
        for container in (daemonset_pod(shipped)["containers"][0], daemonset_pod(objects)["containers"][0]):
            container["env"] = [e for e in container["env"] if e["name"] != "UCX_NET_DEVICES"]  # compared above
        tls = by_kind(objects, "ConfigMap")["shardcastd-config"]["data"]["SHARDCAST_UCX_TLS"]
        assert {"rc_x", "cuda_copy", "cuda_ipc", "gdr_copy"} <= set(tls.split(","))
        assert f"SHARDCAST_UCX_TLS={tls}" in GUIDE.read_text(), "the page quotes the list the components set"
        assert daemonset_pod(objects)["hostNetwork"] is True
    assert env.get("NVIDIA_VISIBLE_DEVICES") == "all"
    ours = lambda o: str(o).replace("ghcr.io/shardcast/shardcastd:", f"{REGISTRY}/shardcastd:")  # noqa: E731
    assert sorted(map(str, objects)) == sorted(map(ours, shipped))
    namespace = by_kind(objects, "Namespace")["shardcast"]
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"


def gpus(pod: dict) -> int:
    return sum(int(c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0)) for c in pod["containers"])


def test_the_workloads_reach_the_daemon_and_hold_whole_nodes(kubectl, tmp_path):
    """rl/: the vLLM fleet (kustomization) and the trainer Job (apply -f), in the namespace the page
    creates, beside the daemons: every container that mounts the daemon's socket directory trusts
    its uid, GPU pods take every GPU of their node one pod per node, the headless Service leads
    the trainer to the servers, and the images are the reader's."""
    work = work_dir(tmp_path)
    daemons = render(work / "cluster")
    daemonset = daemonset_pod(daemons)
    mount = next(m for m in daemonset["containers"][0]["volumeMounts"] if m["mountPath"] == "/run/shardcast")
    socket_dir = next(v["hostPath"]["path"] for v in daemonset["volumes"] if v["name"] == mount["name"])
    uid = daemonset["securityContext"]["runAsUser"]
    rl = validated(render(work / "rl"), "rl")
    applied = [load(work / c.target) for c in commands() if c.verb == "apply -f"]
    namespace = by_kind(sum(applied, []), "Namespace")["rl"]
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    workloads = rl + sum(applied, [])
    pods = {o["metadata"]["name"]: (o, o["spec"]["template"]["spec"]) for o in workloads if "template" in o.get("spec", {})}
    assert set(pods) == {"rl-inference", "rl-trainer"}, set(pods)
    for name, (o, pod) in pods.items():
        assert o["metadata"]["namespace"] == "rl", name
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounting = [c for c in pod["containers"] for m in c.get("volumeMounts", [])
                    if m["mountPath"] == "/run/shardcast"
                    and volumes[m["name"]].get("hostPath", {}).get("path") == socket_dir]
        assert mounting, f"{name} does not mount the daemon's socket directory"
        for c in mounting:
            env = {e["name"]: e.get("value", "") for e in c.get("env", [])}
            assert str(uid) in env.get("SHARDCAST_DAEMON_UID", "").split(","), f"{name}/{c['name']}"
        assert pod["hostIPC"] is True and daemonset["securityContext"]["runAsGroup"] in pod["securityContext"]["supplementalGroups"]
        assert pod["nodeSelector"]["nvidia.com/gpu.count"] == str(gpus(pod)), name
        labels = o["spec"]["template"]["metadata"]["labels"]
        [term] = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert term["topologyKey"] == "kubernetes.io/hostname" and term["labelSelector"]["matchLabels"].items() <= labels.items()
    vllm = pods["rl-inference"][1]["containers"][0]
    assert vllm["image"].startswith(f"{REGISTRY}/vllm-shardcast:")
    assert vllm["command"][vllm["command"].index("--tensor-parallel-size") + 1] == str(gpus(pods["rl-inference"][1]))
    service = by_kind(rl, "Service")["rl-inference"]
    assert service["spec"]["clusterIP"] == "None" and service["metadata"]["namespace"] == "rl"
    [port] = service["spec"]["ports"]
    # What the trainer's code resolves: <service>.<namespace>.svc, on the servers' port.
    [finder] = [b for b in of("python") if b.marker.endswith(" find_servers")]
    assert f'"{service["metadata"]["name"]}.rl.svc", {port["port"]}' in finder.text
    assert f":{port['port']}\"" in finder.text
    replicas = pods["rl-inference"][0]["spec"]["replicas"]
    assert f"EXPECTED = {replicas}" in finder.text
    # The page's own label selectors select these pods.
    for c in commands():
        for selector in c.options.get("-l", []):
            wanted = dict(kv.split("=") for kv in selector.split(","))
            assert any(wanted.get("app") == o["spec"]["template"]["metadata"]["labels"]["app"] for o, _ in pods.values()), selector


# ---- the commands: every program, subcommand and flag exists ----

class Command(NamedTuple):
    argv: List[str]
    cwd: str  # relative to the work directory, as the block's `cd`s leave it
    stdin: str  # a `<` redirection's file, "" for none

    @property
    def verb(self) -> str:
        """kubectl's subcommand, with -f or -k for apply ("apply -k"); "" for other programs."""
        if self.argv[0] != "kubectl":
            return ""
        words = kubectl_words(self.argv)
        return " ".join(words + [f for f in self.argv if f in ("-f", "-k")][:1] if words == ["apply"] else words)

    @property
    def target(self) -> str:
        """The last argument (what apply -f/-k and kustomize take), from the work directory."""
        return os.path.normpath(os.path.join(self.cwd, self.argv[-1]))

    @property
    def options(self) -> Dict[str, List[str]]:
        found: Dict[str, List[str]] = {}
        for a, b in zip(self.argv, self.argv[1:] + [""]):
            if a.startswith("-") and "=" not in a:
                found.setdefault(a, []).append(b)
        return found


SEPARATORS = {"|", "||", "&&", ";", "&", "(", ")", "))", "$", "do", "done"}


@functools.lru_cache(maxsize=None)
def commands() -> List[Command]:
    """The simple commands of every bash block, in order, with the directory each runs in."""
    found: List[Command] = []
    cwd = "."
    for b in of("bash"):
        text = b.text.replace("\\\n", " ")
        for line in text.splitlines():
            lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|()<")
            lexer.whitespace_split = True
            tokens = list(lexer)
            current: List[str] = []
            for t in tokens + [";"]:
                if t in SEPARATORS:
                    if current:
                        argv, stdin = current, ""
                        if "<" in argv:
                            stdin = argv[argv.index("<") + 1]
                            argv = argv[:argv.index("<")]
                        if argv[0] == "for":
                            argv = []
                        if argv and "=" in argv[0] and argv[0].endswith("="):
                            argv = []  # an assignment: its command substitution is split out above
                        if argv and argv[0] == "cd":
                            cwd = os.path.normpath(os.path.join(cwd, argv[1]))
                        elif argv:
                            found.append(Command(argv, cwd, stdin))
                    current = []
                else:
                    current.append(t)
    return found


def kubectl_words(argv: List[str]) -> List[str]:
    """kubectl's subcommand words: what comes before the first flag or argument that is not one."""
    words, rest = [], argv[1:]
    i = 0
    while i < len(rest):
        a = rest[i]
        if a == "-n":
            i += 2
            continue
        if a.startswith("-") or a == "--":
            break
        words.append(a)
        i += 1
    known = {"create namespace", "create secret generic", "rollout status"}
    for n in (3, 2):
        if " ".join(words[:n]) in known:
            return words[:n]
    return words[:1]


@functools.lru_cache(maxsize=None)
def help_text(*argv: str) -> str:
    out = subprocess.run([*argv, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"{' '.join(argv)} --help: {out.stderr}"
    return out.stdout


def check_flags(flags: List[str], text: str, where: str) -> None:
    for f in flags:
        if f.startswith("--"):
            assert re.search(rf"(^|[\s,]){re.escape(f.split('=')[0])}[\s=\[]", text, re.M), f"{where}: no flag {f}"
        else:
            for letter in f[1:]:  # -it: -i and -t
                assert re.search(rf"(^|\s)-{letter}[,\s]", text, re.M), f"{where}: no flag -{letter}"


def flags_of(argv: List[str]) -> List[str]:
    return [a for a in argv if a.startswith("-") and a not in ("-", "--")]


def test_every_command_exists_with_its_flags(kubectl, tmp_path):
    """kubectl subcommands and flags against kubectl's help, the shardcast CLI's against the built
    CLI, docker's against the Dockerfiles (targets, build args), scripts run as written, the
    metrics grepped for exist, and the files piped into pods are the page's scripts."""
    work = work_dir(tmp_path / "work")
    globals_text = subprocess.run([kubectl, "options"], capture_output=True, text=True, check=True).stdout
    metric_families = set(re.findall(r'"(shardcast_[a-z_]+)"', (ROOT / "daemon" / "server" / "metrics.cc").read_text()))
    built: List[str] = []
    seen = set()
    for c in commands():
        program = c.argv[0]
        seen.add(program)
        if program == "kubectl":
            words = kubectl_words(c.argv)
            inner = c.argv[c.argv.index("--") + 1:] if "--" in c.argv else []
            own = c.argv[:len(c.argv) - len(inner) - (1 if inner else 0)]
            check_flags([f for f in flags_of(own) if f != "-n"], help_text(kubectl, *words) + globals_text,
                        " ".join(own))
            if c.verb in ("apply -k", "kustomize"):
                validated(render(work / c.target), c.target)
            elif c.verb == "apply -f":
                load(work / c.target)
            else:
                assert words != ["apply"], c.argv
            if inner and inner[0] == "python3":
                check_python(inner, c.stdin)
            elif inner:
                assert inner[0] == "shardcast", inner
                check_shardcast(inner)
        elif program == "shardcast":
            check_shardcast(c.argv)
        elif program == "docker":
            dockerfile = work / c.cwd / c.argv[c.argv.index("-f") + 1] if c.argv[1] == "build" else None
            if c.argv[1] == "build":
                text = dockerfile.read_text()
                if "--target" in c.argv:
                    assert re.search(rf"^FROM .* AS {c.argv[c.argv.index('--target') + 1]}$", text, re.M | re.I)
                for arg in c.options.get("--build-arg", []):
                    assert re.search(rf"^ARG {arg.split('=')[0]}\b", text, re.M), f"{dockerfile}: no ARG {arg}"
                built.append(c.argv[c.argv.index("-t") + 1])
                assert c.argv[-1] == "." and (work / c.cwd / "deploy").is_dir(), "built from the repository's root"
            else:
                assert c.argv[1] == "push" and c.argv[2] in built, c.argv
        elif program == "bash":
            script = ROOT / os.path.relpath(work / c.cwd / c.argv[1], work / "shardcast")
            assert script.exists(), script
            certs = tmp_path / "certs"
            subprocess.run(["bash", str(script), str(certs)], check=True, capture_output=True)
            # The files the Secret is made from, where the page's later command takes them.
            for cmd in commands():
                for spec in cmd.options.get("--from-file", []) + [a.split("=", 1)[1] for a in cmd.argv
                                                                  if a.startswith("--from-file=")]:
                    source = spec.split("=", 1)[1]
                    assert source.startswith(c.argv[2] + "/") and (certs / Path(source).name).exists(), spec
        elif program == "grep":
            patterns = [p for f, p in zip(c.argv, c.argv[1:]) if f == "-e"]
            assert patterns
            metrics = [p for p in patterns if p.startswith("shardcast_")]
            assert set(metrics) <= metric_families, set(metrics) - metric_families
        elif program == "curl":
            assert "9464/metrics" in c.argv[-1]
            daemon = daemonset_pod(render_deployment("base"))["containers"][0]
            assert any(a.startswith("--metrics=") and a.endswith(":9464") for a in daemon["args"])
            forwarded = [x for x in commands() if x.verb == "port-forward"]
            assert forwarded and forwarded[0].argv[-1] == "9464:9464"
        elif program == "python3":
            check_python(c.argv, c.stdin)
        elif program in ("mkdir", "cp", "wait"):
            pass  # run by work_dir, or bash's own
        else:
            pytest.fail(f"the guide runs {program}, which this test does not check: {c.argv}")
    assert {"kubectl", "docker", "bash", "grep", "curl"} <= seen, seen
    # Every shardcast command the page runs inside a daemon pod.
    inner = [c.argv[c.argv.index("--") + 1:] for c in commands() if "--" in c.argv]
    assert {a[1] for a in inner if a[0] == "shardcast"} >= {"status", "top", "layouts"}


def check_python(argv: List[str], stdin: str) -> None:
    """python3 - ARGS < FILE: FILE is one of the page's scripts."""
    scripts = {b.marker[len("file "):] for b in of("python") if b.marker.startswith("file ")}
    assert argv[1] == "-" and stdin in scripts, (argv, stdin)


def check_shardcast(argv: List[str]) -> None:
    cli = binary("shardcast")
    check_flags(flags_of(argv), help_text(cli, argv[1]), " ".join(argv))


def test_the_quoted_sections_and_error_texts_exist():
    """Every `docs/X.md, "Section"` the page points to is a heading there, and every error text it
    quotes is one the code produces (adjacent string literals joined, as the compiler does)."""
    text = GUIDE.read_text()
    refs = re.findall(r'docs/([a-z_-]+\.md)[,]? \(?"([^"]+)"', text)
    assert len(refs) >= 4, refs
    for page, section in refs:
        headings = {h.replace("`", "") for h in re.findall(r"^#+ (.*)$", (ROOT / "docs" / page).read_text(), re.M)}
        assert section.replace("`", "") in headings, f'docs/{page} has no section "{section}"'
    def code(path: str) -> str:
        source = (ROOT / path).read_text()
        return re.sub(r'"\s*\n\s*f?"|"\s*,?\s*\n\s*"', "", source)  # "a " f"b" / strCat("a ", \n "b")
    quoted = {
        "not a daemon this client trusts (if it is your deployment's shardcastd, set SHARDCAST_DAEMON_UID=":
            "client/python/shardcast/client.py",
        "is not reachable (is the daemon running?)": "client/python/shardcast/client.py",
        "these transports cannot bound a peer's writes to the registered region": "transport/ucx/ucx_options.cc",
        "replicas can take part, at least ": "daemon/coordinator/gather.cc",
        "fewer than min_replicas=": "client/python/shardcast/vllm/trainer.py",
    }
    flat = re.sub(r"\s+", " ", text)
    for quote, path in quoted.items():
        assert quote in flat, f"the page no longer quotes {quote!r}: update this list"
        assert quote in code(path), f"{path} does not say {quote!r}"
    assert "SHARDCAST_DELTA_CACHE_MIB" in text
    configmap = yaml.safe_load((K8S / "base" / "configmap.yaml").read_text())
    assert f"`SHARDCAST_DELTA_CACHE_MIB` in the ConfigMap `{configmap['metadata']['name']}`, " \
           f"{configmap['data']['SHARDCAST_DELTA_CACHE_MIB']} in the base" in flat


# ---- step 4: the scripts, as written, against local daemons ----

def test_the_smoke_scripts_sync_bf16_into_an_fp8_replica_set_with_deltas(tmp_path):
    """Three replicas (k 0, 1, 2) on daemons of their own and the source on a fourth, each script
    fed to python3 on stdin with the page's arguments: every version reaches 3/3 replicas, the
    first dense, the next ones as deltas of a few bytes, and each replica holds the fp8 scales of
    torch's block quantisation of the source's weight."""
    torch = pytest.importorskip("torch")
    from shardcast.fp8 import block_quantize

    bash = "\n".join(b.text for b in of("bash"))
    assert 'for k in 0 1 2; do kubectl -n rl exec -i "${pods[$((k + 1))]}" -- python3 - "$k" < smoke_replica.py' in bash
    assert 'kubectl -n rl exec -i "${pods[0]}" -- python3 - 3 < smoke_trainer.py' in bash
    scripts = {name: tmp_path / name for name in ("smoke_replica.py", "smoke_trainer.py")}
    for name, path in scripts.items():
        path.write_text(file_block(name))
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SHARDCAST_")}
    with LocalCluster(["n0", "n1", "n2", "n3"]) as cluster:
        def run(script: str, arg: str, node: str) -> subprocess.Popen:
            with open(scripts[script]) as stdin:
                return subprocess.Popen([sys.executable, "-", arg], stdin=stdin, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
                                        env={**clean, "SHARDCAST_ADDRESS": cluster.target(node)})
        replicas = [run("smoke_replica.py", str(k), f"n{k + 1}") for k in range(3)]
        trainer = run("smoke_trainer.py", "3", "n0")
        try:
            out, _ = trainer.communicate(timeout=180)
            outs = [p.communicate(timeout=60)[0] for p in replicas]
        finally:
            for p in replicas + [trainer]:
                p.kill()
    assert trainer.returncode == 0, out
    lines = out.splitlines()
    assert len(lines) == 3, out
    for version, line in enumerate(lines, start=1):
        m = re.fullmatch(r"version (\d): (\d)/(\d) replicas, (\d+) bytes planned, (\d+) on the wire \((\d+) delta chunks\)", line)
        assert m, line
        v, committed, total, planned, wire, deltas = map(int, m.groups())
        assert (v, committed, total) == (version, 3, 3), line
        if version == 1:
            assert deltas == 0 and wire == planned, line
        else:
            assert deltas > 0 and wire < 1000, line
    # What the source's weight is at each version, quantised as vLLM's fp8 layers hold it.
    weight = (torch.randn(512, 512, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    scales = []
    for version in (1, 2, 3):
        weight[version, :8] += 0.01
        scales.append(block_quantize(weight, (128, 128))[1][0, 0].item())
    for k, (p, text) in enumerate(zip(replicas, outs)):
        assert p.returncode == 0, text
        assert text.splitlines() == [f"replica {k}: version {v}" for v in (1, 2, 3)] + [
            f"replica {k}: version 3 in fp8, first block's scale {scales[2]:.3g}"], text


# ---- step 5: the trainer's code, which needs vLLM ----

VLLM_TEST = ROOT / "client" / "python" / "vllm_tests" / "test_k8s_guide.py"


def test_the_trainer_code_is_what_the_vllm_test_runs():
    """The blocks marked for vLLM name the vLLM test that runs them; that test reads them from this
    page by the same marker (so it runs exactly this code), and the API they use exists."""
    marked = [b for b in of("python") if b.marker.startswith("vllm ")]
    assert [b.marker.split()[2] for b in marked] == ["find_servers", "train"]
    test = VLLM_TEST.read_text()
    for b in marked:
        _, path, name = b.marker.split()
        assert ROOT / path == VLLM_TEST
        assert f'guide_block("{name}")' in test, f"{path} does not run the block {name}"
        compile(b.text, name, "exec")
    assert "guide-rl-kubernetes.md" in test and "<!-- guide-test: vllm " in test
    # ShardcastTrainerInitInfo's keywords are its fields (vLLM is not in this venv: read the source).
    trainer_src = (ROOT / "client" / "python" / "shardcast" / "vllm" / "trainer.py").read_text()
    info = next(n for n in ast.walk(ast.parse(trainer_src)) if isinstance(n, ast.ClassDef) and n.name == "ShardcastTrainerInitInfo")
    fields = {n.target.id for n in info.body if isinstance(n, ast.AnnAssign)} | {"rank"}
    train = next(b for b in marked if b.marker.endswith(" train")).text
    call = next(n for n in ast.walk(ast.parse(train)) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "ShardcastTrainerInitInfo")
    used = {k.arg for k in call.keywords}
    assert {"delta", "min_replicas", "replica_deadline_s"} <= used
    assert used <= fields, used - fields
    assert {"engine.replicas", "engine.send_weights", "engine.shutdown", "servers.updated",
            "engine.add_replica"} <= set(re.findall(r"\b(?:engine|servers)\.\w+", GUIDE.read_text()))
    clients_src = (ROOT / "client" / "python" / "shardcast" / "vllm" / "clients.py").read_text()
    for attr in ("replicas", "send_weights", "shutdown", "add_replica"):
        assert re.search(rf"def {attr}\(|self\.{attr}\b", trainer_src), attr
    assert "self.updated" in clients_src


def test_find_servers_makes_one_http_client_per_ready_server(monkeypatch):
    """The lookup of step 5 run here with vLLM's HTTP client stubbed (its constructor takes the base
    URL: the vLLM test checks the real one): it waits while the name does not resolve, and then
    drives every address once, on the servers' port."""
    made = []

    class HTTPVLLMWeightSyncClient:
        def __init__(self, base_url: str) -> None:
            made.append(base_url)
            self.base_url = base_url

    modules = {}
    for name in ("vllm", "vllm.distributed", "vllm.distributed.weight_transfer",
                 "vllm.distributed.weight_transfer.clients"):
        modules[name] = types.ModuleType(name)
    modules["vllm.distributed.weight_transfer.clients"].HTTPVLLMWeightSyncClient = HTTPVLLMWeightSyncClient
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    answers = [socket.gaierror(socket.EAI_NONAME, "no ready server"),
               [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.7", 8000))],
               [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, 8000)) for a in ("10.0.0.9", "10.0.0.7", "10.0.0.9")]]
    asked = []

    def getaddrinfo(host, port, *args, **kwargs):
        asked.append((host, port))
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    import time
    monkeypatch.setattr(time, "sleep", lambda s: None)
    [block] = [b for b in of("python") if b.marker.endswith(" find_servers")]
    namespace: dict = {}
    exec(compile(block.text, "find_servers", "exec"), namespace)
    servers = namespace["find_servers"](2)
    assert asked == [("rl-inference.rl.svc", 8000)] * 3
    assert made == ["http://10.0.0.7:8000", "http://10.0.0.9:8000"]
    assert type(servers).__name__ == "ReplicaClients" and [c.base_url for c in servers.clients] == made
