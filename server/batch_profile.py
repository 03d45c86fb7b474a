"""Step time as a function of batch size, measured in-process on real blocks (no swarm, no network).

:func:`load_backends` builds petals backends for some blocks of a checkpoint the way a petals server does
(``load_pretrained_block`` + ``convert_block`` behind :class:`server.prefix_cache.PrefixBackend`), with their KV
caches in one ``MemoryCache`` of this process. :class:`Sessions` allocates caches for sessions the way the
runtime holds them. :func:`decode_step_times` times one decode step of ``b`` sessions for each batch size:
``batched`` (one :class:`server.batching.BatchedInferenceStep` group) and ``sequential`` (petals' own
per-session path, b tasks one after another). Used by the batching benchmark and its tests, and by
:func:`server.profiling.batch_factors` (a server's published batch curve) on :func:`random_backends`.
"""
from __future__ import annotations

import itertools
import statistics
import time
from typing import Iterable, Sequence

import torch

from swarm.model.compat import petals  # noqa: F401  (the shim must precede petals.server)
from petals.data_structures import InferenceMetadata
from petals.server.memory_cache import MemoryCache
from petals.utils.misc import DUMMY_INT64

from server.batching import BatchedInferenceStep, _Group
from server.prefix_cache import PrefixBackend


def load_backends(model_dir: str, blocks: Iterable[int], dtype: torch.dtype = torch.float32) -> dict:
    """``{uid: PrefixBackend}`` for ``blocks`` of the checkpoint, sharing one in-process ``MemoryCache``."""
    from petals.utils.convert_block import QuantType, convert_block

    from swarm.model.families import load_block

    config = petals.AutoDistributedConfig.from_pretrained(str(model_dir))
    cache = MemoryCache(None)
    cpu = torch.device("cpu")
    backends = {}
    for i in blocks:
        block = load_block(str(model_dir), i, config=config, torch_dtype=dtype)
        block = convert_block(block, i, config, [cpu], cpu, QuantType.NONE)
        backends[f"block.{i}"] = _backend(f"block.{i}", block, config, cache, dtype)
    return backends


def random_backends(config, device: torch.device, dtype: torch.dtype, quant_type, num_blocks: int = 1) -> dict:
    """``{uid: PrefixBackend}`` for ``num_blocks`` randomly initialised blocks of ``config``'s architecture, built
    and converted as a petals server holds them (what a server profiles before it knows its blocks)."""
    from petals.utils.convert_block import convert_block

    cache = MemoryCache(None)
    backends = {}
    for i in range(num_blocks):
        block = config.block_class(config).to(dtype)
        block = convert_block(block, i, config, [device], device, quant_type=quant_type, freeze=True)
        backends[f"block.{i}"] = _backend(f"block.{i}", block, config, cache, dtype)
    return backends


def _backend(uid: str, block, config, cache: MemoryCache, dtype: torch.dtype) -> PrefixBackend:
    from hivemind import BatchTensorDescriptor

    schema = (BatchTensorDescriptor(1, 2048, config.hidden_size, dtype=dtype),)
    return PrefixBackend(uid, block, config=config, memory_cache=cache, backend_dtype=dtype,
                         max_chunk_size_bytes=256 * 1024 * 1024, args_schema=schema, kwargs_schema={},
                         outputs_schema=schema, min_batch_size=1, max_batch_size=2048)


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
                      repeats: int = 10, modes: Sequence[str] = ("batched", "sequential")) -> dict:
    """Median seconds per decode step over all of ``backends`` for each batch size, batched and sequential
    (``modes``), with every session holding ``context`` cached tokens."""
    step = BatchedInferenceStep(backends)
    first = next(iter(backends.values()))
    hidden_size, dtype = first.config.hidden_size, first.dtype
    device = next(first.module.parameters()).device
    result = {}
    torch.manual_seed(0)
    for b in batch_sizes:
        row = {}
        for mode in modes:
            sessions = [Session(backends, max_length=context + repeats + 4) for _ in range(b)]
            step_sessions(step, sessions, [torch.randn(1, context, hidden_size, device=device, dtype=dtype)
                                           for _ in sessions], batched=False)
            times = []
            for _ in range(repeats + 1):
                tokens = [torch.randn(1, 1, hidden_size, device=device, dtype=dtype) for _ in sessions]
                start = time.perf_counter()
                step_sessions(step, sessions, tokens, batched=mode == "batched")
                times.append(time.perf_counter() - start)
            for s in sessions:
                s.close()
            row[mode] = statistics.median(times[1:])
        result[b] = row
    return result
