"""The API's identity (group, version, kind) and the bounds its fields share."""

GROUP = "kiln.dev"
VERSION = "v1alpha1"
KIND = "TrainingSpec"
PLURAL = "trainingspecs"
API_VERSION = f"{GROUP}/{VERSION}"

# Integers as Kubernetes can hold them: replica-like counts are int32 in the objects kiln makes (PyTorchJob
# replicas, min/maxReplicas, backoffLimit; the parallel degrees multiply them in the CEL rules); the rest are
# bounded by ±(2^53 - 1), the largest integers a JSON number carries exactly: the apiserver refuses a CRD
# whose bound lies beyond (it validates bounds as JSON integers), so int64's own limits cannot be written.
# Every integer field carries one of these as its `le`, so the CRD has the same `maximum` and the apiserver
# refuses what `kiln validate` refuses (a test walks the CRD for an integer without one).
INT32_MAX = 2**31 - 1
JSON_INT_MAX = 2**53 - 1
DEFAULT_DATA_URI = "builtin:pydoc"  # also what data.sources requires data.uri to be left at
JSON_INT_MIN = -JSON_INT_MAX
# elastic.faultTolerance.groups: each group is a PyTorchJob the operator renders and applies on every resync, and
# a status entry; one small spec must not fan out into more work than the operator can redo (status lists stop here)
MAX_REPLICA_GROUPS = 4096
