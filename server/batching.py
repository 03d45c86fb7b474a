"""Batched inference steps: decode steps of several sessions over the same span in one forward pass.

petals 2.2 runs every inference step of every session as its own task: its ``PrioritizedTaskPool`` hands the
runtime one task at a time. Here the server's merged inference pool is a :class:`BatchingTaskPool`: when the
runtime asks for work it takes *what is queued right now* (no waiting for company) and, if the oldest task
is a one-token decode step, groups it with the other queued decode steps over the same span — up to
``max_batch`` sequences. :class:`BatchedInferenceStep` runs such a group as one pass per block: norms,
q/k/v/o projections and the MLP over all sequences at once; rotary embeddings at each sequence's own
position; attention per session over its own cache length; each session's new key/value written to its own
cache slots. Everything else — prefills (several tokens), prefix-store operations (:class:`PrefixOp`), deep
prompts, adapters, non-Llama blocks — runs exactly as petals runs it. A lone decode step runs the batched
code with a batch of one (no waiting): it is a little faster than petals' step, which concatenates the whole
cache with the new key/value on every block, and a session's decode numerics do not depend on its company.

Scheduling: tasks leave in petals' order (priority, then arrival), with one exception so that a long prefill
does not stall the decodes queued behind it: a prefill at the head of the queue lets one decode batch go
first, once (it is never passed over twice, so prefills are not starved either).

:func:`install` (server process, before ``Server.run()``) rebinds ``merge_inference_pools_inplace`` in
``petals.server.server`` and returns the petals ``Server`` kwargs to use (``prefetch_batches=0``: petals'
runtime otherwise loads the next task in a background thread while a step runs, one task at a time, which
would leave nothing to batch). ``max_batch=1`` is petals' behaviour.
"""
from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import math
import multiprocessing as mp
import queue
from typing import Any, Optional, Sequence

import torch

from swarm.compat import petals  # noqa: F401  (the shim must precede petals.server)
from petals.data_structures import InferenceMetadata
from petals.server.backend import TransformerBackend, _MergedInferenceStep
from petals.server.task_pool import PrioritizedTaskPool, Task, _move_to_device_if_tensor
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, rotate_half

logger = logging.getLogger(__name__)

DEFAULT_MAX_BATCH = 8
STAT_NAMES = ("steps", "batched_steps", "batched_tasks", "largest_batch")


def pool_stats(pool: Any) -> Optional[dict]:
    """A backend's inference-pool batching counters (any process of the server), or None without batching."""
    return dict(pool.stats, max_batch=pool.max_batch) if isinstance(pool, BatchingTaskPool) else None


class _Group:
    """Several decode tasks' inputs, run as one batched step; ``errors[i]`` is task i's own failure."""

    __slots__ = ("inputs", "rows", "errors")

    def __init__(self, inputs: list):
        self.inputs = inputs  # per task: [hidden (B, 1, H), hypo_ids, infos, *prompts]
        self.rows = [int(args[0].shape[0]) for args in inputs]
        self.errors: list[Optional[BaseException]] = [None] * len(inputs)


def decode_key(args: Sequence[Any]) -> Optional[tuple]:
    """The batching key of a task's arguments (its span and dtype), or None if it must run alone."""
    if len(args) < 3 or not isinstance(args[0], torch.Tensor):
        return None
    hidden, _hypo_ids, infos, *prompts = args
    if hidden.ndim != 3 or hidden.shape[1] != 1 or not isinstance(infos, tuple) or not infos:
        return None
    if any(type(info) is not InferenceMetadata or info.active_adapter for info in infos):
        return None  # PrefixOp (a subclass) and adapters run alone
    if any(p is not None for p in prompts):
        return None
    return tuple(info.uid for info in infos), hidden.dtype


