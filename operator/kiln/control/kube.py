"""The operator's reads and writes against the apiserver (the only module here that does I/O).

Objects travel as plain dicts in the apiserver's own camelCase (reads use `_preload_content=False`),
so the pure functions in plan/status see exactly what `kubectl get -o json` shows.
"""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
import time
from datetime import datetime, timezone
from typing import Any

import yaml
from kubernetes import client, config as kconfig
from kubernetes.client.exceptions import ApiException

from kiln.api.contract import FT_SECRET_KEY
from kiln.api.spec import GROUP, PLURAL, VERSION
from kiln.api.contract import SPEC_FILE
from kiln.control.names import RUN_LABEL, names
from kiln.control.pytorchjob import S3_KEYS
from kiln.control.runs import Runs
from kiln.errors import KilnError

SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's parser when present (same result)

# The REST resource (plural) of every kind kiln writes. Known up front, so an apply is one request: a
# discovery client (kubernetes.dynamic) reads ~30 discovery documents first and re-reads them on a miss.
PLURALS = {
    ("v1", "ServiceAccount"): "serviceaccounts",
    ("v1", "ConfigMap"): "configmaps",
    ("rbac.authorization.k8s.io/v1", "Role"): "roles",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "rolebindings",
    ("networking.k8s.io/v1", "NetworkPolicy"): "networkpolicies",
    ("v1", "Secret"): "secrets",  # replica groups: the run's secret, created once (Kube.create_once)
    ("v1", "Service"): "services",  # replica groups: the torchft lighthouse (kiln.control.replica_groups.lighthouse)
    ("apps/v1", "Deployment"): "deployments",
    ("kubeflow.org/v1", "PyTorchJob"): "pytorchjobs",
    (f"{GROUP}/{VERSION}", "TrainingSpec"): PLURAL,
}


def object_path(obj: dict) -> str:
    """The REST path of a namespaced object, e.g. /apis/kubeflow.org/v1/namespaces/ns/pytorchjobs/run."""
    api_version, meta = obj["apiVersion"], obj["metadata"]
    plural = PLURALS.get((api_version, obj["kind"]))
    if plural is None:
        raise ValueError(f"kiln does not write {api_version} {obj['kind']} (known: {sorted(PLURALS)})")
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    return f"{prefix}/namespaces/{meta['namespace']}/{plural}/{meta['name']}"


