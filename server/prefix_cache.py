"""Server-side prompt-prefix KV store: a petals backend subclass and a handler extension.

Protocol and trust model: :mod:`swarm.trust.prefix`. Pieces here, all in the server process:

* :class:`PrefixStore` (one per server, :data:`STORE`) keeps KV pages of :data:`~swarm.trust.prefix.PAGE_TOKENS`
  tokens per served block, keyed by the page hash chain, in LRU order within a byte budget — the
  assignment's ``prefix_cache_tokens`` on every block. The budget is separate from petals' session pool,
  so sessions never lose their planned slots to cached prefixes. Evicting a page also evicts the pages
  after it (useless without it); every eviction gets a sequence number for the orchestrator's report.
* :class:`PrefixBackend` (a ``TransformerBackend``: :class:`swarm.model.families.ModelBackend`) runs the store's operations inside the runtime, where
  the KV tensors live: they travel through the (merged) inference pool as :class:`PrefixOp` metadata, so
  they are ordered with the session's own steps. ``probe`` (pages held for all blocks of a span, pinned for
  a few seconds), ``load`` (copy pages into a session's cache and offset its positions), ``save`` (store
  the pages a session computed), ``shift`` (take positions back: a rollback), ``forget`` (drop the offset at
  session end).
* :class:`PrefixHandler` (the push-fixed ``TransformerConnectionHandler`` plus ``rpc_prefix_probe``) reads
  ``cs_prefix`` from the opening metadata: load before the first step, save right after it. It also runs a
  petals session's rollbacks (``shift``, speculative decoding on petals' per-session path) and confirms each in
  the step's reply (:mod:`swarm.model.petals_sessions`); a session that asks for room to take positions back gets
  it beyond its ``max_length`` in petals' step loop, not in its pages.

petals' step loop counts a session's position itself (every position it was sent); the backend adds the
session's offset to it: the positions a loaded prefix skipped, minus the positions rolled back.
"""
from __future__ import annotations

import asyncio
import bisect
import collections
import contextlib
import dataclasses
import logging
import threading
import time
import uuid
from contextvars import ContextVar
from typing import AsyncIterator, Optional, Sequence

import torch

from swarm.model.compat import petals  # noqa: F401  (the shim must precede petals.server)
from hivemind import MSGPackSerializer
from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2
from hivemind.utils.asyncio import anext
from petals.data_structures import InferenceMetadata
from swarm.model.families import ModelBackend
from petals.utils.misc import DUMMY_INT64

from server import failpoints
from server.handler import ChainswarmHandler
from server.kv_pool import fit_pages, token_axis
from swarm.model.petals_sessions import ROLLBACK_META_KEY, ROLLBACK_ROOM_KEY, room_positions
from swarm.trust.prefix import META_KEY, MISSING_MESSAGE, PAGE_TOKENS, check_hashes, parse_session_spec

logger = logging.getLogger(__name__)

MAX_PIN_S = 60.0


class PrefixMissing(RuntimeError):
    """A session asked to load pages this server no longer holds."""


class _Page:
    __slots__ = ("parent", "children", "blocks", "nbytes", "pinned_until")

    def __init__(self, parent: Optional[bytes]):
        self.parent = parent
        self.children: set[bytes] = set()
        self.blocks: dict[str, tuple] = {}  # block uid -> KV tensors of this page (layout of the session cache)
        self.nbytes = 0
        self.pinned_until = 0.0


