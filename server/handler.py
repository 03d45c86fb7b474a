"""Chainswarm's connection handler for petals servers.

:class:`ChainswarmHandler` subclasses petals' ``TransformerConnectionHandler`` and

* fixes one bug of petals 2.2.0.post1 (petals-integration spec §7.1): the server-to-server push after an
  inference step is built from the *opening* request's metadata, which never lists ``next_servers``, so no
  push is ever sent. The handler remembers each session's latest step metadata and pushes with that;
* counts the pushes it receives and refuses (shared across all handler processes of a server);
* keeps the server's own count of the KV block-slots its open inference sessions hold (:class:`KvCounters`:
  a session served on ``m`` blocks holds ``m`` block-slots, the unit of the orchestrator's ``cache_slots``),
  next to the slots its KV pool was sized for.

* grows each petals session's KV by the page before petals runs its step (the server's pool is a
  :class:`~server.kv_pool.PagedKvPool`, installed by :func:`install`), and takes positions back when a step asks
  for a rollback (speculative decoding on petals' per-session path; bounded by the previous step's positions).

Both counters, and the pool's pages, are reported in petals' ``rpc_info`` (keys ``chainswarm_pushes`` and
``chainswarm_kv``), so a client, a test or an operator can read what the server itself sees.

The class keeps petals' name ``TransformerConnectionHandler``, because hivemind registers RPCs under the
class name and clients call ``TransformerConnectionHandler.rpc_*``; any ``rpc_*`` method a later subclass
overrides must keep its full type annotations. Other backends (a prefix-KV cache) can be installed next to
it with :func:`install`.

:func:`install` rebinds the handler (and optionally a backend class) in ``petals.server.server``'s globals,
where ``ModuleContainer`` looks them up, with the runtime that stops before the weights are freed
(:mod:`server.runtime`) and without petals' reachability probe (:class:`NoReachabilityProbe`); call it in the
server process before the ``Server`` is built.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import multiprocessing as mp
from contextvars import ContextVar
from typing import Any, AsyncIterator, Optional, Sequence, Tuple

from swarm.model.compat import petals  # noqa: F401  (the shim must precede petals.server)
from hivemind import MSGPackSerializer
from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2
from petals.server.handler import TransformerConnectionHandler as _PetalsHandler

from server import announcer, failpoints, runtime
from server.kv_pool import PAGE_TOKENS, PagedKvPool, flat_handles
from swarm.engine.multi_wire import checked_rollback
from swarm.model.petals_sessions import ROLLBACK_META_KEY

KV_INFO = "chainswarm_kv"  # rpc_info key: {"slots", "used", "peak", "sessions", "max_length", "pages"}
PUSH_INFO = "chainswarm_pushes"  # rpc_info key: {"received", "refused"}

_push_counter: Any = None  # mp.Value shared with the forked handler processes, created by install()
_push_refused: Any = None
_kv: Optional["KvCounters"] = None  # the counters of the container whose handlers were created last


@dataclasses.dataclass(frozen=True)
class _Lease:
    """The pool lease of the petals session this task serves (set by ``_allocate_cache``)."""

    pool: PagedKvPool
    handles: tuple


_LEASE: ContextVar[Optional[_Lease]] = ContextVar("chainswarm_kv_lease", default=None)


class KvCounters:
    """KV block-slots held by the open inference sessions of one ``ModuleContainer`` (all its handler
    processes share it: it is created in the server process before they fork).

    ``slots`` is what the KV pool was sized for, in block-slots of ``max_length`` tokens; ``used`` counts a
    session served on ``m`` blocks (batch ``b``) as ``b·m`` from the moment its cache is allocated until it is
    freed, whatever length it asked for; ``peak`` is the largest ``used`` since the container started.
    """

    def __init__(self, slots: int, max_length: int, pool: Any = None, page_bytes: int = 0):
        self.slots, self.max_length = int(slots), int(max_length)
        self.pool, self.page_bytes = pool, int(page_bytes)
        self._used = mp.Value(ctypes.c_int64, 0)
        self._sessions = mp.Value(ctypes.c_int64, 0, lock=False)
        self._peak = mp.Value(ctypes.c_int64, 0, lock=False)

    @classmethod
    def for_backends(cls, module_backends: dict, max_length: int) -> "KvCounters":
        """The counters of a pool shared by ``module_backends`` (petals gives all blocks of a server one)."""
        backend = next(iter(module_backends.values()), None)
        per_token = 0 if backend is None else sum(backend.cache_bytes_per_token.values())
        per_slot = per_token * max_length
        pool = None if backend is None else backend.memory_cache
        return cls(pool.max_size_bytes // per_slot if per_slot else 0, max_length,
                   pool if isinstance(pool, PagedKvPool) else None, per_token * PAGE_TOKENS)

    def take(self, block_slots: int) -> None:
        with self._used.get_lock():
            self._used.value += block_slots
            self._sessions.value += 1
            self._peak.value = max(self._peak.value, self._used.value)

    def give(self, block_slots: int) -> None:
        with self._used.get_lock():
            self._used.value -= block_slots
            self._sessions.value -= 1

    def snapshot(self) -> dict:
        with self._used.get_lock():
            counters = {"slots": self.slots, "used": int(self._used.value), "peak": int(self._peak.value),
                        "sessions": int(self._sessions.value), "max_length": self.max_length}
        if self.pool is not None and self.page_bytes:
            counters["pages"] = self.pool.pages(self.page_bytes)
        return counters


class ChainswarmHandler(_PetalsHandler):
    """petals' handler with working server-to-server pushes, push counters and KV slot counters."""

    def __init__(self, *args, **kwargs):
        global _kv
        super().__init__(*args, **kwargs)
        self._latest_step_metadata: dict[str, dict] = {}
        self._pushes_received = _push_counter
        if self._handler_index == 0 or _kv is None:  # ModuleContainer creates handler 0 first
            _kv = KvCounters.for_backends(self.module_backends, self.inference_max_length)
        self._kv = _kv

    async def _iterate_inference_steps(
        self, first_request, requests, session_id: Optional[str], requested_uids: Sequence[str], context
    ) -> AsyncIterator[Tuple[Any, dict]]:
        position = last = 0  # the session's positions (for the failpoints) and its previous step's
        try:
            async for request, metadata in super()._iterate_inference_steps(
                first_request, requests, session_id, requested_uids, context
            ):
                if session_id is not None:
                    self._latest_step_metadata[session_id] = metadata
                tensors = getattr(request, "tensors", None)  # (a test may pass a stand-in)
                size = list(tensors[0].size) if tensors else []
                tokens = int(size[1]) if len(size) == 3 else 0
                rollback = checked_rollback(metadata.get(ROLLBACK_META_KEY), last)  # speculation's rejected drafts
                if rollback:
                    await self._take_back(rollback)
                await self._grow(tokens)  # the step's pages, before petals submits it
                last = tokens
                if failpoints.armed():  # tests and drills only: nothing on a production step
                    position -= rollback
                    failpoints.hit(failpoints.step_phase(position, tokens))
                    position += tokens
                yield request, metadata
                failpoints.hit("between_steps")
        finally:
            if session_id is not None:
                self._latest_step_metadata.pop(session_id, None)

    @contextlib.asynccontextmanager
    async def _allocate_cache(self, backends, *, batch_size: int, max_length: int, timeout: Optional[float]):
        async with super()._allocate_cache(backends, batch_size=batch_size, max_length=max_length,
                                           timeout=timeout) as handles:
            held = max(1, int(batch_size)) * len(backends)
            self._kv.take(held)
            pool = backends[0].memory_cache
            lease = _LEASE.set(_Lease(pool, flat_handles(handles)) if isinstance(pool, PagedKvPool) else None)
            try:
                yield handles
            finally:
                with contextlib.suppress(ValueError):  # (a multi-session stream closes its sessions in any order)
                    _LEASE.reset(lease)
                self._kv.give(held)

    async def _take_back(self, positions: int) -> None:
        """Forget the last ``positions`` positions of this task's petals session before its next step (a rollback:
        :mod:`swarm.engine.multi_wire`). The KV positions live in the runtime's backends, which this handler cannot
        move: refused here; :class:`server.prefix_cache.PrefixHandler` does it."""
        raise ValueError("this server cannot take positions back")

    @staticmethod
    def _release(positions: int) -> None:
        """Give the pages past this task's petals session's last ``positions`` positions back to the server's pool."""
        lease = _LEASE.get()
        if lease is not None and positions:
            lease.pool.rollback(lease.handles, positions)

    @staticmethod
    async def _grow(positions: int) -> None:
        """Take the pages ``positions`` more positions of this task's petals session need from the server's pool."""
        lease = _LEASE.get()
        if lease is not None and positions:
            await lease.pool.extend(lease.handles, positions)

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
        await super()._push_outputs(request, serialized_outputs,
                                    self._push_metadata(latest if latest is not None else metadata))

    def _push_metadata(self, metadata: dict) -> dict:
        """The step metadata a push to the next server is built from (a subclass may add to it)."""
        return metadata

    async def rpc_info(self, request: runtime_pb2.ExpertUID, context: P2PContext) -> runtime_pb2.ExpertInfo:
        """petals' server and block metadata, plus this server's push and KV slot counters."""
        info = MSGPackSerializer.loads((await super().rpc_info(request, context)).serialized_info)
        info.update(self._info_counters())
        return runtime_pb2.ExpertInfo(serialized_info=MSGPackSerializer.dumps(info))

    def _info_counters(self) -> dict:
        """The counters ``rpc_info`` adds to petals' metadata (a subclass may add its own)."""
        return {PUSH_INFO: {"received": pushes_received(), "refused": pushes_refused()}, KV_INFO: self._kv.snapshot()}


