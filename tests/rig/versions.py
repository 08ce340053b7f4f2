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
# Kueue (queues, quotas, admission; tests/rig/kueue.py), in its own cache folder (`kueue-…`)
# and started on demand, so pinning it never rebuilds or restarts the control plane.
KUEUE = "v0.17.0"

# The real node (tests/rig/node.py): kubelet and kube-proxy come from KUBERNETES above.
CONTAINERD = "v2.4.2"
CNI_PLUGINS = "v1.10.0"
COREDNS = "v1.15.0"
CRI_TOOLS = "v1.37.0"  # crictl: the node's pods as the kubelet sees them (and `down` removes them)
# Debian packages the node runs with (installed by `build --node` when missing).
NODE_HOST_PACKAGES = {"runc": "runc", "iptables": "iptables", "conntrack": "conntrack", "ip": "iproute2"}

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
    "kueue": {
        "require": {"sigs.k8s.io/kueue": KUEUE},
        "packages": ["sigs.k8s.io/kueue/cmd/kueue"],
        "version_vars": {"sigs.k8s.io/kueue/pkg/version.GitVersion": KUEUE},
    },
    # --- the real node: built only when a node is asked for (`build --node`, `up --node`) ---
    "kubernetes-node": {
        # A second wrapper with the same requirements as "kubernetes", so the packages both
        # use come from the Go build cache; the same version ldflags (see build.ldflags).
        "require": {"k8s.io/kubernetes": KUBERNETES},
        "staging": True,
        "packages": ["k8s.io/kubernetes/cmd/kubelet", "k8s.io/kubernetes/cmd/kube-proxy"],
    },
    "containerd": {
        "require": {"github.com/containerd/containerd/v2": CONTAINERD},
        "packages": [
            "github.com/containerd/containerd/v2/cmd/containerd",
            "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2",
            "github.com/containerd/containerd/v2/cmd/ctr",
        ],
        "tags": ["no_btrfs"],  # btrfs needs cgo headers; the node uses overlayfs
        "version_vars": {"github.com/containerd/containerd/v2/version.Version": CONTAINERD},
    },
    "cni-plugins": {
        "require": {"github.com/containernetworking/plugins": CNI_PLUGINS},
        "packages": [
            "github.com/containernetworking/plugins/plugins/main/bridge",
            "github.com/containernetworking/plugins/plugins/main/loopback",
            "github.com/containernetworking/plugins/plugins/ipam/host-local",
            "github.com/containernetworking/plugins/plugins/meta/portmap",
        ],
        "version_vars": {"github.com/containernetworking/plugins/pkg/utils/buildversion.BuildVersion": CNI_PLUGINS},
    },
    "coredns": {
        # CoreDNS's documented custom build: our own main with only the plugins we use.
        "require": {"github.com/coredns/coredns": COREDNS},
        "files": {"main.go": "tests/rig/go/coredns/main.go"},
        "packages": ["."],
        "binaries": {".": "coredns"},
    },
    "cri-tools": {
        "require": {"sigs.k8s.io/cri-tools": CRI_TOOLS},
        "packages": ["sigs.k8s.io/cri-tools/cmd/crictl"],
        "version_vars": {"sigs.k8s.io/cri-tools/pkg/version.Version": CRI_TOOLS},
    },
    "node-tools": {
        # Our own static programs: the pod sandbox (pause) and the test pods' probe.
        "require": {},
        "files": {
            "pause/main.go": "tests/rig/go/pause/main.go",
            "probe/main.go": "tests/rig/go/probe/main.go",
        },
        "packages": ["./pause", "./probe"],
        "binaries": {"./pause": "pause", "./probe": "probe"},
    },
}

# Build order: what the tests need first comes first (S3 and etcd build fastest).
BUILD_ORDER = ["versitygw", "etcd", "kubernetes", "kwok", "training-operator", "helm"]
# The real node's components, in their own cache folder (`node-…`), so pinning them never
# rebuilds or restarts the control plane.
KUEUE_BUILD_ORDER = ["kueue"]
NODE_BUILD_ORDER = ["node-tools", "cni-plugins", "coredns", "containerd", "cri-tools", "kubernetes-node"]