def now() -> str:
    """The time stamped on conditions (metav1.Time, whole seconds, UTC)."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def api_client(kubeconfig: str | None = None, context: str | None = None,
               connections: int | None = None) -> client.ApiClient:
    """In-cluster credentials when running in a pod, else the kubeconfig (KUBECONFIG or ~/.kube/config).

    connections: HTTP connections kept open to the apiserver (default 5 per CPU); the operator passes its
    worker count, so no handler thread waits for a connection or opens a new one after each request.
    """
    configuration = client.Configuration()
    if connections:
        configuration.connection_pool_maxsize = connections
    try:
        if kubeconfig is None and context is None:
            try:
                kconfig.load_incluster_config(client_configuration=configuration)
                return client.ApiClient(configuration)
            except kconfig.ConfigException:
                pass
        kconfig.load_kube_config(config_file=kubeconfig, context=context, client_configuration=configuration)
    except (kconfig.ConfigException, OSError) as err:
        raise KilnError(f"no Kubernetes credentials: {err}; set KUBECONFIG or pass --kubeconfig") from None
    return client.ApiClient(configuration)


class Kube:
    def __init__(self, api: client.ApiClient, field_manager: str = "kiln-operator", resync_seconds: float = 300.0,
                 runs: Runs | None = None):
        self.api = api
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.coordination = client.CoordinationV1Api(api)
        self.field_manager = field_manager
        # What this client remembers per run (kiln.control.runs): the TrainingSpec as last read or patched,
        # and the digest of each body it applied. An unchanged body is sent again after resync_seconds, so an
        # edit or deletion by someone else is repaired then (the periodic resync, kiln.control.ticks).
        self.runs = runs if runs is not None else Runs()
        self.resync_seconds = resync_seconds

    def last_spec(self, namespace: str, name: str) -> dict | None:
        run = self.runs.get((namespace, name))
        return run.spec if run is not None else None

    # ---- writes ----

    @staticmethod
    def _run_of(obj: dict) -> tuple[str, str]:
        meta = obj["metadata"]
        return meta["namespace"], (meta.get("labels") or {}).get(RUN_LABEL) or meta["name"]

    def applied_before(self, obj: dict) -> bool:
        """Whether this client applied this object since the run was last forgotten (so it is the run's own:
        sync checks an object's owner before its first apply)."""
        run = self.runs.get(self._run_of(obj))
        return run is not None and object_path(obj) in run.applied

    def apply(self, obj: dict) -> dict | None:
        """Server-side apply as the operator's field manager (idempotent; takes over fields it sets): one
        PATCH, no read before it (the apiserver creates or merges). Returns the object as stored, or None
        without a request when this client applied the very same body less than resync_seconds ago (see
        forget_applied). A Secret is created once instead (create_once)."""
        if obj["kind"] == "Secret":
            return self.create_once(obj)
        path, run = object_path(obj), self._run_of(obj)
        digest = hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()
        applied = self.runs[run].applied
        digest_then, applied_at = applied.get(path, ("", 0.0))
        if digest_then == digest and time.monotonic() - applied_at < self.resync_seconds:
            return None
        response = self.api.call_api(
            path, "PATCH",
            query_params=[("fieldManager", self.field_manager), ("force", "true")],
            header_params={"Content-Type": "application/apply-patch+yaml", "Accept": "application/json"},
            body=obj, auth_settings=["BearerToken"], _preload_content=False, _return_http_data_only=True)
        applied[path] = (digest, time.monotonic())
        return json.loads(response.data)

    def create_once(self, obj: dict) -> None:
        """Create a run's Secret (kiln.control.ft_secret) with 32 random bytes drawn now, or leave the one that
        exists: its value is never written again (running groups hold it) and never read (the operator has no
        read access to Secrets). Sent again at each resync, so a deleted one comes back (the kubelet starts
        pods waiting on it then)."""
        path, applied = object_path(obj), self.runs[self._run_of(obj)].applied
        _, created_at = applied.get(path, ("", 0.0))
        if time.monotonic() - created_at < self.resync_seconds:
            return
        value = base64.b64encode(secrets.token_hex(32).encode()).decode()
        try:
            self.api.call_api(
                object_path(obj).rsplit("/", 1)[0], "POST", query_params=[("fieldManager", self.field_manager)],
                header_params={"Content-Type": "application/json", "Accept": "application/json"},
                body={**obj, "data": {FT_SECRET_KEY: value}}, auth_settings=["BearerToken"],
                _preload_content=False, _return_http_data_only=True)
        except ApiException as err:
            if err.status != 409:  # 409: it exists (made by an earlier reconcile): kept as it is
                raise
        applied[path] = ("created", time.monotonic())

    def forget_applied(self, namespace: str, run: str) -> None:
        """Apply every object of a run again, even unchanged ones (one was found missing, or a resync is due)."""
        found = self.runs.get((namespace, run))
        if found is not None:
            found.applied.clear()

    def patch_status(self, namespace: str, name: str, status: dict) -> dict:
        """Merge-patch the TrainingSpec's status; returns the object as stored."""
        body = json.loads(self.custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, PLURAL, name, {"status": status}, _preload_content=False).data)
        self.runs[(namespace, name)].spec = body
        return body

    def patch_annotations(self, namespace: str, name: str, annotations: dict[str, str]) -> dict:
        """Merge-patch annotations of a TrainingSpec (the elastic loop's state); returns the object as stored."""
        return json.loads(self.custom.patch_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, name, {"metadata": {"annotations": annotations}},
            _preload_content=False).data)

    def delete_pod(self, namespace: str, name: str, grace_period_seconds: int | None = None) -> bool:
        """Delete a pod (grace 0: at once, for a pod stuck on a dead node). False: it was gone already."""
        try:
            self.core.delete_namespaced_pod(name, namespace, grace_period_seconds=grace_period_seconds)
        except ApiException as err:
            if err.status == 404:
                return False
            raise
        return True

    # ---- leader election (kiln.control.leader): one coordination.k8s.io Lease ----

    def lease(self, namespace: str, name: str) -> dict | None:
        return self._get(self.coordination.read_namespaced_lease, name, namespace)

    def create_lease(self, namespace: str, body: dict) -> dict:
        """Create the Lease; ApiException 409 when someone else created it first."""
        return json.loads(self.coordination.create_namespaced_lease(namespace, body, _preload_content=False).data)

    def replace_lease(self, namespace: str, body: dict) -> dict:
        """Replace the Lease at body's resourceVersion; ApiException 409 when someone else wrote it since."""
        return json.loads(self.coordination.replace_namespaced_lease(
            body["metadata"]["name"], namespace, body, _preload_content=False).data)

    # ---- reads ----

    def _get(self, call, *args) -> dict | None:
        try:
            return json.loads(call(*args, _preload_content=False).data)
        except ApiException as err:
            if err.status == 404:
                return None
            raise

    def read(self, obj: dict) -> dict | None:
        """The object stored at `obj`'s name and kind (None: there is none)."""
        try:
            response = self.api.call_api(
                object_path(obj), "GET", header_params={"Accept": "application/json"},
                auth_settings=["BearerToken"], _preload_content=False, _return_http_data_only=True)
        except ApiException as err:
            if err.status == 404:
                return None
            raise
        return json.loads(response.data)

    def trainingspec(self, namespace: str, name: str) -> dict | None:
        body = self._get(self.custom.get_namespaced_custom_object, GROUP, VERSION, namespace, PLURAL, name)
        if body is not None:
            self.runs[(namespace, name)].spec = body
        return body

    def trainingspecs(self, namespace: str | None) -> list[dict]:
        if namespace:
            data = self.custom.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL,
                                                             _preload_content=False).data
        else:
            data = self.custom.list_cluster_custom_object(GROUP, VERSION, PLURAL, _preload_content=False).data
        return json.loads(data)["items"]

    def job(self, namespace: str, name: str, job_name: str | None = None) -> dict | None:
        """The run's PyTorchJob, or the one named job_name (a replica group's, kiln.control.names.job_names)."""
        return self._get(self.custom.get_namespaced_custom_object, "kubeflow.org", "v1", namespace,
                         "pytorchjobs", job_name or names(name)["job"])

    def applied_spec(self, namespace: str, name: str) -> dict | None:
        cm = self._get(self.core.read_namespaced_config_map, names(name)["configmap"], namespace)
        if not cm:
            return None
        return yaml.load((cm.get("data") or {}).get(SPEC_FILE) or "null", Loader=SafeLoader)

    def nodes(self) -> list[dict]:
        return json.loads(self.core.list_node(_preload_content=False).data)["items"]

    def pods_in(self, namespaces: list[str] | None) -> list[dict]:
        """Every pod of these namespaces (None: of every namespace, which needs a cluster-wide `list pods`)."""
        if namespaces is None:
            return json.loads(self.core.list_pod_for_all_namespaces(_preload_content=False).data)["items"]
        return [p for ns in namespaces
                for p in json.loads(self.core.list_namespaced_pod(ns, _preload_content=False).data)["items"]]

    def pods(self, namespace: str, name: str) -> list[dict]:
        data = self.core.list_namespaced_pod(namespace, label_selector=f"{RUN_LABEL}={name}",
                                             _preload_content=False).data
        return json.loads(data)["items"]

    def secret_problem(self, namespace: str, secret: str) -> str | None:
        """Why the credentials Secret cannot work (missing, or a key missing), or None. Reads key names only."""
        try:
            body = self._get(self.core.read_namespaced_secret, secret, namespace)
        except ApiException as err:
            if err.status == 403:  # the operator may run without read access to Secrets: skip the check
                return None
            raise
        if body is None:
            return f"Secret {namespace}/{secret} (spec.checkpoint.credentialsSecret) does not exist"
        missing = [k for k in S3_KEYS if k not in (body.get("data") or {})]
        if missing:
            return f"Secret {namespace}/{secret} lacks the key(s) {', '.join(missing)}"
        return None

    def logs(self, namespace: str, pod: str, follow: bool = False, tail: int | None = None) -> Any:
        return self.core.read_namespaced_pod_log(pod, namespace, container="pytorch", follow=follow,
                                                 tail_lines=tail, _preload_content=not follow)