ChainswarmHandler.__name__ = ChainswarmHandler.__qualname__ = "TransformerConnectionHandler"


class NoReachabilityProbe:
    """Stands in for petals' ``ReachabilityProtocol`` in a Chainswarm server, which starts no probe.

    petals' ``Server`` attaches that protocol to every directly reachable server: a second libp2p daemon (a
    ``p2pd`` process) that answers newcomers of petals' public swarm asking whether they can be dialled back.
    Chainswarm's servers never ask (``reachable_via_relay=False``, ``skip_reachability_check=True``: the
    orchestrator's swarm is private and its servers listen where they are told), so the daemon only cost each
    server a process, ~0.45 s of CPU to start and its idle share. A petals server that asks one of ours gets no
    answer, which petals reads as "run a full peer"."""

    @classmethod
    def attach_to_dht(cls, dht: Any, await_ready: bool = False, **kwargs: Any) -> None:
        return None


def install(handler_class: type = ChainswarmHandler, backend_class: Optional[type] = None, *,
            push_counter: Any = None) -> Any:
    """Make petals' ``ModuleContainer`` build ``handler_class`` (and ``backend_class``, if given).

    Call it in the server process before the ``Server`` is built. ``push_counter`` is a shared
    ``multiprocessing.Value('q')`` that counts pushes received by all handlers (one is created if not
    given); it is returned.
    """
    global _push_counter, _push_refused
    import petals.server.server as server_module

    if handler_class.__name__ != "TransformerConnectionHandler":
        raise ValueError("a petals handler subclass must keep the name TransformerConnectionHandler")
    _push_counter = push_counter if push_counter is not None else (_push_counter or mp.Value(ctypes.c_int64, 0))
    _push_refused = _push_refused or mp.Value(ctypes.c_int64, 0)
    server_module.TransformerConnectionHandler = handler_class
    server_module.MemoryCache = PagedKvPool  # every block's KV pool: paged, grown as sessions grow
    server_module.ReachabilityProtocol = NoReachabilityProbe  # no second libp2p daemon per server
    runtime.install()  # a container that shuts down waits for the step in hand before it frees the weights
    announcer.install()  # and its OFFLINE announcement cannot hang it when the DHT process is already gone
    if backend_class is not None:
        server_module.TransformerBackend = backend_class
    return _push_counter


def pushes_received() -> int:
    """Pushes received by this server's handlers since :func:`install` (0 before)."""
    return int(_push_counter.value) if _push_counter is not None else 0


def pushes_refused() -> int:
    """Pushes this server's handlers refused (:mod:`server.tickets`) since :func:`install` (0 before)."""
    return int(_push_refused.value) if _push_refused is not None else 0


def count_refused_push() -> None:
    if _push_refused is not None:
        with _push_refused.get_lock():
            _push_refused.value += 1
