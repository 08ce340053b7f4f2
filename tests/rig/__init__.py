"""The test rig: a real Kubernetes control plane (etcd, kube-apiserver, kube-scheduler,
kube-controller-manager, kwok GPU nodes, Kubeflow training-operator) and a real S3
server (versitygw), built from Go modules and run on 127.0.0.1.

`python -m tests.rig build|up|down|status|env`; see docs/rig.md.
"""
