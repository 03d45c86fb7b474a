"""Batched inference steps: decode steps of several sessions over the same span in one forward pass.

petals 2.2 runs every inference step of every session as its own task: its ``PrioritizedTaskPool`` hands the
runtime one task at a time. Here the server's merged inference pool is a :class:`BatchingTaskPool`: when the
runtime asks for work it takes *what is queued right now* (no waiting for company) and, if the oldest task
is a one-token decode step, groups it with the other queued decode steps over the same span — up to
``max_batch`` sequences. :class:`BatchedInferenceStep` runs such a group as one pass per block through the
block's own ragged step (:meth:`swarm.model.block.DecoderBlock.step`, the same code petals' single-session
path runs): norms, projections and the MLP over all sequences at once, RoPE at each sequence's own positions,
attention per session over its own cache. Everything else — prefix-store operations (:class:`PrefixOp`), deep
prompts, adapters, sharded blocks — runs exactly as petals runs it. A lone decode step runs the batched
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
import multiprocessing as mp
import queue
from typing import Any, Optional, Sequence

import torch

from swarm.model.compat import petals  # noqa: F401  (the shim must precede petals.server)
from petals.data_structures import InferenceMetadata
from petals.server.backend import TransformerBackend, _MergedInferenceStep
from petals.server.task_pool import PrioritizedTaskPool, Task, _move_to_device_if_tensor
from petals.utils.misc import DUMMY_INT64
from server.ends import ChainEnds, HeadTask, load_for_span, span_ends
from server.kv_pool import receive, step_tensors
from swarm.model.block import DecoderBlock, Segment, token_positions
from swarm.model.families import install_server_hooks

logger = logging.getLogger(__name__)

DEFAULT_MAX_BATCH = 16  # the orchestrator batches up to --batch-sessions 16 sessions of a chain per step
STAT_NAMES = ("steps", "batched_steps", "batched_tasks", "largest_batch")


def pool_stats(pool: Any) -> Optional[dict]:
    """A backend's inference-pool batching counters (any process of the server), or None without batching."""
    return dict(pool.stats, max_batch=pool.max_batch) if isinstance(pool, BatchingTaskPool) else None


class Cohort:
    """A task argument: steps of several batch-1 sessions over the same span, submitted as one task
    (``submit_task(hidden (1, T, H), Cohort(infos, lengths))``) by a multi-session stream
    (:mod:`server.multi_session`): session i's ``lengths[i]`` new tokens (one for a decode step, more for a
    prefill) are the next ``lengths[i]`` positions of ``hidden``, ``infos[i]`` its per-block ``InferenceMetadata``.
    The pool runs it as one group (with other queued decode steps of the span, up to ``max_batch`` sessions) and
    answers with the outputs in the same layout."""

    __slots__ = ("infos", "lengths")

    def __init__(self, infos: Sequence[tuple], lengths: Sequence[int]):
        self.infos = tuple(tuple(i) for i in infos)
        self.lengths = tuple(int(n) for n in lengths)

    def __getstate__(self):
        return self.infos, self.lengths

    def __setstate__(self, state):
        self.infos, self.lengths = state


def _entries(args: list) -> list:
    """A task's inputs as group entries ``[hidden (B, t, H), hypo_ids, infos, *prompts]``: one, or one per
    cohort session."""
    if len(args) == 2 and isinstance(args[1], Cohort):
        ends = list(itertools.accumulate(args[1].lengths))
        return [[args[0][:, end - n: end], DUMMY_INT64, infos]
                for infos, n, end in zip(args[1].infos, args[1].lengths, ends)]
    return [args]


def _sequences(task: Task) -> int:
    """Sequences a task steps: a cohort's sessions, else the rows of its hidden states."""
    return len(task.args[1].infos) if isinstance(task.args[-1], Cohort) else int(task.args[0].shape[0])


class _Group:
    """Several tasks' inputs, run as one batched step; ``errors[i]`` is entry i's own failure.

    A plain task (a decode step) is one entry; a :class:`Cohort` task is one entry per session (``counts[t]``
    entries of task t). Entry i has ``shapes[i] = (B, t)``: B sequences of t new tokens."""

    __slots__ = ("inputs", "shapes", "errors", "counts")

    def __init__(self, task_args: list):
        per_task = [_entries(args) for args in task_args]
        self.counts = [len(entries) for entries in per_task]
        self.inputs = [entry for entries in per_task for entry in entries]
        self.shapes = [tuple(int(d) for d in args[0].shape[:2]) for args in self.inputs]
        self.errors: list[Optional[BaseException]] = [None] * len(self.inputs)

    @property
    def sizes(self) -> list[int]:
        """Token rows of each entry in the flat (tokens, H) layout of a batched pass."""
        return [b * t for b, t in self.shapes]


