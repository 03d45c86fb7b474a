"""Step time as a function of batch size, measured in-process on real blocks (no swarm, no network).

:func:`load_backends` builds petals backends for some blocks of a checkpoint the way a petals server does
(``load_pretrained_block`` + ``convert_block`` behind :class:`server.prefix_cache.PrefixBackend`), with their KV
caches in one ``MemoryCache`` of this process. :class:`Sessions` allocates caches for sessions the way the
runtime holds them. :func:`decode_step_times` times one decode step of ``b`` sessions for each batch size:
``batched`` (one :class:`server.batching.BatchedInferenceStep` group) and ``sequential`` (petals' own
per-session path, b tasks one after another). Used by the batching benchmark and its tests.
"""
from __future__ import annotations

import itertools
import statistics
import time
from typing import Iterable, Sequence

import torch

from swarm.compat import petals  # noqa: F401  (the shim must precede petals.server)
from petals.data_structures import InferenceMetadata
from petals.server.memory_cache import MemoryCache
from petals.utils.misc import DUMMY_INT64

from server.batching import BatchedInferenceStep, _Group
from server.prefix_cache import PrefixBackend


def load_backends(model_dir: str, blocks: Iterable[int], dtype: torch.dtype = torch.float32) -> dict:
    """``{uid: PrefixBackend}`` for ``blocks`` of the checkpoint, sharing one in-process ``MemoryCache``."""
    from hivemind import BatchTensorDescriptor
    from petals.server.from_pretrained import load_pretrained_block
    from petals.utils.convert_block import QuantType, convert_block

    config = petals.AutoDistributedConfig.from_pretrained(str(model_dir))
    cache = MemoryCache(None)
    cpu = torch.device("cpu")
    backends = {}
    for i in blocks:
        block = load_pretrained_block(str(model_dir), i, config=config, torch_dtype=dtype)
        block = convert_block(block, i, config, [cpu], cpu, QuantType.NONE)
        schema = (BatchTensorDescriptor(1, 2048, config.hidden_size, dtype=dtype),)
        uid = f"block.{i}"
        backends[uid] = PrefixBackend(uid, block, config=config, memory_cache=cache, backend_dtype=dtype,
                                      max_chunk_size_bytes=256 * 1024 * 1024, args_schema=schema, kwargs_schema={},
                                      outputs_schema=schema, min_batch_size=1, max_batch_size=2048)
    return backends


class Session:
    """One session's KV handles on every block (held as the runtime holds them) and its current length."""

    _handles = itertools.count(1_000_000)

    def __init__(self, backends: dict, max_length: int = 256, batch: int = 1):
        self.backends = backends
        self.handles = {}
        for uid, backend in backends.items():
            descrs = backend.get_inference_cache_descriptors(batch, max_length)
            handles = tuple(next(self._handles) for _ in descrs)
            for h, d in zip(handles, descrs):
                backend.memory_cache._allocated_tensors[h] = d.make_zeros()
            self.handles[uid] = handles
        self.length = 0

    def infos(self) -> tuple:
        return tuple(InferenceMetadata(uid, self.length, h, None) for uid, h in self.handles.items())

    def task(self, hidden: torch.Tensor) -> list:
        """The inference pool arguments of a step of this session."""
        return [hidden, DUMMY_INT64, self.infos(), *([None] * len(self.handles))]

    def close(self) -> None:
        for uid, backend in self.backends.items():
            for h in self.handles[uid]:
                backend.memory_cache._allocated_tensors.pop(h, None)


def step_sessions(step: BatchedInferenceStep, sessions: Sequence[Session], hidden: Sequence[torch.Tensor],
                  batched: bool) -> torch.Tensor:
    """One step of every session: one batched group, or petals' path one session after another."""
    if batched:
        group = _Group([s.task(h) for s, h in zip(sessions, hidden)])
        (out,) = step(group)
        for i, error in enumerate(group.errors):
            if error is not None:
                raise error
    else:
        out = torch.cat([step(*s.task(h))[0] for s, h in zip(sessions, hidden)])
    for s, h in zip(sessions, hidden):
        s.length += h.shape[1]
    return out


def decode_step_times(backends: dict, batch_sizes: Sequence[int] = (1, 2, 4, 8, 16), *, context: int = 64,
                      repeats: int = 10) -> dict:
    """Median seconds per decode step over all of ``backends`` for each batch size, batched and sequential,
    with every session holding ``context`` cached tokens."""
    step = BatchedInferenceStep(backends)
    hidden_size = next(iter(backends.values())).config.hidden_size
    result = {}
    torch.manual_seed(0)
    for b in batch_sizes:
        row = {}
        for mode in ("batched", "sequential"):
            sessions = [Session(backends, max_length=context + repeats + 4) for _ in range(b)]
            step_sessions(step, sessions, [torch.randn(1, context, hidden_size) for _ in sessions], batched=False)
            times = []
            for _ in range(repeats + 1):
                tokens = [torch.randn(1, 1, hidden_size) for _ in sessions]
                start = time.perf_counter()
                step_sessions(step, sessions, tokens, batched=mode == "batched")
                times.append(time.perf_counter() - start)
            for s in sessions:
                s.close()
            row[mode] = statistics.median(times[1:])
        result[b] = row
    return result
