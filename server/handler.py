"""Chainswarm's connection handler for petals servers.

:class:`ChainswarmHandler` subclasses petals' ``TransformerConnectionHandler`` and, for now, fixes one bug
of petals 2.2.0.post1 (petals-integration spec §7.1): the server-to-server push after an inference step is
built from the *opening* request's metadata, which never lists ``next_servers``, so no push is ever sent.
The handler remembers each session's latest step metadata and pushes with that. It also counts the pushes
it receives (shared across all handler processes of a server) so tests and metrics can see them.

The class keeps petals' name ``TransformerConnectionHandler``, because hivemind registers RPCs under the
class name and clients call ``TransformerConnectionHandler.rpc_*``; any ``rpc_*`` method a later subclass
overrides must keep its full type annotations. Other backends (a prefix-KV cache) can be installed next to
it with :func:`install`.

:func:`install` rebinds the handler (and optionally a backend class) in ``petals.server.server``'s globals,
where ``ModuleContainer`` looks them up; call it in the server process before ``Server.run()``.
"""
from __future__ import annotations

import ctypes
import multiprocessing as mp
from typing import Any, AsyncIterator, Optional, Sequence, Tuple

from swarm.compat import petals  # noqa: F401  (the shim must precede petals.server)
from petals.server.handler import TransformerConnectionHandler as _PetalsHandler

_push_counter: Any = None  # mp.Value shared with the forked handler processes, created by install()


class ChainswarmHandler(_PetalsHandler):
    """petals' handler with working server-to-server pushes and a shared count of received pushes."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._latest_step_metadata: dict[str, dict] = {}
        self._pushes_received = _push_counter

    async def _iterate_inference_steps(
        self, first_request, requests, session_id: Optional[str], requested_uids: Sequence[str], context
    ) -> AsyncIterator[Tuple[Any, dict]]:
        try:
            async for request, metadata in super()._iterate_inference_steps(
                first_request, requests, session_id, requested_uids, context
            ):
                if session_id is not None:
                    self._latest_step_metadata[session_id] = metadata
                yield request, metadata
        finally:
            if session_id is not None:
                self._latest_step_metadata.pop(session_id, None)

    def _put_into_session_queue(self, session_id: str, request) -> None:
        # rpc_push hands every received push to this helper, whether it wins the race or arrives late
        if self._pushes_received is not None:
            with self._pushes_received.get_lock():
                self._pushes_received.value += 1
        super()._put_into_session_queue(session_id, request)

    def _log_request(self, method, uids, context, *, debug=None, warning=None) -> None:
        # With pushes working, the client's own copy of a step often wins the race (on loopback, about half
        # the time); petals reports each such late push as a warning. Expected here: log it at debug level.
        if method == "rpc_inference.push" and warning is not None and "arrived late" in warning:
            debug, warning = warning, None
        super()._log_request(method, uids, context, debug=debug, warning=warning)

    async def _push_outputs(self, request, serialized_outputs, metadata: dict) -> None:
        latest = self._latest_step_metadata.get(metadata.get("session_id"))
        await super()._push_outputs(request, serialized_outputs, latest if latest is not None else metadata)


ChainswarmHandler.__name__ = ChainswarmHandler.__qualname__ = "TransformerConnectionHandler"


def install(handler_class: type = ChainswarmHandler, backend_class: Optional[type] = None, *,
            push_counter: Any = None) -> Any:
    """Make petals' ``ModuleContainer`` build ``handler_class`` (and ``backend_class``, if given).

    Call it in the server process before ``Server.run()``. ``push_counter`` is a shared
    ``multiprocessing.Value('q')`` that counts pushes received by all handlers (one is created if not
    given); it is returned.
    """
    global _push_counter
    import petals.server.server as server_module

    if handler_class.__name__ != "TransformerConnectionHandler":
        raise ValueError("a petals handler subclass must keep the name TransformerConnectionHandler")
    _push_counter = push_counter if push_counter is not None else (_push_counter or mp.Value(ctypes.c_int64, 0))
    server_module.TransformerConnectionHandler = handler_class
    if backend_class is not None:
        server_module.TransformerBackend = backend_class
    return _push_counter


def pushes_received() -> int:
    """Pushes received by this server's handlers since :func:`install` (0 before)."""
    return int(_push_counter.value) if _push_counter is not None else 0