def decode_key(args: Sequence[Any]) -> Optional[tuple]:
    """The batching key of a task's arguments (its span and dtype), or None if it must run alone."""
    if len(args) == 2 and isinstance(args[1], Cohort) and isinstance(args[0], torch.Tensor):
        infos, lengths = args[1].infos, args[1].lengths
        if (not infos or len(lengths) != len(infos) or min(lengths) < 1 or args[0].ndim != 3
                or tuple(args[0].shape[:2]) != (1, sum(lengths))):
            return None
        spans = {_plain_span(i) for i in infos}
        return (spans.pop(), args[0].dtype) if len(spans) == 1 and None not in spans else None
    if len(args) < 3 or not isinstance(args[0], torch.Tensor):
        return None
    hidden, _hypo_ids, infos, *prompts = args
    if hidden.ndim != 3 or hidden.shape[1] != 1 or not isinstance(infos, tuple) or not infos:
        return None
    span = _plain_span(infos)
    if span is None or any(p is not None for p in prompts):
        return None
    return span, hidden.dtype


def _plain_span(infos: Sequence[Any]) -> Optional[tuple]:
    """The block uids of one session's step metadata, or None unless every entry is a plain inference step
    (a ``PrefixOp`` — a subclass — and adapters run alone)."""
    if any(type(info) is not InferenceMetadata or info.active_adapter for info in infos):
        return None
    return tuple(info.uid for info in infos)


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
        """Steps run, steps that ran a group, session steps that ran in groups, largest group (in sequences)."""
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
        group, rows = [first], _sequences(first)
        for task in queued:
            if task is first or self._batchable(task) != head_key:
                continue
            task_rows = _sequences(task)
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
        cohort = isinstance(chosen[0].args[-1], Cohort)
        if len(chosen) == 1 and not cohort and (self.max_batch == 1 or self._batchable(chosen[0]) is None):
            self._dispatched_tasks[chosen[0].uid] = chosen[0]
            return chosen[0].uid, inputs[0]
        group_id, group = next(self._group_ids), _Group(inputs)
        if len(group.inputs) > 1:  # a cohort's sessions count one by one, as separately submitted steps do
            self._counters[1] += 1
            self._counters[2] += len(group.inputs)
        self._counters[3] = max(self._counters[3], sum(b for b, _ in group.shapes))
        self._groups[group_id] = (chosen, group)
        return group_id, [group]

    def send_outputs_from_runtime(self, uid: int, batch_outputs: list) -> None:
        if uid not in self._groups:
            return super().send_outputs_from_runtime(uid, batch_outputs)
        tasks, group = self._groups.pop(uid)
        chunks = [c.view(b, t, -1) for c, (b, t) in zip(batch_outputs[0].split(group.sizes, dim=0), group.shapes)]
        first = 0
        for task, count in zip(tasks, group.counts):
            errors = [e for e in group.errors[first: first + count] if e is not None]
            if errors:
                task.future.set_exception(errors[0])
            else:
                out = torch.cat(chunks[first: first + count], dim=1) if count > 1 else chunks[first]
                task.future.set_result([out.detach().to("cpu").clone().share_memory_()])
            first += count

    def send_exception_from_runtime(self, uid: int, exception: BaseException) -> None:
        if uid not in self._groups:
            return super().send_exception_from_runtime(uid, exception)
        tasks, _group = self._groups.pop(uid)
        for task in tasks:
            task.future.set_exception(exception)


def _block(backend: TransformerBackend) -> Optional[DecoderBlock]:
    """The backend's block when it can run in a batched pass (Chainswarm's block code, one shard)."""
    shards = getattr(backend.module, "module_shards", None)
    if shards is None or len(shards) != 1 or not isinstance(shards[0], DecoderBlock):
        return None
    return shards[0]


def _offset(backend: TransformerBackend, handles: tuple) -> int:
    """Positions a session skipped by loading a stored prefix (``PrefixBackend``), else 0."""
    return getattr(backend, "_offsets", {}).get(handles, 0)