class BatchingTaskPool(PrioritizedTaskPool):
    """petals' ``PrioritizedTaskPool`` that hands the runtime groups of queued decode steps (see module doc)."""

    def __init__(self, process_func, *, max_batch: int = DEFAULT_MAX_BATCH, **kwargs):
        super().__init__(process_func, **kwargs)
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.max_batch = int(max_batch)
        self._groups: dict[int, tuple[list[Task], _Group]] = {}
        self._group_ids = itertools.count(-1, -1)  # negative: never a task uid
        self._deferred: set[int] = set()  # prefills that already let a decode batch go first
        # runtime-side counters, shared with the handler processes forked later (rpc_info reports them)
        self._counters = mp.Array(ctypes.c_int64, len(STAT_NAMES), lock=False)

    @property
    def stats(self) -> dict:
        """Steps run, steps that ran a group, tasks that ran in groups, largest group (in sequences)."""
        return dict(zip(STAT_NAMES, self._counters[:]))

    def _batchable(self, task: Task) -> Optional[tuple]:
        supports = getattr(self.process_func, "supports", None)
        key = decode_key(task.args)
        return key if key is not None and supports is not None and supports(key[0]) else None

    def _choose(self, first: Task, queued: list[Task]) -> list[Task]:
        """The tasks to run now: ``first`` alone, or a decode group (``first`` may then wait, once)."""
        if self.max_batch == 1:
            return [first]
        head_key = self._batchable(first)
        if head_key is None:
            args = first.args
            is_prefill = (len(args) >= 3 and decode_key(args) is None and isinstance(args[0], torch.Tensor)
                          and args[0].ndim == 3 and isinstance(args[2], tuple) and len(args[2]) > 0
                          and type(args[2][0]) is InferenceMetadata)
            if not is_prefill or first.uid in self._deferred:
                self._deferred.discard(first.uid)
                return [first]
            lead = next((t for t in queued if self._batchable(t) is not None), None)
            if lead is None:
                return [first]
            self._deferred.add(first.uid)
            first, head_key = lead, self._batchable(lead)
        group, rows = [first], int(first.args[0].shape[0])
        for task in queued:
            if task is first or self._batchable(task) != head_key:
                continue
            task_rows = int(task.args[0].shape[0])
            if rows + task_rows > self.max_batch:
                continue
            group.append(task)
            rows += task_rows
        return group

    def load_batch_to_runtime(self, timeout: Optional[float] = None, device: Optional[torch.device] = None):
        device = device if device is not None else self.device
        first = self._ordered_tasks.get(block=True, timeout=timeout)
        queued = []
        if self.max_batch > 1:
            with contextlib.suppress(queue.Empty):
                while True:
                    queued.append(self._ordered_tasks.get_nowait())
        chosen = self._choose(first, queued)
        taken = {id(t) for t in chosen}
        for task in [first, *queued]:
            if id(task) not in taken:
                self._ordered_tasks.put(task)
        for _ in chosen:
            self.batch_receiver.recv()  # one token per task in the pipe the runtime selects on
        if not self._ordered_tasks.empty():
            head: Task = self._ordered_tasks.queue[0]
            self.priority = (head.priority, head.time_submitted)
        self._counters[0] += 1
        inputs = [[_move_to_device_if_tensor(arg, device, share_memory=False) for arg in t.args] for t in chosen]
        if len(chosen) == 1 and (self.max_batch == 1 or self._batchable(chosen[0]) is None):
            self._dispatched_tasks[chosen[0].uid] = chosen[0]
            return chosen[0].uid, inputs[0]
        if len(chosen) > 1:
            self._counters[1] += 1
            self._counters[2] += len(chosen)
        self._counters[3] = max(self._counters[3], sum(int(t.args[0].shape[0]) for t in chosen))
        group_id, group = next(self._group_ids), _Group(inputs)
        self._groups[group_id] = (chosen, group)
        return group_id, [group]

    def send_outputs_from_runtime(self, uid: int, batch_outputs: list) -> None:
        if uid not in self._groups:
            return super().send_outputs_from_runtime(uid, batch_outputs)
        tasks, group = self._groups.pop(uid)
        for task, chunk, error in zip(tasks, batch_outputs[0].split(group.rows, dim=0), group.errors):
            if error is not None:
                task.future.set_exception(error)
            else:
                task.future.set_result([chunk.detach().to("cpu").clone().share_memory_()])

    def send_exception_from_runtime(self, uid: int, exception: BaseException) -> None:
        if uid not in self._groups:
            return super().send_exception_from_runtime(uid, exception)
        tasks, _group = self._groups.pop(uid)
        for task in tasks:
            task.future.set_exception(exception)


