"""Helpers the tests share, so that no test module imports another (each test module only tests):

- specs: TrainingSpec documents to start from (`BASE`, `with_`, `doc_of`, `small_run`, the CRD's integer fields)
- ranks: processes and ports for multi-rank tests (`free_port`, `wait_until`, `SAFETY_TIMEOUT_S`)
- operator: the kiln operator on the rig, its namespace and RBAC, and reading what it wrote
- helm, real_node, trainers: the chart rendered, the rig's real node, trainer processes that stand in for pods
Namespaces and the CRD on the rig: tests.rig.install (`scratch_namespace`, `install_crd`).
"""