class BatchedInferenceStep:
    """The merged pool's function: petals' ``_MergedInferenceStep`` for single tasks, a batched pass for groups."""

    def __init__(self, backends: dict, ends: Optional[ChainEnds] = None):
        self.backends = backends
        self.merged = _MergedInferenceStep(backends)
        self._layers = {uid: _block(b) for uid, b in backends.items()}
        self.ends = ends  # the chain's embeddings and/or head, when this span holds block 0 or the last block

    def supports(self, uids: Sequence[str]) -> bool:
        return all(self._layers.get(uid) is not None for uid in uids)

    @torch.inference_mode()
    def __call__(self, *args):
        if args and isinstance(args[0], _Group):
            return (self.run_group(args[0]),)
        if len(args) == 2 and isinstance(args[1], HeadTask):
            if self.ends is None or self.ends.head is None:
                raise ValueError("this span holds no LM head")
            return args[1].run(self.ends, args[0])
        return self.merged(*args)

    def _check(self, group: _Group, index: int) -> list[tuple]:
        """Fit the session's KV to this step and check it; its cache tensors per block, taken now. The pool's
        pipe was read once at the start of the pass (:func:`server.kv_pool.receive`): a session freed before
        that (it closed while this step was queued) fails here alone; one freed later loses its handles at the
        next pass, and the tensors taken here stay valid for this one (a CI run once saw a cohort step fail with
        ``KeyError`` on a handle freed between the check and the pass, when every lookup read the pipe)."""
        hidden, _hypo, infos, *_ = group.inputs[index]
        b, t = group.shapes[index]
        taken = []
        for info in infos:
            backend = self.backends[info.uid]
            if self._layers.get(info.uid) is None:
                raise ValueError(f"block {info.uid} cannot run in a batched pass")
            pos = info.prefix_length + _offset(backend, info.cache_handles)
            tensors = step_tensors(backend.memory_cache, info.cache_handles, pos + t)
            capacity = tensors[0].shape[-1]
            if tensors[0].shape[0] != b:
                raise ValueError(f"batch {b} does not match the session's cache")
            if pos + t > capacity:
                raise ValueError(f"positions {pos}..{pos + t - 1} exceed the session's {capacity} KV slots")
            taken.append(tensors)
        return taken

    def run_group(self, group: _Group) -> torch.Tensor:
        """Run a group (same span) through its blocks; returns every entry's outputs as flat token rows."""
        live, caches = [], {}
        receive(self.backends[info.uid].memory_cache for info in group.inputs[0][2])  # the pipe, once per pass
        for i in range(len(group.inputs)):
            try:
                caches[i] = self._check(group, i)
                live.append(i)
            except Exception as exc:  # one bad session must not fail its batch mates
                group.errors[i] = exc
        flat = [args[0].reshape(-1, args[0].shape[-1]) for args in group.inputs]
        outputs = torch.cat(flat, dim=0)
        if not live:
            return outputs
        hidden = torch.cat([flat[i] for i in live], dim=0)
        infos = [group.inputs[i][2] for i in live]
        hypo_ids = [group.inputs[i][1] for i in live]
        token_pos = None  # the same for every block of the span (offsets are per session, not per block)
        for block, uid in enumerate(info.uid for info in infos[0]):
            backend, layer = self.backends[uid], self._layers[uid]
            segments = []
            for i, task_infos, hypo in zip(live, infos, hypo_ids):
                info, tensors = task_infos[block], caches[i][block]
                backend._reorder_cache_inplace(tensors, hypo)
                segments.append(Segment(tensors[0], tensors[1], info.prefix_length
                                        + _offset(backend, info.cache_handles), *group.shapes[i]))
            if token_pos is None:  # on the device once for the span (a copy per block would wait for each)
                token_pos = token_positions(segments).to(hidden.device, non_blocking=True)
            hidden = layer.step(hidden, segments, token_pos)
        offsets = list(itertools.accumulate([0, *group.sizes]))
        start = 0
        for i in live:
            size = group.sizes[i]
            outputs[offsets[i]: offsets[i] + size] = hidden[start: start + size]
            start += size
        return outputs


_ends_missing = False  # the span loaded last needed the chain's ends and could not load them (this process)


def ends_ready() -> bool:
    """Whether this server holds the chain's ends its current span needs (True before a span is loaded: it will
    load them). Its profile says so (``ends``): the orchestrator sends token ids only to servers that do."""
    return not _ends_missing


def merge_inference_pools_batched(backends: dict, max_batch: int = DEFAULT_MAX_BATCH,
                                  model_dir: Optional[str] = None) -> None:
    """Like petals' ``merge_inference_pools_inplace``, with a :class:`BatchingTaskPool` as the merged pool; the
    chain's ends (:mod:`server.ends`) are loaded beside the blocks when the span holds block 0 or the last one."""
    assert backends and all(isinstance(b, TransformerBackend) for b in backends.values())
    first = next(iter(backends.values()))
    first_pool = first.inference_pool
    device = next(iter(first.module.parameters())).device
    global _ends_missing
    layers = int(first.config.num_hidden_layers)
    ends = load_for_span(model_dir, list(backends), layers, first.dtype, device)
    _ends_missing = ends is None and model_dir is not None and any(span_ends(backends, layers))
    merged = BatchingTaskPool(BatchedInferenceStep(backends, ends), max_batch=max_batch,
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

    install_server_hooks()  # blocks bound to their layers, KV at the real head_dim
    kwargs = dict(server_kwargs)
    max_batch = kwargs.pop("max_batch", None)
    max_batch = DEFAULT_MAX_BATCH if max_batch is None else int(max_batch)
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    if max_batch == 1:
        server_module.merge_inference_pools_inplace = backend_module.merge_inference_pools_inplace
        return kwargs
    server_module.merge_inference_pools_inplace = functools.partial(
        merge_inference_pools_batched, max_batch=max_batch, model_dir=kwargs.get("converted_model_name_or_path"))
    kwargs["prefetch_batches"] = 0
    return kwargs
