"""The operator's reads and writes against the apiserver (the only module here that does I/O).

Objects travel as plain dicts in the apiserver's own camelCase (reads use `_preload_content=False`),
so the pure functions in plan/status see exactly what `kubectl get -o json` shows.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

import yaml
from kubernetes import client, config as kconfig
from kubernetes.client.exceptions import ApiException

from kiln.api.spec import GROUP, PLURAL, VERSION
from kiln.control.plan import RUN_LABEL, S3_KEYS, SPEC_FILE, names
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
    def __init__(self, api: client.ApiClient, field_manager: str = "kiln-operator", resync_seconds: float = 300.0):
        self.api = api
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.field_manager = field_manager
        # (namespace, name) → the TrainingSpec as this client last read it or its status patch returned it
        self.last_spec: dict[tuple[str, str], dict] = {}
        # (namespace, run) → {REST path: (digest of the body this client last applied there, when)}. An unchanged
        # body is sent again after resync_seconds, so an edit or deletion by someone else is repaired in minutes.
        self._applied: dict[tuple[str, str], dict[str, tuple[str, float]]] = {}
        self.resync_seconds = resync_seconds

    # ---- writes ----

    @staticmethod
    def _run_of(obj: dict) -> tuple[str, str]:
        meta = obj["metadata"]
        return meta["namespace"], (meta.get("labels") or {}).get(RUN_LABEL) or meta["name"]

    def applied_before(self, obj: dict) -> bool:
        """Whether this client applied this object since the run was last forgotten (so it is the run's own:
        sync checks an object's owner before its first apply)."""
        return object_path(obj) in self._applied.get(self._run_of(obj), {})

    def apply(self, obj: dict) -> dict | None:
        """Server-side apply as the operator's field manager (idempotent; takes over fields it sets): one
        PATCH, no read before it (the apiserver creates or merges). Returns the object as stored, or None
        without a request when this client applied the very same body less than resync_seconds ago (see
        forget_applied)."""
        path, run = object_path(obj), self._run_of(obj)
        digest = hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()
        digest_then, applied_at = self._applied.get(run, {}).get(path, ("", 0.0))
        if digest_then == digest and time.monotonic() - applied_at < self.resync_seconds:
            return None
        response = self.api.call_api(
            path, "PATCH",
            query_params=[("fieldManager", self.field_manager), ("force", "true")],
            header_params={"Content-Type": "application/apply-patch+yaml", "Accept": "application/json"},
            body=obj, auth_settings=["BearerToken"], _preload_content=False, _return_http_data_only=True)
        self._applied.setdefault(run, {})[path] = (digest, time.monotonic())
        return json.loads(response.data)

    def forget_applied(self, namespace: str, run: str) -> None:
        """Apply every object of a run again, even unchanged ones (one was found missing, or the run is gone)."""
        self._applied.pop((namespace, run), None)

    def patch_status(self, namespace: str, name: str, status: dict) -> dict:
        """Merge-patch the TrainingSpec's status; returns the object as stored."""
        body = json.loads(self.custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, PLURAL, name, {"status": status}, _preload_content=False).data)
        self.last_spec[(namespace, name)] = body
        return body

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
            self.last_spec[(namespace, name)] = body
        return body

    def trainingspecs(self, namespace: str | None) -> list[dict]:
        if namespace:
            data = self.custom.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL,
                                                             _preload_content=False).data
        else:
            data = self.custom.list_cluster_custom_object(GROUP, VERSION, PLURAL, _preload_content=False).data
        return json.loads(data)["items"]

    def job(self, namespace: str, name: str) -> dict | None:
        return self._get(self.custom.get_namespaced_custom_object, "kubeflow.org", "v1", namespace,
                         "pytorchjobs", names(name)["job"])

    def applied_spec(self, namespace: str, name: str) -> dict | None:
        cm = self._get(self.core.read_namespaced_config_map, names(name)["configmap"], namespace)
        if not cm:
            return None
        return yaml.load((cm.get("data") or {}).get(SPEC_FILE) or "null", Loader=SafeLoader)

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
