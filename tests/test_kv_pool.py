"""The paged KV pool in one process (server/kv_pool.py): a handler's side (open, extend, roll back, close) and the
runtime's side of a batched pass (the pipe read once, then every session fitted on every block). The same pool
in real server processes is tested from its rpc_info counters in tests/test_multi_session.py."""
import asyncio
import contextlib
import os

import pytest
import torch

from swarm.model.compat import petals  # noqa: F401  (the shim must precede petals.server)
from hivemind.utils import TensorDescriptor

from server.kv_pool import PAGE_TOKENS, PagedKvPool, fit_pages, receive, step_tensors

KV_HEADS, HEAD_DIM, MAX_TOKENS = 3, 8, 64


def descriptors(blocks: int) -> list[TensorDescriptor]:
    """A session's cache on ``blocks`` blocks in petals' layout: keys (b, kv, d, L), values (b, kv, L, d)."""
    keys = TensorDescriptor((1, KV_HEADS, HEAD_DIM, MAX_TOKENS), dtype=torch.float32, device=torch.device("cpu"))
    values = TensorDescriptor((1, KV_HEADS, MAX_TOKENS, HEAD_DIM), dtype=torch.float32, device=torch.device("cpu"))
    return [keys, values] * blocks


@contextlib.contextmanager
def runtime(cache):
    """Calls of the runtime's side (petals asserts which process makes them; here both sides share one)."""
    cache.runtime_pid = os.getpid()
    try:
        yield
    finally:
        cache.runtime_pid = -1  # back to the handlers' side: allocate_cache refuses the runtime's process


def test_a_pass_reads_the_pipe_once_and_fits_each_session_to_its_pages():
    pool = PagedKvPool(max_size_bytes=2 * 4 * KV_HEADS * HEAD_DIM * MAX_TOKENS * 4)
    pool.runtime_pid = -1

    async def scenario():
        async with pool.allocate_cache(*descriptors(2), timeout=5) as first, \
                pool.allocate_cache(*descriptors(2), timeout=5) as second:
            await pool.extend(first, 20)  # two pages
            await pool.extend(second, 3)  # one page
            receive([pool, pool])  # both sessions' tensors created (a pool shared by blocks is read once)
            for handles, positions in ((first, 20), (second, 3)):
                for block in range(2):
                    keys, values = step_tensors(pool, handles[2 * block: 2 * block + 2], positions)
                    pages = -(-positions // PAGE_TOKENS)
                    assert keys.shape == (1, KV_HEADS, HEAD_DIM, pages * PAGE_TOKENS)
                    assert values.shape == (1, KV_HEADS, pages * PAGE_TOKENS, HEAD_DIM)
            keys = step_tensors(pool, first[:1], 20)[0]
            keys[..., :20] = 1.0
            pool.rollback(first, 15)  # 5 positions left: one page, the first positions kept
            shrunk = step_tensors(pool, first[:1], 5)[0]
            assert shrunk.shape[-1] == PAGE_TOKENS and bool((shrunk[..., :5] == 1.0).all())
            return first

    closed = asyncio.run(scenario())
    # a session closed after this pass read the pipe keeps its tensors for the pass; the next read drops them
    assert step_tensors(pool, closed[:1], 5)[0].shape[-1] == PAGE_TOKENS
    receive([pool])
    with pytest.raises(KeyError):
        step_tensors(pool, closed[:1], 5)
    assert pool.current_size_bytes == 0 and pool.sessions_open == 0


def test_fit_pages_reads_the_pipe_itself_and_a_plain_cache_is_left_whole():
    pool = PagedKvPool(max_size_bytes=10 ** 7)
    pool.runtime_pid = -1

    async def scenario():
        async with pool.allocate_cache(*descriptors(1), timeout=5) as handles:
            await pool.extend(handles, PAGE_TOKENS + 1)
            fit_pages(pool, handles, PAGE_TOKENS + 1)  # no receive() before it: fit reads the pipe
            with runtime(pool), pool.use_cache(*handles) as (keys, values):
                assert keys.shape[-1] == values.shape[-2] == 2 * PAGE_TOKENS

    asyncio.run(scenario())

    from petals.server.memory_cache import MemoryCache

    plain = MemoryCache(None)
    plain.runtime_pid = -1

    async def whole():
        async with plain.allocate_cache(*descriptors(1), timeout=5) as handles:
            receive([plain])  # not paged: nothing to do
            fit_pages(plain, handles, 3)
            with runtime(plain):
                keys, values = step_tensors(plain, handles, 3)
            assert keys.shape[-1] == values.shape[-2] == MAX_TOKENS

    asyncio.run(whole())


def test_a_step_queued_for_a_session_that_closed_fails_with_the_reason():
    """A session's step can wait in the pool's queue while its client leaves and the handler frees its KV; the
    runtime then refuses that step alone, saying why (a bare ``KeyError: 68`` in the server's log before)."""
    from server.kv_pool import SessionCacheFreed

    pool = PagedKvPool(max_size_bytes=10 ** 7)
    pool.runtime_pid = -1

    async def scenario():
        async with pool.allocate_cache(*descriptors(1), timeout=5) as handles:
            await pool.extend(handles, 3)
        return handles

    closed = asyncio.run(scenario())
    with runtime(pool), pytest.raises(SessionCacheFreed, match="freed before this step ran: its session ended"):
        with pool.use_cache(*closed):
            pass
    assert pool.current_size_bytes == 0