class PrefixStore:
    """KV pages per (page hash, block uid), LRU within ``budget_bytes``. Thread-safe."""

    def __init__(self, budget_bytes: int = 0, page_tokens: int = PAGE_TOKENS, report_size: int = 8192):
        self.page_tokens = page_tokens
        self.budget_bytes = int(budget_bytes)
        self.lock = threading.RLock()
        self.pages: "collections.OrderedDict[bytes, _Page]" = collections.OrderedDict()  # oldest first
        self.nbytes = 0
        self.epoch = uuid.uuid4().hex[:12]
        self.seq = 0
        self.evicted: collections.deque = collections.deque(maxlen=report_size)  # (seq, hex hash)
        self.stats = collections.Counter()

    def configure(self, budget_bytes: int) -> None:
        """A new assignment: drop everything (the blocks may have changed) and start a new epoch."""
        with self.lock:
            self.pages.clear()
            self.nbytes = 0
            self.budget_bytes = int(budget_bytes)
            self.epoch = uuid.uuid4().hex[:12]
            self.seq = 0
            self.evicted.clear()

    # -- lookups ------------------------------------------------------------------------------------
    def match(self, uids: Sequence[str], hashes: Sequence[bytes]) -> int:
        """Leading pages of ``hashes`` held for every block in ``uids`` (the chain links must agree)."""
        with self.lock:
            parent = None
            for i, h in enumerate(hashes):
                page = self.pages.get(h)
                if page is None or page.parent != parent or any(uid not in page.blocks for uid in uids):
                    return i
                parent = h
            return len(hashes)

    def touch(self, hashes: Sequence[bytes], pin_s: float = 0.0) -> None:
        """Mark pages used (deepest first, so a prefix's first page is the most recent) and pin them."""
        with self.lock:
            until = time.monotonic() + pin_s
            for h in reversed(hashes):
                page = self.pages.get(h)
                if page is not None:
                    self.pages.move_to_end(h)
                    page.pinned_until = max(page.pinned_until, until) if pin_s else page.pinned_until

    def get(self, uid: str, h: bytes) -> Optional[tuple]:
        with self.lock:
            page = self.pages.get(h)
            return None if page is None else page.blocks.get(uid)

    # -- inserts and eviction -------------------------------------------------------------------------
    def put(self, uid: str, h: bytes, parent: Optional[bytes], tensors: tuple, protect: set) -> bool:
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        with self.lock:
            if nbytes > self.budget_bytes:
                return False
            page = self.pages.get(h)
            if page is not None and page.parent != parent:
                return False  # a hash collision or a forged chain: keep what is there
            if page is None:
                if parent is not None and parent not in self.pages:
                    return False  # the prefix before it is gone: the page would be unreachable
                page = _Page(parent)
                self.pages[h] = page
                if parent is not None:
                    self.pages[parent].children.add(h)
            if uid in page.blocks:
                return True
            if not self._make_room(nbytes, protect):
                if not page.blocks:
                    self._drop(h, report=False)
                return False
            page.blocks[uid] = tensors
            page.nbytes += nbytes
            self.nbytes += nbytes
            self.stats["pages_inserted"] += 1
            return True

    def fit_span(self, uids: Sequence[str], hashes: Sequence[bytes], first: int, last: int, page_nbytes: int,
                 protect: set) -> int:
        """How many of pages ``first..last`` of ``hashes`` can be stored for *every* block of ``uids``, making room
        for them all at once (LRU, unpinned, outside ``protect``). A save stores block by block; sized this way the
        first blocks cannot take the room the later ones need, which would leave the span matching no page.
        Idempotent: the span's later blocks get the same answer, their room being already made."""
        with self.lock:
            needed = [0]  # needed[k]: bytes the span's first k pages still need over all its blocks
            for h in hashes[first:last]:
                page = self.pages.get(h)
                missing = len(uids) - (0 if page is None else sum(uid in page.blocks for uid in uids))
                needed.append(needed[-1] + missing * page_nbytes)
            self._make_room(needed[-1], protect)
            return max(0, bisect.bisect_right(needed, self.budget_bytes - self.nbytes) - 1)

    def _make_room(self, nbytes: int, protect: set) -> bool:
        now = time.monotonic()
        while self.nbytes + nbytes > self.budget_bytes:
            victim = next((h for h, p in self.pages.items()
                           if h not in protect and p.pinned_until <= now and p.blocks), None)
            if victim is None:
                return False
            self._drop(victim)
        return True

    def _drop(self, h: bytes, report: bool = True) -> None:
        stack = [h]
        while stack:
            cur = stack.pop()
            page = self.pages.pop(cur, None)
            if page is None:
                continue
            stack.extend(page.children)
            if page.parent is not None and page.parent in self.pages:
                self.pages[page.parent].children.discard(cur)
            self.nbytes -= page.nbytes
            if report:
                self.seq += 1
                self.evicted.append((self.seq, cur.hex()))
                self.stats["pages_evicted"] += 1

    def report_unheld(self, uid: str, hashes: Sequence[bytes]) -> int:
        """Report the pages of ``hashes`` not held for ``uid`` as evicted: a save that found no room leaves
        pages the orchestrator indexed optimistically at dispatch, and its index must hear that they are not
        here. Returns how many were reported."""
        with self.lock:
            missing = [h for h in hashes if h not in self.pages or uid not in self.pages[h].blocks]
            for h in missing:
                self.seq += 1
                self.evicted.append((self.seq, h.hex()))
                self.stats["pages_unsaved"] += 1
            return len(missing)

    def evict_all(self) -> int:
        """Drop every page (reported as evictions)."""
        with self.lock:
            roots = [h for h, p in self.pages.items() if p.parent is None or p.parent not in self.pages]
            before = len(self.pages)
            for h in roots:
                self._drop(h)
            return before - len(self.pages)

    def report(self) -> dict:
        """The eviction report the node publishes (see :mod:`swarm.trust.prefix`)."""
        with self.lock:
            return {"epoch": self.epoch, "seq": self.seq, "evicted": [list(e) for e in self.evicted],
                    "pages": len(self.pages), "bytes": int(self.nbytes), "budget_bytes": self.budget_bytes,
                    "page_tokens": self.page_tokens, "stats": dict(self.stats)}


