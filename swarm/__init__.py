"""Chainswarm's control plane: orchestrator, DHT records, wire schemas, HTTP API, models, petals compatibility."""
import os as _os
import warnings as _warnings

# Known-harmless noise from the pinned stack (transformers 4.34 on torch 2.13, petals' meta-device block loader).
_warnings.filterwarnings("ignore", category=FutureWarning, message=r".*_register_pytree_node.*")
_warnings.filterwarnings("ignore", category=UserWarning, message=r".*copying from a non-meta parameter.*")
_warnings.filterwarnings("ignore", category=DeprecationWarning, message=r".*torch\.jit\.script.*")
_os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