def _llama_layer(backend: TransformerBackend) -> Optional[LlamaDecoderLayer]:
    shards = getattr(backend.module, "module_shards", None)
    if shards is None or len(shards) != 1 or not isinstance(shards[0], LlamaDecoderLayer):
        return None
    layer = shards[0]
    return layer if getattr(layer.self_attn.config, "pretraining_tp", 1) == 1 else None


def _offset(backend: TransformerBackend, handles: tuple) -> int:
    """Positions a session skipped by loading a stored prefix (``PrefixBackend``), else 0."""
    return getattr(backend, "_offsets", {}).get(handles, 0)


@torch.inference_mode()
def batched_layer_step(layer: LlamaDecoderLayer, hidden: torch.Tensor, caches: Sequence[tuple],
                       positions: Sequence[int], rows: Sequence[int]) -> torch.Tensor:
    """One Llama decoder layer over one new token of several sessions.

    ``hidden`` is ``(N, 1, H)``: the sessions' rows stacked (session j owns ``rows[j]`` consecutive rows, its
    cache batch); ``caches[j]`` is its (keys ``(B, kv_heads, head_dim, L)``, values ``(B, kv_heads, L,
    head_dim)``) in petals' layout; ``positions[j]`` is where its new token goes (its cached length). Writes
    each session's new key/value at its position and returns the layer's output ``(N, 1, H)``.
    """
    attn = layer.self_attn
    n, heads, kv_heads, head_dim = hidden.shape[0], attn.num_heads, attn.num_key_value_heads, attn.head_dim
    groups = heads // kv_heads
    residual = hidden
    x = layer.input_layernorm(hidden)
    q = attn.q_proj(x).view(n, heads, head_dim)
    k = attn.k_proj(x).view(n, kv_heads, head_dim)
    v = attn.v_proj(x).view(n, kv_heads, head_dim)
    cos, sin = attn.rotary_emb(v, seq_len=max(positions) + 1)
    row_pos = torch.tensor([p for p, r in zip(positions, rows) for _ in range(r)], device=hidden.device)
    cos, sin = cos[0, 0][row_pos].unsqueeze(1), sin[0, 0][row_pos].unsqueeze(1)  # (N, 1, head_dim)
    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin
    out = torch.empty(n, heads, head_dim, dtype=hidden.dtype, device=hidden.device)
    scale = math.sqrt(head_dim)
    start = 0
    for (keys, values), pos, r in zip(caches, positions, rows):
        stop = start + r
        keys[:, :, :, pos] = k[start:stop]
        values[:, :, pos, :] = v[start:stop]
        q_j = q[start:stop].view(r, kv_heads, groups, head_dim)
        scores = torch.matmul(q_j, keys[:, :, :, : pos + 1]) / scale  # (r, kv_heads, groups, pos + 1)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out[start:stop] = torch.matmul(probs, values[:, :, : pos + 1]).view(r, heads, head_dim)
        start = stop
    hidden = residual + attn.o_proj(out.view(n, 1, heads * head_dim))
    return hidden + layer.mlp(layer.post_attention_layernorm(hidden))


