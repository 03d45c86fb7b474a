"""The server's KV pool: sessions admitted by the KV they declare, memory allocated by the page as they grow.

petals' ``MemoryCache`` allocates a session's whole ``max_length`` on every block it serves at session open and
keeps it until the session ends, whatever the session really uses. :class:`PagedKvPool` keeps petals' byte
budget, handles, runtime pipe and admission rule, and changes what is allocated:

* **Open** (``allocate_cache``, connection handler): the session's declared ``max_length`` is *reserved* — a
  session that could never fit is refused at once, one that does not fit now waits for others to end (petals'
  allocation timeout), exactly as petals admits. This is the deadlock-free admission rule: an admitted session
  can always grow to what it declared, so no two sessions can starve each other mid-generation (the orchestrator
  declares each session's own need, prompt + ``max_tokens``, not the swarm's ``max_length``). The runtime creates
  the session's cache tensors with room for 0 positions.
* **Grow** (:meth:`PagedKvPool.extend`, connection handler, before a step is submitted): the session's tensors are
  regrown to ⌈positions / :data:`PAGE_TOKENS`⌉ pages (at most its declared length) before the runtime runs the step.
* **Roll back** (:meth:`PagedKvPool.rollback`): positions a verification pass rejected are forgotten, and the pages
  past the session's new length are freed at once.
* **End**: its memory and its reservation go back to the pool.

A *block-page* — :data:`PAGE_TOKENS` positions of one sequence's keys and values on one block — is the unit of
``rpc_info``'s page counters (:meth:`pages`): ``total`` (the pool), ``reserved`` (declared by open sessions),
``free`` (``total - reserved``: what a new session may declare), ``used`` (allocated now) and ``peak`` (the most
allocated at once). A session of batch ``b`` at ``n`` positions over ``m`` blocks uses ``b·m·⌈n/16⌉`` of them.

Storage stays contiguous per session (what the attention kernels read): a session's tensors are reallocated
with one more page and the old positions copied when it crosses a page boundary — an amortised copy of 1/16
of its cache per token, no block tables. Pages are not shared between sessions; prefix reuse copies stored
pages into a session (:mod:`server.prefix_cache`). Not done: over-committing reservations with preemption
(vLLM's way to admit a vanilla petals client that declares 2,048 tokens and uses 60 without reserving 2,048).
"""
from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import math
import multiprocessing as mp
import os
from typing import AsyncContextManager, Sequence

import torch

from swarm.model.compat import petals  # noqa: F401  (the shim must precede petals.server)
from hivemind.utils import TensorDescriptor
from petals.data_structures import Handle
from petals.server.memory_cache import AllocationFailed, MemoryCache
from petals.utils.asyncio import shield_and_wait
from swarm.trust.prefix import PAGE_TOKENS

logger = logging.getLogger(__name__)


def token_axis(index: int) -> int:
    """The positions' axis of a block's ``index``-th cache tensor: keys ``(b, kv, d, L)``, values ``(b, kv, L, d)``,
    one pair per tensor-parallel shard (petals' layout)."""
    return -1 if index % 2 == 0 else -2


def _with_tokens(descr: TensorDescriptor, axis: int, tokens: int) -> TensorDescriptor:
    shape = list(descr.shape)
    shape[axis] = tokens
    return TensorDescriptor(tuple(shape), dtype=descr.dtype, device=descr.device)


class _Resize:
    """A pipe message to the runtime: regrow these handles' tensors to ``tokens`` positions."""

    __slots__ = ("tokens",)

    def __init__(self, tokens: int):
        self.tokens = tokens


class _Lease:
    """A session's hold on the pool (connection-handler side)."""

    __slots__ = ("axes", "bytes_per_token", "max_tokens", "positions", "capacity")

    def __init__(self, axes: tuple, bytes_per_token: int, max_tokens: int):
        self.axes, self.bytes_per_token, self.max_tokens = axes, bytes_per_token, max_tokens
        self.positions = self.capacity = 0  # positions written; positions the tensors hold (whole pages)


