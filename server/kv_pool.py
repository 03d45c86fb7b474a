"""The server's KV pool, allocated by the page as sessions grow.

petals' ``MemoryCache`` reserves a session's whole ``max_length`` on every block it serves at session open and
keeps it until the session ends, whatever the session really uses. :class:`PagedKvPool` keeps petals' byte
budget, handles and runtime pipe, and changes what a session holds:

* **Open** (``allocate_cache``, connection handler): ``max_length`` is an upper bound, checked against the pool
  (a session that could never fit is refused at once), and nothing is reserved yet. The runtime creates the
  session's cache tensors with room for 0 positions.
* **Grow** (:meth:`PagedKvPool.extend`, connection handler, before a step is submitted): the session holds
  ⌈positions / :data:`PAGE_TOKENS`⌉ pages on each of its blocks. The pages a step needs are taken from the pool
  and the runtime regrows the session's tensors to exactly that many pages before it runs the step
  (:meth:`PagedKvPool.fit`, called by the backends' step code). When the pool
  has no room the step waits at most :data:`GROW_WAIT_S` for pages to be freed, then fails with "KV pool full"
  (the session's client goes on elsewhere, as after any failed step): a short, bounded wait, so sessions that
  outgrew the pool together can never wait on each other.
* **Roll back** (:meth:`PagedKvPool.rollback`): positions a verification pass rejected are forgotten, and the
  pages past the session's new length go back to the pool at once (the runtime shrinks the tensors at the
  session's next step).
* **End**: every page goes back to the pool.

Admission is the orchestrator's: it grants a session only while the KV tokens its chain's servers were planned
for have room (prompt + ``max_tokens``, or a reservation grown in parts), so its sessions never outgrow a pool;
a vanilla petals client declares up to ``max_length`` and holds only what it uses.

A *block-page* — :data:`PAGE_TOKENS` positions of one sequence's keys and values on one block — is the unit of
``rpc_info``'s page counters (:meth:`pages`): a session of batch ``b`` at ``n`` positions over ``m`` blocks holds
``b·m·⌈n/16⌉`` of them.

Storage stays contiguous per session (what the attention kernels read): a session's tensors are reallocated
with one more page and the old positions copied when it crosses a page boundary — an amortised copy of 1/16
of its cache per token, no block tables. Pages are not shared between sessions; prefix reuse copies stored
pages into a session (:mod:`server.prefix_cache`).

petals' step loop (``iterate_rpc_inference``) still checks every step against the session's ``max_length``.
"""
from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import math
import multiprocessing as mp
import os
import time
from typing import AsyncContextManager, Optional, Sequence

import torch

from swarm.model.compat import petals  # noqa: F401  (the shim must precede petals.server)
from hivemind.utils import TensorDescriptor
from petals.data_structures import Handle
from petals.server.memory_cache import AllocationFailed, MemoryCache
from swarm.trust.prefix import PAGE_TOKENS

logger = logging.getLogger(__name__)

GROW_WAIT_S = 1.0  # a step waits at most this long for free pages, then fails ("KV pool full")


def token_axis(index: int) -> int:
    """The positions' axis of a block's ``index``-th cache tensor: keys ``(b, kv, d, L)``, values ``(b, kv, L, d)``,
    one pair per tensor-parallel shard (petals' layout)."""
    return -1 if index % 2 == 0 else -2


def _with_tokens(descr: TensorDescriptor, axis: int, tokens: int) -> TensorDescriptor:
    shape = list(descr.shape)
    shape[axis] = tokens
    return TensorDescriptor(tuple(shape), dtype=descr.dtype, device=descr.device)


class SessionCacheFreed(KeyError):
    """A queued step of a session whose KV was freed before it ran (the session closed meanwhile)."""

    def __str__(self) -> str:  # KeyError's own quotes the message
        return str(self.args[0]) if self.args else ""


class _Lease:
    """A session's hold on the pool (connection-handler side)."""

    __slots__ = ("bytes_per_token", "max_tokens", "positions", "pages")

    def __init__(self, bytes_per_token: int, max_tokens: int):
        self.bytes_per_token, self.max_tokens = bytes_per_token, max_tokens
        self.positions = self.pages = 0