class BatchedInferenceStep:
    """The merged pool's function: petals' ``_MergedInferenceStep`` for single tasks, a batched pass for groups."""

    def __init__(self, backends: dict):
        self.backends = backends
        self.merged = _MergedInferenceStep(backends)
        self._layers = {uid: _llama_layer(b) for uid, b in backends.items()}

    def supports(self, uids: Sequence[str]) -> bool:
        return all(self._layers.get(uid) is not None for uid in uids)

    @torch.inference_mode()
    def __call__(self, *args):
        if args and isinstance(args[0], _Group):
            return (self.run_group(args[0]),)
        return self.merged(*args)

    def _check(self, group: _Group, index: int) -> None:
        hidden, _hypo, infos, *_ = group.inputs[index]
        for info in infos:
            backend = self.backends[info.uid]
            pos = info.prefix_length + _offset(backend, info.cache_handles)
            with backend.memory_cache.use_cache(*info.cache_handles) as tensors:
                capacity = tensors[0].shape[-1]
                if tensors[0].shape[0] != hidden.shape[0]:
                    raise ValueError(f"batch {hidden.shape[0]} does not match the session's cache")
            if pos + 1 > capacity:
                raise ValueError(f"position {pos} exceeds the session's {capacity} KV slots")

    def run_group(self, group: _Group) -> torch.Tensor:
        """Run a group of decode tasks (same span) through its blocks; returns the stacked outputs."""
        live = []
        for i in range(len(group.inputs)):
            try:
                self._check(group, i)
                live.append(i)
            except Exception as exc:  # one bad session must not fail its batch mates
                group.errors[i] = exc
        outputs = torch.cat([group.inputs[i][0] for i in range(len(group.inputs))], dim=0)
        if not live:
            return outputs
        hidden = torch.cat([group.inputs[i][0] for i in live], dim=0)
        rows = [group.rows[i] for i in live]
        infos = [group.inputs[i][2] for i in live]
        hypo_ids = [group.inputs[i][1] for i in live]
        for block, uid in enumerate(info.uid for info in infos[0]):
            backend, layer = self.backends[uid], self._layers[uid]
            with contextlib.ExitStack() as stack:
                caches, positions = [], []
                for task_infos, hypo in zip(infos, hypo_ids):
                    info = task_infos[block]
                    tensors = stack.enter_context(backend.memory_cache.use_cache(*info.cache_handles))
                    backend._reorder_cache_inplace(tensors, hypo)
                    caches.append((tensors[0], tensors[1]))
                    positions.append(info.prefix_length + _offset(backend, info.cache_handles))
                hidden = batched_layer_step(layer, hidden, caches, positions, rows)
        offsets = list(itertools.accumulate([0, *group.rows]))
        start = 0
        for i, r in zip(live, rows):
            outputs[offsets[i]: offsets[i] + r] = hidden[start: start + r]
            start += r
        return outputs


def merge_inference_pools_batched(backends: dict, max_batch: int = DEFAULT_MAX_BATCH) -> None:
    """Like petals' ``merge_inference_pools_inplace``, with a :class:`BatchingTaskPool` as the merged pool."""
    assert backends and all(isinstance(b, TransformerBackend) for b in backends.values())
    first_pool = next(iter(backends.values())).inference_pool
    merged = BatchingTaskPool(BatchedInferenceStep(backends), max_batch=max_batch,
                              max_batch_size=first_pool.max_batch_size, device=first_pool.device,
                              name="merged_inference")
    for backend in backends.values():
        assert not backend.inference_pool.is_alive()
        backend.inference_pool = merged


def install(server_kwargs: dict) -> dict:
    """Install the batching pool for this server process (before ``Server.run()``).

    Pops ``max_batch`` (default :data:`DEFAULT_MAX_BATCH`) from ``server_kwargs`` and returns the kwargs for
    petals' ``Server``. ``max_batch=1`` leaves petals' pool and runtime untouched.
    """
    import functools

    import petals.server.backend as backend_module
    import petals.server.server as server_module

    kwargs = dict(server_kwargs)
    max_batch = kwargs.pop("max_batch", None)
    max_batch = DEFAULT_MAX_BATCH if max_batch is None else int(max_batch)
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    if max_batch == 1:
        server_module.merge_inference_pools_inplace = backend_module.merge_inference_pools_inplace
        return kwargs
    server_module.merge_inference_pools_inplace = functools.partial(merge_inference_pools_batched,
                                                                    max_batch=max_batch)
    kwargs["prefetch_batches"] = 0
    return kwargs
