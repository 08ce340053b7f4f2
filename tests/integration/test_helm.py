"""The Helm chart against the rig's real apiserver: lint, schema, install, the operator running as the
chart's own ServiceAccount, uninstall. Also: the chart's default render is the kustomize install.

helm and kubectl are the rig's (KILN_RIG_BIN); `helm template` and `kubectl kustomize` need no cluster,
but every test here uses the rig's binaries, so all are rig tests.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
import yaml

from tests.rig.install import CHART, KUBE, helm, render
from tests.support.helm import MANIFESTS, REPO, get, operator_from_deployment, reconcile_sample
from tests.support.ranks import SAFETY_TIMEOUT_S

pytestmark = pytest.mark.rig

CRD_NAME = "trainingspecs.kiln.dev"


def kustomize(rig, root: Path = MANIFESTS) -> list[dict]:
    return [d for d in yaml.safe_load_all(rig.kubectl("kustomize", str(root)).stdout) if d]


def ident(obj: dict) -> tuple[str, str, str]:
    return obj["kind"], obj["metadata"]["name"], obj["metadata"].get("namespace", "")


def by_ident(objs: list[dict]) -> dict[tuple, dict]:
    return {ident(o): o for o in objs}


# --- render-only ----------------------------------------------------------------------------------


def test_helm_lint_passes_with_default_and_optional_values(rig):
    helm(rig, "lint", "--strict", str(CHART), *KUBE)
    helm(rig, "lint", "--strict", str(CHART), *KUBE, "--set", "watchNamespaces={ml,research}",
         "--set", "metrics.serviceMonitor.enabled=true", "--set", "dashboards.enabled=true",
         "--set", "metrics.prometheusRule.enabled=true", "--set", "runLabelPolicy.enabled=true")
    helm(rig, "lint", "--strict", str(CHART), *KUBE, "--set", "clusterWide=true", "--set", "runLabelPolicy.enabled=true")


@pytest.mark.parametrize("setting,says", [
    ("watchNamespaces=ml", "watchNamespaces"),                 # a string where a list belongs
    ("image.pullPolicy=Sometimes", "pullPolicy"),              # not an enum value
    ("metrics.port=70000", "port"),                            # out of range
    ("operator.resource.requests.cpu=1", "resource"),          # a misspelt key
])


def test_values_schema_refuses_bad_values(rig, setting, says):
    proc = helm(rig, "template", "kiln", str(CHART), *KUBE, "--set", setting, check=False)
    assert proc.returncode != 0 and says in proc.stderr and "values don't meet the specifications" in proc.stderr, \
        proc.stderr


@pytest.mark.parametrize("values,overlay", [((), MANIFESTS), (("--set", "clusterWide=true"), MANIFESTS / "cluster-wide")])
def test_default_render_is_the_kustomize_install(rig, values, overlay):
    """The namespaced default (and the cluster-wide opt-in): the chart and `kubectl apply -k` define the same."""
    chart, plain = by_ident(render(rig, *values)), by_ident(kustomize(rig, overlay))
    # The namespace is Helm's --create-namespace, a file of its own in manifests/.
    assert ("Namespace", "kiln-system", "") in plain
    assert set(chart) == set(plain) - {("Namespace", "kiln-system", "")}
    for key, obj in chart.items():
        other = plain[key]
        if obj["kind"] in ("ClusterRole", "Role"):
            assert obj["rules"] == other["rules"], key
        elif obj["kind"] in ("ClusterRoleBinding", "RoleBinding"):
            assert (obj["roleRef"], obj["subjects"]) == (other["roleRef"], other["subjects"]), key
        elif obj["kind"] in ("CustomResourceDefinition", "ValidatingAdmissionPolicy",
                             "ValidatingAdmissionPolicyBinding", "NetworkPolicy"):
            assert obj["spec"] == other["spec"], key
        elif obj["kind"] == "Service":
            assert (obj["spec"]["ports"], obj["spec"]["selector"]) == (other["spec"]["ports"], other["spec"]["selector"])
        elif obj["kind"] == "Deployment":
            a, b = obj["spec"], other["spec"]
            assert (a["replicas"], a["strategy"], a["selector"]) == (b["replicas"], b["strategy"], b["selector"])
            pa, pb = a["template"]["spec"], b["template"]["spec"]
            for field in ("serviceAccountName", "securityContext", "volumes"):
                assert pa[field] == pb[field], field
            assert pa["containers"] == pb["containers"]


def test_default_deployment_is_hardened_and_probed(rig):
    deployment = next(o for o in render(rig) if o["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["resources"]["requests"].keys() >= {"cpu", "memory"}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    env = {e["name"]: e.get("value") for e in container["env"]}  # POD_ID comes from the downward API
    assert int(env["KILN_HEALTH_PORT"]) == ports["health"] and int(env["KILN_METRICS_PORT"]) == ports["metrics"]
    assert container["args"] == ["--namespace=default"]  # namespaced by default: where the samples go


def test_watched_namespaces_get_namespaced_grants_only(rig):
    objs = render(rig, "--set", "watchNamespaces={ml,research}")
    bindings = [o for o in objs if o["kind"] in ("RoleBinding", "ClusterRoleBinding")]
    assert sorted(ident(b) for b in bindings) == [
        ("ClusterRoleBinding", "kiln-operator-cluster", ""),
        ("RoleBinding", "kiln-operator", "ml"), ("RoleBinding", "kiln-operator", "research"),
        ("RoleBinding", "kiln-operator-leader", "kiln-system")]  # leader election, in the operator's namespace
    cluster_role = next(o for o in objs if ident(o) == ("ClusterRole", "kiln-operator-cluster", ""))
    # Cluster-wide, exactly the source's rules on cluster-scoped resources, as the apiserver scopes them.
    scoped = {n.split(".")[0] for n in rig.kubectl("api-resources", "--namespaced=false", "-o", "name").stdout.split()}
    scoped.add("clusterqueues")  # Kueue's, cluster-scoped; served only once a test has installed Kueue on the rig
    source = yaml.safe_load((MANIFESTS / "rbac" / "operator-clusterrole.yaml").read_text())["rules"]
    assert all(set(r["resources"]) <= scoped or not set(r["resources"]) & scoped for r in source), \
        "a rule mixes cluster-scoped and namespaced resources: split it"
    assert cluster_role["rules"] == [r for r in source if set(r["resources"]) <= scoped]
    assert {"customresourcedefinitions", "namespaces"} <= {x for r in cluster_role["rules"] for x in r["resources"]}
    deployment = next(o for o in objs if o["kind"] == "Deployment")
    assert deployment["spec"]["template"]["spec"]["containers"][0]["args"] == \
        ["--namespace=ml", "--namespace=research"]


def test_cluster_wide_is_an_explicit_opt_in(rig):
    default = render(rig)
    assert not [o for o in default if ident(o) == ("ClusterRoleBinding", "kiln-operator", "")]
    assert ("RoleBinding", "kiln-operator", "default") in by_ident(default)
    wide = render(rig, "--set", "clusterWide=true")
    binding = by_ident(wide)[("ClusterRoleBinding", "kiln-operator", "")]
    assert binding["roleRef"]["name"] == "kiln-operator"
    assert not [o for o in wide if o["kind"] == "RoleBinding" and o["metadata"]["name"] == "kiln-operator"]
    assert "args" not in next(o for o in wide if o["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]
    proc = helm(rig, "template", "kiln", str(CHART), *KUBE, "--set", "watchNamespaces=null", check=False)
    assert proc.returncode != 0 and "watchNamespaces is empty" in proc.stderr and "clusterWide=true" in proc.stderr
    # no rule of the operator's may grant more than it holds, or act as someone else
    verbs = {v for o in wide if o["kind"] in ("ClusterRole", "Role") for r in o["rules"] for v in r["verbs"]}
    assert not verbs & {"escalate", "bind", "impersonate", "*"}, verbs


def test_image_digest_and_the_operators_network_policy(rig):
    digest = "sha256:" + "ab" * 32
    deployment = next(o for o in render(rig, "--set", f"image.digest={digest}") if o["kind"] == "Deployment")
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == f"ghcr.io/kiln-dev/kiln-operator@{digest}"
    proc = helm(rig, "template", "kiln", str(CHART), *KUBE, "--set", "image.digest=latest", check=False)
    assert proc.returncode != 0 and "digest" in proc.stderr
    objs = render(rig, "--set", "metrics.monitoringNamespace=prom")
    policy = by_ident(objs)[("NetworkPolicy", "kiln-operator", "kiln-system")]
    pod_labels = next(o for o in objs if o["kind"] == "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert policy["spec"]["ingress"] == [
        {"ports": [{"protocol": "TCP", "port": 8080}]},
        {"from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "prom"}}}],
         "ports": [{"protocol": "TCP", "port": 9090}]}]
    env = {e["name"]: e.get("value") for e in next(
        o for o in objs if o["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["KILN_MONITORING_NAMESPACE"] == "prom"  # the trainers' NetworkPolicy admits the same namespace


def test_optional_servicemonitor_and_dashboard(rig):
    objs = render(rig, "--set", "metrics.serviceMonitor.enabled=true", "--set", "dashboards.enabled=true",
                  "--set", "metrics.serviceMonitor.labels.release=prom")
    monitor = next(o for o in objs if o["kind"] == "ServiceMonitor")
    service = next(o for o in objs if o["kind"] == "Service")
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"] == "metrics"
    dashboard = next(o for o in objs if o["kind"] == "ConfigMap")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["kiln.json"]) == json.loads((CHART / "dashboards" / "kiln.json").read_text())
    default_kinds = {o["kind"] for o in render(rig)}
    assert not default_kinds & {"ServiceMonitor", "ConfigMap", "PrometheusRule"}  # off by default: no CRD needed


def test_optional_prometheusrule_carries_the_tested_alert_rules(rig):
    objs = render(rig, "--set", "metrics.prometheusRule.enabled=true", "--set", "metrics.prometheusRule.labels.release=prom")
    rule = next(o for o in objs if o["kind"] == "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "prom"
    # the groups promtool tests (tests/unit/test_alerts.py), with their templates left for Prometheus
    rules_file = yaml.safe_load((REPO / "manifests" / "monitoring" / "kiln-alerts.yaml").read_text())
    assert rule["spec"]["groups"] == rules_file["groups"]
    assert "{{ $labels.run }}" in json.dumps(rule["spec"])


# --- install into the real apiserver ----------------------------------------------------------------


def test_install_operator_as_chart_service_account_then_uninstall(rig, namespace, tmp_path):
    release = f"kiln-{uuid.uuid4().hex[:6]}"  # its own cluster-scoped names: other tests' objects stay apart
    # runs live apart from the operator: its admission policy refuses its writes in its own namespace
    runs = f"{namespace[:50]}-runs"
    rig.kubectl("create", "namespace", runs)
    install = helm(rig, "install", release, str(CHART), "--namespace", namespace,
                   "--set", f"watchNamespaces={{{runs}}}")
    uninstalled = False
    try:
        assert "kiln validate" in install.stdout and "kiln wait" in install.stdout  # NOTES: the next step
        rig.kubectl("wait", "--for=condition=Established", f"--timeout={SAFETY_TIMEOUT_S}s", f"crd/{CRD_NAME}")
        manifest = [d for d in yaml.safe_load_all(helm(rig, "get", "manifest", release, "-n", namespace).stdout) if d]
        deployment = next(o for o in manifest if o["kind"] == "Deployment")
        sa = deployment["spec"]["template"]["spec"]["serviceAccountName"]
        me = f"system:serviceaccount:{namespace}:{sa}"

        def can(*args: str) -> bool:
            return rig.kubectl("auth", "can-i", *args, f"--as={me}", check=False).stdout.strip() == "yes"

        assert can("create", "pytorchjobs.kubeflow.org", "-n", runs)
        assert can("patch", "trainingspecs.kiln.dev", "--subresource=status", "-n", runs)
        assert can("list", "customresourcedefinitions")
        assert not can("create", "pytorchjobs.kubeflow.org", "-n", "default")  # only the watched namespace
        assert not can("delete", "pytorchjobs.kubeflow.org", "-n", runs)  # garbage collection deletes
        assert not can("list", "secrets", "-n", runs)

        # the operator as installed, its admission policy active: a run's writes pass it
        kubeconfig = rig.kubeconfig_for_service_account(namespace, sa)
        with operator_from_deployment(deployment, kubeconfig, tmp_path / "operator.log") as (health, metrics):
            job = reconcile_sample(rig, runs, metrics)
            assert get(health)[0] == 200
        owner = job["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["name"]) == ("TrainingSpec", "quickstart")

        helm(rig, "uninstall", release, "--namespace", namespace, "--wait")
        uninstalled = True
        for obj in manifest:
            kind, name, ns = ident(obj)
            args = ["get", kind, name] + (["-n", ns] if ns else [])
            assert rig.kubectl(*args, check=False).returncode != 0, f"{kind} {name} survived helm uninstall"
        # Helm's convention: CRDs (and with them every TrainingSpec) stay.
        assert rig.kubectl("get", "crd", CRD_NAME, check=False).returncode == 0
        assert rig.kubectl("get", "trainingspec", "quickstart", "-n", runs, check=False).returncode == 0
    finally:
        if not uninstalled:  # the release's ClusterRoles and bindings outlive the test's namespace
            helm(rig, "uninstall", release, "--namespace", namespace, check=False)
        rig.kubectl("delete", "namespace", runs, "--wait=false", check=False)