class PagedKvPool(MemoryCache):
    """petals' ``MemoryCache`` with sessions that hold pages as they grow (see the module docstring)."""

    def __init__(self, max_size_bytes, max_alloc_timeout=None):
        super().__init__(max_size_bytes, max_alloc_timeout)
        self._leases: dict[tuple, _Lease] = {}  # connection-handler process: its own sessions, by handles
        self._axes: dict[Handle, int] = {}  # runtime: the positions' axis of every live tensor
        self._open = mp.Value(ctypes.c_int64, 0)  # sessions open, all handler processes
        self._used = mp.Value(ctypes.c_int64, 0)  # bytes of the pages allocated now, all handler processes
        self._peak = mp.Value(ctypes.c_int64, 0, lock=False)  # the most bytes allocated at once

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
        if self.max_alloc_timeout is not None:
            timeout = min(timeout, self.max_alloc_timeout)
        reserving = asyncio.create_task(self._reserve(full, timeout))
        await shield_and_wait(reserving)  # (petals' way: the memory lock must not be abandoned half-taken)
        try:
            empty = [_with_tokens(d, a, 0) for d, a in zip(descriptors, axes)]
            async with super().allocate_cache(*empty, timeout=timeout) as handles:
                key = tuple(handles)
                self._leases[key] = _Lease(axes, full // max_tokens if max_tokens else 0, max_tokens)
                with self._open.get_lock():
                    self._open.value += 1
                try:
                    yield handles
                finally:
                    lease = self._leases.pop(key)
                    self._count_used(-lease.capacity * lease.bytes_per_token)
                    with self._open.get_lock():
                        self._open.value -= 1
        finally:
            with self._lock_metadata:
                self.current_size_bytes -= full
            self._memory_freed_event.set()

    async def _reserve(self, nbytes: int, timeout: float) -> None:
        async with self._wait_for_free_memory(nbytes, timeout):
            with self._lock_metadata:
                self.current_size_bytes += nbytes

    async def extend(self, handles: Sequence[Handle], positions: int) -> None:
        """Make room for ``positions`` more positions of the session whose cache is ``handles`` (all its blocks'
        handles, flat): its tensors grow to the pages they need (within its reservation, so this never waits);
        raises ``ValueError`` past the session's ``max_length``."""
        lease = self._leases[tuple(handles)]
        wanted = lease.positions + int(positions)
        if wanted > lease.max_tokens:
            raise ValueError(f"{wanted} positions exceed the session's max_length {lease.max_tokens}")
        lease.positions = wanted
        if wanted > lease.capacity:
            self._resize(handles, lease, min(lease.max_tokens, math.ceil(wanted / PAGE_TOKENS) * PAGE_TOKENS))

    def rollback(self, handles: Sequence[Handle], positions: int) -> None:
        """Forget the session's last ``positions`` positions; the pages past its new length are freed."""
        lease = self._leases[tuple(handles)]
        if not 0 <= positions <= lease.positions:
            raise ValueError(f"cannot roll back {positions} of {lease.positions} positions")
        lease.positions -= positions
        capacity = math.ceil(lease.positions / PAGE_TOKENS) * PAGE_TOKENS
        if capacity < lease.capacity:
            self._resize(handles, lease, capacity)

    def _resize(self, handles: Sequence[Handle], lease: _Lease, capacity: int) -> None:
        self._count_used((capacity - lease.capacity) * lease.bytes_per_token)
        lease.capacity = capacity
        with self._lock_metadata:
            self._pipe_send.send((tuple(handles), _Resize(capacity)))

    def _count_used(self, nbytes: int) -> None:
        with self._used.get_lock():
            self._used.value += nbytes
            self._peak.value = max(self._peak.value, self._used.value)

    @property
    def sessions_open(self) -> int:
        """Sessions open (with or without pages yet), across all handler processes."""
        return int(self._open.value)

    def pages(self, page_bytes: int) -> dict:
        """Block-pages of the pool (``page_bytes``: one block-page's size): total, reserved by open sessions, free
        for new ones, used (allocated now) and the peak used."""
        if not page_bytes:
            return {"page_tokens": PAGE_TOKENS, "total": 0, "reserved": 0, "free": 0, "used": 0, "peak": 0}
        total, reserved = self.max_size_bytes // page_bytes, -(-self.current_size_bytes // page_bytes)
        return {"page_tokens": PAGE_TOKENS, "total": int(total), "reserved": int(reserved),
                "free": int(max(0, total - reserved)), "used": int(-(-self._used.value // page_bytes)),
                "peak": int(-(-self._peak.value // page_bytes))}

    # ---- runtime side ----
    @contextlib.contextmanager
    def use_cache(self, *handles: Handle) -> Sequence[torch.Tensor]:
        assert os.getpid() == self.runtime_pid, "use_cache runs in the runtime process"
        while self._pipe_recv.poll():  # creations, resizes and deletions, in the order the handlers sent them
            recv_handles, data = self._pipe_recv.recv()
            if data is None:
                for handle in recv_handles:
                    self._allocated_tensors.pop(handle, None)
                    self._axes.pop(handle, None)
            elif isinstance(data, _Resize):
                for handle in recv_handles:
                    if handle in self._allocated_tensors:
                        self._allocated_tensors[handle] = _resized(self._allocated_tensors[handle],
                                                                   self._axes[handle], data.tokens)
            else:
                for i, (handle, descr) in enumerate(zip(recv_handles, data)):
                    self._allocated_tensors[handle] = descr.make_zeros()
                    self._axes[handle] = token_axis(i)
        yield tuple(self._allocated_tensors[handle] for handle in handles)


def _resized(tensor: torch.Tensor, axis: int, tokens: int) -> torch.Tensor:
    """``tensor`` with room for exactly ``tokens`` positions along ``axis``, the first ones kept."""
    shape = list(tensor.shape)
    keep = min(shape[axis], tokens)
    shape[axis] = tokens
    out = torch.zeros(shape, dtype=tensor.dtype, device=tensor.device)
    out.narrow(axis, 0, keep).copy_(tensor.narrow(axis, 0, keep))
    return out


def flat_handles(handles: Sequence) -> tuple:
    """A session's handles as one flat tuple (``_allocate_cache`` yields one tuple per block)."""
    return tuple(h for block in handles for h in (block if isinstance(block, (tuple, list)) else (block,)))
