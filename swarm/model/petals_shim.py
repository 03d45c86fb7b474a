"""The one place where Chainswarm adapts petals 2.2.0.post1 to the stack it can actually run on.

petals 2.2.0.post1 pins hivemind 1.1.10.post2, which cannot be built here; hivemind 1.1.12 works except
that it no longer re-exports 17 names from its top-level namespace that petals imports. This module puts
those names back and switches off petals' start-up calls that need the internet:

* the PyPI version check of ``petals.cli.run_server`` (``validate_version``),
* the public bootstrap peers (``PUBLIC_INITIAL_PEERS``) that petals falls back to when no peers are given —
  a Chainswarm swarm is always private, so a missing ``initial_peers`` becomes a clear error instead of a
  dial to the internet — and the health.petals.dev reachability check that goes with them,
* the speedtest.net measurement behind ``throughput="auto"`` (the default network speed is used instead;
  Chainswarm measures communication time itself, see ``server.profiling``).

It also makes bitsandbytes optional where it is not installed (``_petals_peft_without_bitsandbytes``):
petals' server imports it for every block, though only adapters and quantized blocks use it.

Every entry point imports petals through :mod:`swarm.model.compat` (``from swarm.model.compat import petals``),
which imports this module first, so the patches are applied before anything else touches petals. ``tests/test_compat.py`` checks that plain
``import petals`` still breaks without the shim, so the shim cannot rot silently when versions move.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import logging
import os
import sys

logger = logging.getLogger(__name__)

# Offline by default: a missing file in a local checkpoint must fail, not retry the hub forever.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("BITSANDBYTES_NOWELCOME", "1")

# Names hivemind 1.1.12 dropped from ``hivemind/__init__.py`` that petals 2.2.0.post1 imports from there.
HIVEMIND_TOP_LEVEL_NAMES: dict[str, tuple[str, ...]] = {
    "hivemind.p2p": ("P2P", "P2PContext", "PeerID"),
    "hivemind.compression": ("serialize_torch_tensor", "deserialize_torch_tensor", "deserialize_tensor_stream"),
    "hivemind.utils.asyncio": ("anext",),
    "hivemind.utils.logging": ("get_logger",),
    "hivemind.utils.nested": ("nested_compare", "nested_flatten", "nested_pack"),
    "hivemind.utils.serializer": ("MSGPackSerializer",),
    "hivemind.utils.tensor_descr": ("BatchTensorDescriptor", "TensorDescriptor"),
    "hivemind.utils.timed_storage": ("get_dht_time", "MAX_DHT_TIME_DISCREPANCY_SECONDS", "TimedStorage"),
}


def restore_hivemind_names() -> list[str]:
    """Put the dropped names back on the ``hivemind`` module; return the ones that were missing."""
    import hivemind

    restored = []
    for module_name, names in HIVEMIND_TOP_LEVEL_NAMES.items():
        module = importlib.import_module(module_name)
        for name in names:
            if not hasattr(hivemind, name):
                setattr(hivemind, name, getattr(module, name))
                restored.append(name)
    return restored


def _skip_version_check() -> None:
    logger.debug("petals version check skipped (Chainswarm runs offline)")


def _skip_reachability_check(*_args, **_kwargs) -> None:
    logger.debug("health.petals.dev reachability check skipped (private swarm)")


def _default_network_rps(config, *, timeout: float = 60, default_speed: float = 100e6) -> float:
    """petals' default network speed (100 Mbit/s) expressed in its unit, without running speedtest."""
    return default_speed / (config.hidden_size * 16)


def _import_bitsandbytes_quietly() -> None:
    """bitsandbytes 0.41.1 prints a missing-symbol line and warns that it has no GPU support on CPU-only hosts at
    import; both are harmless there."""
    import contextlib
    import io
    import warnings

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            import bitsandbytes  # noqa: F401
        except ModuleNotFoundError:
            pass  # one of its own imports is missing: petals' import of it right after says which
        except Exception as exc:  # a GPU host with a broken CUDA setup: quantisation will fail later, loudly
            logger.warning("bitsandbytes failed to import: %s", exc)


def _petals_peft_without_bitsandbytes():
    """Make bitsandbytes optional for servers of unquantized blocks without adapters.

    petals' ``TransformerBackend.__init__`` imports ``petals.utils.peft`` for every block, and that module imports
    bitsandbytes (a 90 MB wheel with CUDA binaries that some hosts cannot install) and defines its LoRA layers on
    bitsandbytes' classes, although a server without adapters only ever calls its ``using_adapter(None)``. Where
    bitsandbytes is missing, this module takes ``petals.utils.peft``'s place: ``using_adapter`` of no adapter is a
    no-op; naming an adapter, or importing anything else from it (petals does so only for ``--adapters``), is a
    clear error. Quantized blocks (``--quant-type``) still fail with petals' own missing-bitsandbytes error.
    """
    import contextlib
    import types

    reason = "bitsandbytes is not installed; petals' LoRA adapters need it (pip install bitsandbytes)"
    module = types.ModuleType("petals.utils.peft", f"petals.utils.peft on a host without bitsandbytes: {reason}")

    @contextlib.contextmanager
    def using_adapter(active_adapter):
        if active_adapter:
            raise ValueError(f"adapter {active_adapter!r} requested: {reason}")
        yield

    def missing(name: str):
        if name.startswith("__"):  # hasattr(module, "__file__") and the like, as inspect and pickle ask
            raise AttributeError(name)
        raise ImportError(f"petals.utils.peft.{name}: {reason}")

    module.using_adapter = using_adapter
    module.__getattr__ = missing
    return module


class _QuietBitsandbytesFirst(importlib.abc.MetaPathFinder):
    """Imports bitsandbytes quietly just before ``petals.utils.peft`` (which imports it loudly), then steps aside.

    Only servers import that module (petals' backend, for every block, and the servers' forkserver); the
    orchestrator and the clients never load bitsandbytes, which was 0.45 CPU-s of every orchestrator's start
    (scipy.stats among its imports; measured 2026-12-01)."""

    def find_spec(self, name, path=None, target=None):
        if name == "petals.utils.peft":
            sys.meta_path.remove(self)
            _import_bitsandbytes_quietly()
        return None  # the regular finders load the module


def _patch_petals() -> None:
    import petals.client.config as client_config
    import petals.constants as constants
    import petals.server.reachability as reachability
    import petals.server.server as server_module
    import petals.server.throughput as throughput
    import petals.utils.version as version

    version.validate_version = _skip_version_check
    constants.PUBLIC_INITIAL_PEERS.clear()  # the same list object petals' server and CLI use as a default
    client_config.ClientConfig.initial_peers = ()
    reachability.validate_reachability = _skip_reachability_check
    server_module.validate_reachability = _skip_reachability_check
    throughput.measure_network_rps = _default_network_rps


restore_hivemind_names()
_HAS_BITSANDBYTES = importlib.util.find_spec("bitsandbytes") is not None
import petals  # noqa: E402  (must follow the hivemind names)

_patch_petals()
if _HAS_BITSANDBYTES:
    sys.meta_path.insert(0, _QuietBitsandbytesFirst())
else:
    import petals.utils  # noqa: E402

    sys.modules["petals.utils.peft"] = petals.utils.peft = _petals_peft_without_bitsandbytes()

__all__ = ["petals", "restore_hivemind_names", "HIVEMIND_TOP_LEVEL_NAMES"]
