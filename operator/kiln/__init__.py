"""kiln: declarative, fault-tolerant distributed training of large models on Kubernetes."""

__version__ = "0.1.0"