class PagedKvPool(MemoryCache):
    """petals' ``MemoryCache`` with sessions that hold pages as they grow (see the module docstring)."""

    def __init__(self, max_size_bytes, max_alloc_timeout=None):
        super().__init__(max_size_bytes, max_alloc_timeout)
        self._leases: dict[tuple, _Lease] = {}  # connection-handler process: its own sessions, by handles
        self._axes: dict[Handle, int] = {}  # runtime: the positions' axis of every live tensor
        self._open = mp.Value(ctypes.c_int64, 0)  # sessions open, all handler processes
        self._peak = mp.Value(ctypes.c_int64, 0, lock=False)  # the most bytes held at once

    # ---- connection-handler side ----
    @contextlib.asynccontextmanager
    async def allocate_cache(self, *descriptors: TensorDescriptor,
                             timeout: float) -> AsyncContextManager[Sequence[Handle]]:
        axes = tuple(token_axis(i) for i in range(len(descriptors)))
        max_tokens = int(descriptors[0].shape[-1]) if descriptors else 0
        if any(int(d.shape[a]) != max_tokens for d, a in zip(descriptors, axes)):
            raise ValueError("cache descriptors must follow petals' layout (keys (b, kv, d, L), values (b, kv, L, d))")
        full = self.get_allocation_size(*descriptors)
        if full > self.max_size_bytes:
            raise AllocationFailed(f"a session of {max_tokens} tokens needs {full} bytes of KV, more than this "
                                   f"server's whole pool ({self.max_size_bytes} bytes)")
        empty = [_with_tokens(d, a, 0) for d, a in zip(descriptors, axes)]
        async with super().allocate_cache(*empty, timeout=timeout) as handles:
            key = tuple(handles)
            self._leases[key] = _Lease(full // max_tokens if max_tokens else 0, max_tokens)
            with self._open.get_lock():
                self._open.value += 1
            try:
                yield handles
            finally:
                lease = self._leases.pop(key)
                self._give(lease.pages * PAGE_TOKENS * lease.bytes_per_token)
                with self._open.get_lock():
                    self._open.value -= 1

    @contextlib.asynccontextmanager
    async def _wait_for_free_memory(self, alloc_size: int, timeout: Optional[float]):
        """petals' wait for memory, skipped for what this pool allocates at open (nothing): petals takes a process-
        shared lock there through hivemind's ``enter_asynchronously``, and when its allocation timeout fires while
        the executor thread still waits for that lock, the thread takes the lock later and never gives it back —
        from then on every allocation on the server hangs (petals 2.2 shields its allocations from outer
        cancellation, not from this inner timeout)."""
        if alloc_size == 0:
            yield
            return
        async with super()._wait_for_free_memory(alloc_size, timeout):
            yield

    async def extend(self, handles: Sequence[Handle], positions: int) -> None:
        """Make room for ``positions`` more positions of the session whose cache is ``handles`` (all its blocks'
        handles, flat), taking pages from the pool; raises ``AllocationFailed`` (pool full for :data:`GROW_WAIT_S`)
        or ``ValueError`` (past the session's ``max_length``)."""
        lease = self._leases[tuple(handles)]
        wanted = lease.positions + int(positions)
        if wanted > lease.max_tokens:
            raise ValueError(f"{wanted} positions exceed the session's max_length {lease.max_tokens}")
        pages = math.ceil(wanted / PAGE_TOKENS)
        if pages > lease.pages:
            more = (pages - lease.pages) * PAGE_TOKENS * lease.bytes_per_token
            deadline = time.monotonic() + GROW_WAIT_S
            while not self._take(more):  # polled: no lock or executor thread is held while it waits
                if time.monotonic() >= deadline:
                    logger.warning("KV pool full: a step needing %d more pages failed", pages - lease.pages)
                    raise AllocationFailed(f"KV pool full: {pages - lease.pages} more pages needed, "
                                           f"{self.pages(PAGE_TOKENS * lease.bytes_per_token)['free']} free "
                                           f"after {GROW_WAIT_S:.0f} s")
                await asyncio.sleep(0.02)
            lease.pages = pages
        lease.positions = wanted

    def rollback(self, handles: Sequence[Handle], positions: int) -> None:
        """Forget the session's last ``positions`` positions; pages past its new length go back to the pool."""
        lease = self._leases[tuple(handles)]
        if not 0 <= positions <= lease.positions:
            raise ValueError(f"cannot roll back {positions} of {lease.positions} positions")
        lease.positions -= positions
        pages = math.ceil(lease.positions / PAGE_TOKENS)
        if pages < lease.pages:
            self._give((lease.pages - pages) * PAGE_TOKENS * lease.bytes_per_token)
            lease.pages = pages

    def _take(self, nbytes: int) -> bool:
        """Count ``nbytes`` more as held if the pool has them (one short critical section, all processes)."""
        with self._lock_metadata:
            if self.current_size_bytes + nbytes > self.max_size_bytes:
                return False
            self.current_size_bytes += nbytes
            self._peak.value = max(self._peak.value, self.current_size_bytes)
            return True

    def _give(self, nbytes: int) -> None:
        if nbytes:
            with self._lock_metadata:
                self.current_size_bytes -= nbytes
            self._memory_freed_event.set()

    @property
    def sessions_open(self) -> int:
        """Sessions holding a lease (with or without pages yet), across all handler processes."""
        return int(self._open.value)

    def pages(self, page_bytes: int) -> dict:
        """Block-pages of the pool (``page_bytes``: one block-page's size): total, used, free and the peak used."""
        if not page_bytes:
            return {"page_tokens": PAGE_TOKENS, "total": 0, "used": 0, "free": 0, "peak": 0}
        total, used = self.max_size_bytes // page_bytes, self.current_size_bytes // page_bytes
        return {"page_tokens": PAGE_TOKENS, "total": int(total), "used": int(used), "free": int(total - used),
                "peak": int(self._peak.value // page_bytes)}

    # ---- runtime side ----
    @contextlib.contextmanager
    def use_cache(self, *handles: Handle) -> Sequence[torch.Tensor]:
        assert os.getpid() == self.runtime_pid, "use_cache runs in the runtime process"
        self.receive()
        freed = [handle for handle in handles if handle not in self._allocated_tensors]
        if freed:  # the step fails alone, with a reason instead of a bare KeyError
            raise SessionCacheFreed(f"the KV of cache handles {freed} was freed before this step ran: its session "
                                    "ended (its client left) while the step waited in the queue")
        yield tuple(self._allocated_tensors[handle] for handle in handles)

    def fit(self, handles: Sequence[Handle], positions: int) -> None:
        """Runtime, before a step: the tensors of ``handles`` hold exactly the pages ``positions`` need (grown, or
        shrunk after a rollback), their first positions kept. The handler took those pages from the pool when it
        accepted the step; nothing travels through petals' pipe for it (whose reader, this runtime, drains it only
        when it runs a step: a handler that sent one message per page would block on a full pipe)."""
        self.receive()
        self.fitted(handles, positions)

    def fitted(self, handles: Sequence[Handle], positions: int) -> tuple[torch.Tensor, ...]:
        """:meth:`fit` without reading the handlers' pipe first, and the fitted tensors: a batched pass reads the
        pipe once (:meth:`receive`) and then fits each session on each block (a pipe read is a ``poll`` system
        call, ~6 µs: two per session and block were 2-4 ms of a 16-session pass over 15 blocks). Handles must
        have been received: a step's handles were created before its task was submitted."""
        capacity = math.ceil(positions / PAGE_TOKENS) * PAGE_TOKENS
        tensors = []
        for handle in handles:
            tensor, axis = self._allocated_tensors[handle], self._axes[handle]
            if tensor.shape[axis] != capacity:
                tensor = self._allocated_tensors[handle] = _resized(tensor, axis, capacity)
            tensors.append(tensor)
        return tuple(tensors)

    def receive(self) -> None:
        """Runtime: apply the handlers' creations and deletions sent through the pipe so far, in their order."""
        while self._pipe_recv.poll():
            recv_handles, data = self._pipe_recv.recv()
            if data is None:
                for handle in recv_handles:
                    self._allocated_tensors.pop(handle, None)
                    self._axes.pop(handle, None)
            else:
                for i, (handle, descr) in enumerate(zip(recv_handles, data)):
                    self._allocated_tensors[handle] = descr.make_zeros()
                    self._axes[handle] = token_axis(i)


def _resized(tensor: torch.Tensor, axis: int, tokens: int) -> torch.Tensor:
    """``tensor`` with room for exactly ``tokens`` positions along ``axis``, the first ones kept."""
    shape = list(tensor.shape)
    keep = min(shape[axis], tokens)
    shape[axis] = tokens
    out = torch.zeros(shape, dtype=tensor.dtype, device=tensor.device)
    out.narrow(axis, 0, keep).copy_(tensor.narrow(axis, 0, keep))
    return out


def fit_pages(cache, handles: Sequence[Handle], positions: int) -> None:
    """Runtime, before a step of ``positions`` positions: :meth:`PagedKvPool.fit` when ``cache`` is paged (an
    in-process ``MemoryCache``, as the batch profile uses, allocates whole lengths)."""
    if isinstance(cache, PagedKvPool):
        cache.fit(handles, positions)


def step_tensors(cache, handles: Sequence[Handle], positions: int) -> tuple[torch.Tensor, ...]:
    """Runtime, in a batched pass that called :meth:`PagedKvPool.receive` once: the cache tensors of ``handles``
    fitted to ``positions`` (:meth:`PagedKvPool.fitted`); any other ``MemoryCache`` (whole lengths) through
    ``use_cache``."""
    if isinstance(cache, PagedKvPool):
        return cache.fitted(handles, positions)
    with cache.use_cache(*handles) as tensors:
        return tensors


def receive(caches) -> None:
    """Runtime, at the start of a batched pass: each paged pool among ``caches`` reads its pipe once."""
    for cache in {id(c): c for c in caches}.values():
        if isinstance(cache, PagedKvPool):
            cache.receive()


def flat_handles(handles: Sequence) -> tuple:
    """A session's handles as one flat tuple (``_allocate_cache`` yields one tuple per block)."""
    return tuple(h for block in handles for h in (block if isinstance(block, (tuple, list)) else (block,)))
