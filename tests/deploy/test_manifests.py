"""deploy/ agrees with the config it ships: the manifests (read with PyYAML) against
deploy/kubernetes/epick.toml (read with epick's own loader) and against what the code
answers and asks (the health service names, the InferencePool source's RBAC)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from epick import config as cfg
from epick.pool.k8s import RBAC_RULES, InferencePoolSourceConfig
from epick.pool.k8s_objects import parse_pool

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"


def docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((KUBE / name).read_text()) if d]


def one(kind: str) -> dict:
    found = [d for f in sorted(KUBE.glob("*.yaml")) if f.name != "kustomization.yaml"
             for d in docs(f.name) if d["kind"] == kind]
    assert len(found) == 1, f"{kind}: {len(found)} in deploy/kubernetes"
    return found[0]


@pytest.fixture(scope="module")
def config() -> cfg.Config:
    return cfg.load(KUBE / "epick.toml")


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def container() -> dict:
    (c,) = one("Deployment")["spec"]["template"]["spec"]["containers"]
    return c


def test_the_kustomization_lists_every_manifest_and_ships_the_config():
    kust = yaml.safe_load((KUBE / "kustomization.yaml").read_text())
    manifests = {f.name for f in KUBE.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kust["resources"]) == manifests
    (generator,) = kust["configMapGenerator"]
    assert generator["files"] == ["epick.toml"]
    volumes = one("Deployment")["spec"]["template"]["spec"]["volumes"]
    assert {"name": "config", "configMap": {"name": generator["name"]}} in volumes
    mount = next(m for m in container()["volumeMounts"] if m["name"] == "config")
    containerfile = (ROOT / "deploy" / "Containerfile").read_text()
    entry = re.search(r'ENTRYPOINT \[(.*)\]', containerfile).group(1)
    assert f'"{mount["mountPath"]}/epick.toml"' in entry
    assert "COPY deploy/kubernetes/epick.toml " + mount["mountPath"] + "/epick.toml" \
        in containerfile


def test_ports_agree_with_the_config(config):
    ports = {p["name"]: p["containerPort"] for p in container()["ports"]}
    assert ports == {"ext-proc": port_of(config.ext_proc.listen),
                     "pick": port_of(config.server.listen),
                     "metrics": port_of(config.server.metrics_listen)}
    service = one("Service")
    assert {p["name"]: (p["port"], p["targetPort"]) for p in service["spec"]["ports"]} == {
        name: (port, name) for name, port in ports.items()}
    assert service["spec"]["selector"] == \
        one("Deployment")["spec"]["template"]["metadata"]["labels"]
    # Listening on every interface (a Pod's IP), the admin API on loopback only.
    for address in (config.ext_proc.listen, config.server.listen,
                    config.server.metrics_listen):
        assert address.startswith("0.0.0.0:")
    assert config.admin.listen.startswith("127.0.0.1:")
    exposed = set(re.search(r"EXPOSE (.*)", (ROOT / "deploy" / "Containerfile").read_text())
                  .group(1).split())
    assert exposed == {str(p) for p in ports.values()}


def test_the_inference_pool_points_at_epicks_ext_proc_and_is_the_one_watched(config):
    pool = one("InferencePool")
    ref = pool["spec"]["endpointPickerRef"]
    service = one("Service")
    assert ref["name"] == service["metadata"]["name"]
    assert ref.get("kind", "Service") == "Service"
    assert ref["portNumber"] == port_of(config.ext_proc.listen)
    parse_pool(pool, "deploy/kubernetes/inferencepool.yaml")  # upstream's v1 shape
    (source,) = config.pool.sources
    assert isinstance(source, InferencePoolSourceConfig)
    assert source.name == pool["metadata"]["name"]
    assert not source.api_server and not source.kubeconfig  # in-cluster service account
    assert source.namespace in ("", pool["metadata"].get("namespace", ""))


def test_the_probes_ask_the_health_services_epick_serves(config):
    import inspect

    from epick import service
    text = inspect.getsource(service.Service._set_health)
    probes = {k: container()[k]["grpc"] for k in ("livenessProbe", "readinessProbe",
                                                   "startupProbe")}
    assert probes["livenessProbe"]["service"] == "liveness"
    assert probes["readinessProbe"]["service"] == "readiness"
    for probe in probes.values():
        assert f'"{probe["service"]}"' in text  # a name _set_health sets
        assert probe["port"] == port_of(config.ext_proc.listen)  # ext_proc serves health


def test_the_role_grants_exactly_what_the_source_asks(config):
    rules = {(g, r, tuple(sorted(rule["verbs"])))
             for rule in one("Role")["rules"]
             for g in rule["apiGroups"] for r in rule["resources"]}
    assert rules == {(g, r, tuple(sorted(v))) for g, r, v in RBAC_RULES}
    binding = one("RoleBinding")
    account = one("ServiceAccount")["metadata"]["name"]
    assert binding["roleRef"]["name"] == one("Role")["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    assert one("Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == account


def test_the_writable_paths_are_volumes(config):
    sc = container()["securityContext"]
    assert sc["readOnlyRootFilesystem"] and sc["runAsNonRoot"]
    mounts = {m["mountPath"] for m in container()["volumeMounts"]}
    assert any(config.runtime.cache_dir.startswith(m + "/") for m in mounts)
