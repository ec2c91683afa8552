"""exitplan: a Kubernetes operator and data plane for early-exit inference."""

__version__ = "0.1.0"
