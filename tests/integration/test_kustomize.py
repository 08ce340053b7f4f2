"""`kubectl apply -k manifests/cluster-wide/` (the opt-in; manifests/ is the namespaced default, which
test_helm keeps equal to the chart's) into the rig's apiserver, then the operator that install defines, run
out of cluster as its ServiceAccount (kiln-system/kiln-operator), reconciles the quickstart sample in a
namespace of its own: its rights come from the ClusterRoleBinding, and its admission policy lets a run's
writes through."""

from __future__ import annotations

import pytest
import yaml

from tests.support.helm import MANIFESTS, operator_from_deployment, reconcile_sample
from tests.support.ranks import SAFETY_TIMEOUT_S

pytestmark = pytest.mark.rig


def test_apply_k_then_the_operator_reconciles_a_sample(rig, namespace, tmp_path):
    overlay = MANIFESTS / "cluster-wide"
    objs = [d for d in yaml.safe_load_all(rig.kubectl("kustomize", str(overlay)).stdout) if d]
    # A namespace left Terminating by an earlier run refuses new objects: let it go first.
    rig.kubectl("wait", "--for=delete", "namespace/kiln-system", f"--timeout={SAFETY_TIMEOUT_S}s", check=False)
    fresh = rig.kubectl("get", "namespace", "kiln-system", check=False).returncode != 0
    rig.kubectl("apply", "-k", str(overlay))  # as docs/install.md says
    try:
        rig.kubectl("wait", "--for=condition=Established",
                    f"--timeout={SAFETY_TIMEOUT_S}s", "crd/trainingspecs.kiln.dev")
        deployment = next(o for o in objs if o["kind"] == "Deployment")
        assert rig.kubectl("get", "deployment", "kiln-operator", "-n", "kiln-system").returncode == 0
        sa = deployment["spec"]["template"]["spec"]["serviceAccountName"]
        kubeconfig = rig.kubeconfig_for_service_account("kiln-system", sa)
        # The install watches every namespace; this run watches only the test's, as a user's --namespace
        # flag would, so that it never reconciles another test's runs.
        with operator_from_deployment(deployment, kubeconfig, tmp_path / "operator.log",
                                      extra_args=(f"--namespace={namespace}",)) as (_, metrics):
            job = reconcile_sample(rig, namespace, metrics)
        assert job["metadata"]["ownerReferences"][0]["kind"] == "TrainingSpec"
    finally:
        if fresh:
            # Remove what grants, limits or runs something: the namespace (with the Deployment, Service and
            # ServiceAccount), the binding and the admission policy. Keep the CRD (every TrainingSpec) and the ClusterRoles: other
            # tests on this rig apply and bind the same manifests/rbac roles.
            for obj in objs:
                if obj["kind"] in ("Namespace", "ClusterRoleBinding", "ValidatingAdmissionPolicy",
                                   "ValidatingAdmissionPolicyBinding"):
                    rig.kubectl("delete", obj["kind"], obj["metadata"]["name"], "--wait=false",
                                "--ignore-not-found", check=False)
