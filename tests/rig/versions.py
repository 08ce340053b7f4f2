"""Every version the rig builds, in one place.

The cache key of a build is derived from this table and the Go version: a change
here builds into a new cache folder (the Go build cache keeps that cheap for
components whose pins did not change). The key does not cover build flags: after
changing those in build.py, delete `$KILN_CACHE_DIR/rig/<key>/stamps`.
"""

# Kubernetes control plane: kube-apiserver, kube-scheduler, kube-controller-manager, kubectl.
KUBERNETES = "v1.36.3"
ETCD = "v3.6.16"
KWOK = "v0.8.0"
TRAINING_OPERATOR = "v1.9.3"  # release-1.9 line of github.com/kubeflow/training-operator
HELM = "v3.19.5"
VERSITYGW = "v1.8.0"

# One Go wrapper module per component: (module requirements, main packages to build).
# Separate wrappers keep each tool on the dependency versions it was released with.
COMPONENTS: dict[str, dict] = {
    "etcd": {
        # etcd's server module carries replace lines (../api, ...), so it cannot be
        # `go install`ed; the wrapper requires each etcd module at the same version.
        "require": {
            "go.etcd.io/etcd/server/v3": ETCD,
            "go.etcd.io/etcd/api/v3": ETCD,
            "go.etcd.io/etcd/client/pkg/v3": ETCD,
            "go.etcd.io/etcd/client/v3": ETCD,
            "go.etcd.io/etcd/pkg/v3": ETCD,
        },
        "packages": ["go.etcd.io/etcd/server/v3"],
        "binaries": {"go.etcd.io/etcd/server/v3": "etcd"},
    },
    "kubernetes": {
        "require": {"k8s.io/kubernetes": KUBERNETES},
        # k8s.io/kubernetes points its staging modules at ./staging; the wrapper
        # replaces each with the published v0.<minor>.<patch> module.
        "staging": True,
        "packages": [
            "k8s.io/kubernetes/cmd/kube-apiserver",
            "k8s.io/kubernetes/cmd/kube-controller-manager",
            "k8s.io/kubernetes/cmd/kube-scheduler",
            "k8s.io/kubernetes/cmd/kubectl",
        ],
    },
    "kwok": {
        "require": {"sigs.k8s.io/kwok": KWOK},
        "packages": ["sigs.k8s.io/kwok/cmd/kwok"],
    },
    "training-operator": {
        "require": {"github.com/kubeflow/training-operator": TRAINING_OPERATOR},
        "packages": ["github.com/kubeflow/training-operator/cmd/training-operator.v1"],
        "binaries": {
            "github.com/kubeflow/training-operator/cmd/training-operator.v1": "training-operator"
        },
    },
    "helm": {
        "require": {"helm.sh/helm/v3": HELM},
        "packages": ["helm.sh/helm/v3/cmd/helm"],
    },
    "versitygw": {
        "require": {"github.com/versity/versitygw": VERSITYGW},
        "packages": ["github.com/versity/versitygw/cmd/versitygw"],
    },
}

# Build order: what the tests need first comes first (S3 and etcd build fastest).
BUILD_ORDER = ["versitygw", "etcd", "kubernetes", "kwok", "training-operator", "helm"]
