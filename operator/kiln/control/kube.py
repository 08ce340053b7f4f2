"""The operator's reads and writes against the apiserver (the only module here that does I/O).

Objects travel as plain dicts in the apiserver's own camelCase (reads use `_preload_content=False`),
so the pure functions in plan/status see exactly what `kubectl get -o json` shows.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import yaml
from kubernetes import client, config as kconfig
from kubernetes.client.exceptions import ApiException
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import ResourceNotFoundError

from kiln.api.spec import GROUP, PLURAL, VERSION
from kiln.control.plan import RUN_LABEL, S3_KEYS, SPEC_FILE, names
from kiln.errors import KilnError


def api_client(kubeconfig: str | None = None, context: str | None = None) -> client.ApiClient:
    """In-cluster credentials when running in a pod, else the kubeconfig (KUBECONFIG or ~/.kube/config)."""
    configuration = client.Configuration()
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
    def __init__(self, api: client.ApiClient, field_manager: str = "kiln-operator"):
        self.api = api
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.field_manager = field_manager
        self._dyn: DynamicClient | None = None
        self._dyn_lock = threading.Lock()  # handlers run on several threads; discover once

    # ---- writes ----

    def apply(self, obj: dict) -> None:
        """Server-side apply as the operator's field manager (idempotent; takes over fields it sets)."""
        with self._dyn_lock:
            if self._dyn is None:
                self._dyn = DynamicClient(self.api)
        try:
            resource = self._dyn.resources.get(api_version=obj["apiVersion"], kind=obj["kind"])
        except ResourceNotFoundError:  # a CRD installed after discovery was cached
            self._dyn.resources.invalidate_cache()
            resource = self._dyn.resources.get(api_version=obj["apiVersion"], kind=obj["kind"])
        meta = obj["metadata"]
        self._dyn.server_side_apply(resource, body=obj, name=meta["name"], namespace=meta.get("namespace"),
                                    field_manager=self.field_manager, force_conflicts=True)

    def patch_status(self, namespace: str, name: str, status: dict) -> None:
        self.custom.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, PLURAL, name,
                                                          {"status": status})

    # ---- reads ----

    def _get(self, call, *args) -> dict | None:
        try:
            return json.loads(call(*args, _preload_content=False).data)
        except ApiException as err:
            if err.status == 404:
                return None
            raise

    def trainingspec(self, namespace: str, name: str) -> dict | None:
        return self._get(self.custom.get_namespaced_custom_object, GROUP, VERSION, namespace, PLURAL, name)

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
        return yaml.safe_load((cm.get("data") or {}).get(SPEC_FILE) or "null")

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