STORE = PrefixStore()  # the server process's store (the runtime and the node's heartbeat share it)


@dataclasses.dataclass(frozen=True)
class PrefixOp(InferenceMetadata):
    """A store operation travelling through the inference pool in place of a step's metadata."""

    op: tuple = ()


class PrefixBackend(ModelBackend):
    """A ``TransformerBackend`` that also runs :class:`PrefixOp` store operations and honours the position
    offset of sessions that loaded a prefix."""

    store: PrefixStore = STORE

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._offsets: dict[tuple, int] = {}

    @torch.inference_mode()
    def inference_step(self, hidden_states: torch.Tensor, hypo_ids: torch.LongTensor,
                       inference_info: InferenceMetadata):
        if isinstance(inference_info, PrefixOp):
            return self._run_op(hidden_states, inference_info)
        offset = self._offsets.get(inference_info.cache_handles, 0)
        fit_pages(self.memory_cache, inference_info.cache_handles,
                  inference_info.prefix_length + offset + hidden_states.shape[1])
        if offset:
            inference_info = dataclasses.replace(inference_info,
                                                 prefix_length=inference_info.prefix_length + offset)
            with self.memory_cache.use_cache(*inference_info.cache_handles) as tensors:
                capacity = tensors[0].shape[-1]
            if inference_info.prefix_length + hidden_states.shape[1] > capacity:
                raise ValueError(f"prefix {offset} + positions exceed the session's {capacity} KV slots")
        return super().inference_step(hidden_states, hypo_ids, inference_info)

    def get_info(self) -> dict:
        """petals' block info (``rpc_info``) plus the inference pool's batching counters, if it batches."""
        from server.batching import pool_stats

        stats = pool_stats(self.inference_pool)
        return dict(super().get_info(), **({"chainswarm_batching": stats} if stats is not None else {}))

    def _page_slices(self, tensors, start: int, end: int) -> list:
        return [t.narrow(token_axis(i), start, end - start) for i, t in enumerate(tensors)]

    def _run_op(self, hidden_states: torch.Tensor, info: PrefixOp):
        kind, *args = info.op
        page = self.store.page_tokens
        if kind == "probe":  # hidden_states carries the running minimum over the span's blocks
            hashes, pin_s = args
            held = self.store.match((self.name,), hashes)
            self.store.touch(hashes[:held], pin_s)
            return (torch.minimum(hidden_states, torch.full_like(hidden_states, float(held))),)
        if kind == "load":
            hashes, = args
            fit_pages(self.memory_cache, info.cache_handles, len(hashes) * page)
            with self.memory_cache.use_cache(*info.cache_handles) as tensors:
                if tensors[0].shape[0] != 1:
                    raise PrefixMissing(f"{MISSING_MESSAGE}: prefix reuse needs batch size 1")
                for i, h in enumerate(hashes):
                    stored = self.store.get(self.name, h)
                    if stored is None:
                        raise PrefixMissing(f"{MISSING_MESSAGE}: page {i} of {len(hashes)} for {self.name}")
                    for dst, src in zip(self._page_slices(tensors, i * page, (i + 1) * page), stored):
                        dst.copy_(src)
            self.store.touch(hashes)
            self._offsets[info.cache_handles] = len(hashes) * page
            self.store.stats["tokens_loaded"] += len(hashes) * page
            return (hidden_states,)
        if kind == "save":  # the span's blocks in turn, each storing the pages that fit for all of them
            hashes, first, tokens, uids = args
            protect = set(hashes)
            with self.memory_cache.use_cache(*info.cache_handles) as tensors:
                if tensors[0].shape[0] != 1:
                    return (hidden_states,)
                wanted = min(len(hashes), tokens // page)
                page_nbytes = sum(s.numel() * s.element_size() for s in self._page_slices(tensors, 0, page))
                last = first + self.store.fit_span(uids, hashes, first, wanted, page_nbytes, protect)
                if last < wanted and self.name == uids[0]:  # once per span
                    self.store.report_unheld(self.name, hashes[last:wanted])
                for i in range(first, last):
                    copies = tuple(s.clone() for s in self._page_slices(tensors, i * page, (i + 1) * page))
                    if not self.store.put(self.name, hashes[i], hashes[i - 1] if i else None, copies, protect):
                        self.store.report_unheld(self.name, hashes[i:last])
                        break
            self.store.touch(hashes[: tokens // page])
            return (hidden_states,)
        if kind == "shift":  # a rollback: the session's next positions are written this much earlier
            positions, = args
            self._offsets[info.cache_handles] = self._offsets.get(info.cache_handles, 0) - int(positions)
            return (hidden_states,)
        if kind == "forget":
            self._offsets.pop(info.cache_handles, None)
            return (hidden_states,)
        raise ValueError(f"unknown prefix op {kind!r}")


@dataclasses.dataclass
class _SessionPrefix:
    """A petals session of this handler: its prompt pages (none without prefix reuse), its cache and rollbacks."""

    hashes: list
    load: int  # pages to load before the first step
    backends: tuple = ()
    handles: tuple = ()
    shifted: bool = False  # a rollback moved its offset (forgotten at the end)
    confirm: int = 0  # the rollback of the step in flight, confirmed in its reply
    room: int = 0  # positions granted beyond the session's max_length for the ones it takes back
    granted: bool = False  # the room was asked for: the first reply says how much was granted


_SESSION: ContextVar[Optional[_SessionPrefix]] = ContextVar("chainswarm_session_prefix", default=None)


def _session_prefix(metadata: dict) -> _SessionPrefix:
    spec = metadata.get(META_KEY)
    if spec is None:
        return _SessionPrefix([], 0)
    return _SessionPrefix(*parse_session_spec(spec))


class PrefixHandler(ChainswarmHandler):
    """The push-fixed handler plus the prefix protocol (:mod:`swarm.trust.prefix`)."""

    _rpc_handlers = None  # hivemind caches the RPC table per class: collect ours, not the parent's

    def _may_store_pages(self, hashes) -> bool:
        """Whether this session may store pages under ``hashes`` (every session here; the ticket gate of
        :mod:`server.tickets` allows only the hashes its ticket names)."""
        return True

    async def _run_op(self, backends, handles, op: tuple, value: float = 0.0) -> float:
        infos = tuple(PrefixOp(b.name, 0, tuple(h), None, op=op) for b, h in zip(backends, handles))
        probe = torch.full((1, 1, 1), value, dtype=torch.float32)
        (out,) = await backends[0].inference_pool.submit_task(probe, DUMMY_INT64, infos, *([None] * len(infos)),
                                                              priority=0.0)
        return float(out.reshape(-1)[0])

    async def rpc_prefix_probe(self, request: runtime_pb2.ExpertRequest,
                               context: P2PContext) -> runtime_pb2.ExpertResponse:
        """How many leading pages of ``hashes`` this server holds for every block of ``uid`` (then pinned)."""
        failpoints.hit("probe")
        uids = self._check_uids(request.uid)
        backends = tuple(self.module_backends[uid] for uid in uids)
        metadata = MSGPackSerializer.loads(request.metadata) if request.metadata else {}
        held = 0
        if metadata.get("page") == PAGE_TOKENS and uids:
            hashes = check_hashes(metadata.get("hashes", []))
            pin_s = min(MAX_PIN_S, max(0.0, float(metadata.get("pin_s", 10.0))))
            if hashes:
                held = int(await self._run_op(backends, [()] * len(backends), ("probe", hashes, pin_s),
                                              value=float(len(hashes))))
        return runtime_pb2.ExpertResponse(metadata=MSGPackSerializer.dumps({"pages": held, "page": PAGE_TOKENS}))

    async def rpc_inference(self, requests: AsyncIterator[runtime_pb2.ExpertRequest],
                            context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        try:
            first = await asyncio.wait_for(anext(requests), self.step_timeout)
        except (asyncio.TimeoutError, StopAsyncIteration):
            return
        metadata = MSGPackSerializer.loads(first.metadata) if first.metadata else {}
        session = _session_prefix(metadata)
        _SESSION.set(session)
        if ROLLBACK_ROOM_KEY in metadata:
            first.metadata = MSGPackSerializer.dumps(self._grant_room(session, metadata))

        async def replay():
            yield first
            async for request in requests:
                yield request

        async for response in super().rpc_inference(replay(), context):
            reply = {}
            if session.granted:  # the first reply: the room granted for positions taken back
                reply[ROLLBACK_ROOM_KEY], session.granted = session.room, False
            if session.confirm:  # this step took positions back first: say so (a vanilla server would not)
                reply[ROLLBACK_META_KEY], session.confirm = session.confirm, 0
            if reply:
                response.metadata = MSGPackSerializer.dumps(reply)
            yield response

    def _grant_room(self, session: _SessionPrefix, metadata: dict) -> dict:
        """The opening metadata petals' step loop reads, with ``max_length`` raised by the room the client asked for
        (:data:`ROLLBACK_ROOM_KEY`): petals counts every position sent, taken back or not. The room is granted
        within this server's longest session; the session's pages stay bounded by its own ``max_length``."""
        asked, declared = room_positions(metadata.pop(ROLLBACK_ROOM_KEY)), metadata.get("max_length")
        if asked and isinstance(declared, int) and 0 <= declared <= self.inference_max_length:
            session.room = min(asked, self.inference_max_length - declared)
            metadata["max_length"] = declared + session.room
        session.granted = True
        return metadata

    async def _take_back(self, positions: int) -> None:
        session = _SESSION.get()
        if session is None or not session.handles:
            raise ValueError("this session cannot take positions back")
        await self._run_op(session.backends, session.handles, ("shift", positions))
        self._release(positions)
        session.shifted, session.confirm = True, positions

    @contextlib.asynccontextmanager
    async def _allocate_cache(self, backends, *, batch_size: int, max_length: int, timeout: Optional[float]):
        session = _SESSION.get()
        bound = max_length - session.room if session is not None else max_length  # the pages' bound: its own
        async with super()._allocate_cache(backends, batch_size=batch_size, max_length=bound,
                                           timeout=timeout) as handles:
            if session is None:  # (not a petals session of this handler)
                yield handles
                return
            session.backends, session.handles = tuple(backends), tuple(tuple(h) for h in handles)
            try:
                if session.load:
                    if batch_size != 1 or session.load * PAGE_TOKENS > max_length:
                        raise PrefixMissing(f"{MISSING_MESSAGE}: cannot load {session.load} pages here")
                    await self._grow(session.load * PAGE_TOKENS)  # the pages the loaded prefix fills
                    await self._run_op(backends, session.handles, ("load", session.hashes[: session.load]))
                yield handles
            finally:
                if session.load or session.shifted:
                    with contextlib.suppress(Exception):
                        await self._run_op(backends, session.handles, ("forget",))

    async def _iterate_inference_steps(self, first_request, requests, session_id, requested_uids, context):
        session = _SESSION.get()
        steps = 0
        async for request, metadata in super()._iterate_inference_steps(
            first_request, requests, session_id, requested_uids, context
        ):
            yield request, metadata
            steps += 1
            if (steps == 1 and session is not None and session.hashes and session.handles and first_request.tensors
                    and self._may_store_pages(session.hashes)):
                # the first step (the prefill) is done: store the new full pages it computed
                computed = session.load * PAGE_TOKENS + int(first_request.tensors[0].size[1])
                try:
                    await self._run_op(session.backends, session.handles,
                                       ("save", session.hashes, session.load, computed,
                                        tuple(b.name for b in session.backends)))
                except Exception as exc:  # never fail a session because the cache could not take its pages
                    logger.warning("could not store prefix pages: %s", exc)


PrefixHandler.__name__ = PrefixHandler.__qualname__ = "TransformerConnectionHandler"


def install_prefix_cache(push_counter=None):
    """Install the prefix handler and backend (server process, before ``Server.run()``)."""
    from server.handler import install

    return install(PrefixHandler, PrefixBackend, push_counter=push_counter)
