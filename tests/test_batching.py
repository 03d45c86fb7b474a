"""Batched decode steps (server/batching.py) on real SmolLM2 blocks: one batched pass equals sequential steps.

The blocks are petals' own (loaded and converted as a petals server does) behind ``PrefixBackend``; their KV
caches live in a real ``MemoryCache`` in this process, which is the runtime's side of it.
"""
from __future__ import annotations

import pytest
import torch

from swarm.model.compat import petals  # noqa: F401
from petals.data_structures import InferenceMetadata
from petals.utils.misc import DUMMY_INT64

from server.batch_profile import Session as _Session, load_backends
from server.batching import BatchedInferenceStep, BatchingTaskPool, decode_key
from server.prefix_cache import PrefixOp

BLOCKS = (0, 1, 2)


@pytest.fixture(scope="module")
def backends(smollm2_dir):
    built = load_backends(str(smollm2_dir), BLOCKS)
    yield built
    for backend in built.values():
        backend.shutdown()


def _step(step, session, hidden):
    (out,) = step(hidden, DUMMY_INT64, session.infos(), *([None] * len(session.handles)))
    session.length += hidden.shape[1]
    return out


def test_the_blocks_hold_the_checkpoint_weights_bound_to_their_layers(backends, smollm2_dir):
    """What the other tests compare runs on the real weights: every parameter left petals' meta initialisation
    and equals the checkpoint's tensor (petals' key-checking dummy load is a no-op; the real load follows)."""
    from swarm.model.block import DecoderBlock
    from swarm.model.local_model import load_state_dict

    for uid, backend in backends.items():
        index = int(uid.split(".")[1])
        block = backend.module.module_shards[0]
        assert isinstance(block, DecoderBlock) and block.layer_spec == block.spec.layer(index)
        saved = load_state_dict(smollm2_dir, f"model.layers.{index}.")
        params = dict(block.named_parameters())
        assert set(params) == set(saved)
        for name, param in params.items():
            assert param.device.type == "cpu" and torch.equal(param, saved[name].to(param.dtype)), name


def test_batched_decode_equals_sequential_steps(backends):
    """8 sessions with different prompt lengths: a batched decode pass gives the hidden states and KV caches
    of stepping each session on its own (petals' path), within float tolerance — several steps in a row."""
    from server.batching import _Group

    step = BatchedInferenceStep(backends)
    torch.manual_seed(0)
    lengths = [1, 3, 5, 8, 13, 2, 21, 7]
    ref = [_Session(backends) for _ in lengths]
    bat = [_Session(backends) for _ in lengths]
    for s_ref, s_bat, n in zip(ref, bat, lengths):
        prompt = torch.randn(1, n, 576)
        _step(step, s_ref, prompt.clone())
        _step(step, s_bat, prompt.clone())
    for _ in range(3):
        tokens = [torch.randn(1, 1, 576) for _ in lengths]
        expected = torch.cat([_step(step, s, t.clone()) for s, t in zip(ref, tokens)])
        group = _Group([[t.clone(), DUMMY_INT64, s.infos(), *([None] * len(BLOCKS))] for s, t in zip(bat, tokens)])
        (got,) = step(group)
        for s in bat:
            s.length += 1
        assert group.errors == [None] * len(lengths)
        got = got.view_as(expected)  # a batched pass answers flat token rows
        assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4), (got - expected).abs().max()
    for s_ref, s_bat in zip(ref, bat):
        for uid in backends:
            mc = backends[uid].memory_cache
            for h_ref, h_bat in zip(s_ref.handles[uid], s_bat.handles[uid]):
                a, b = mc._allocated_tensors[h_ref], mc._allocated_tensors[h_bat]
                assert torch.allclose(a, b, atol=1e-4), (uid, (a - b).abs().max())


def test_a_cohort_of_prefills_and_decodes_equals_petals_steps_through_the_pool(backends):
    """A multi-session stream's cohort: prefills of different lengths and decode steps of other sessions, in one
    task (one pass, causal within each prefill), give each session's hidden states and KV cache of petals'
    own step, session by session; the pool answers in the cohort's layout and counts the sessions."""
    from server.batching import Cohort

    step = BatchedInferenceStep(backends)
    pool = BatchingTaskPool(step, max_batch=8, max_batch_size=2048, name="cohort_pool")
    torch.manual_seed(2)
    decoding = [(_Session(backends), _Session(backends), n) for n in (4, 9)]
    for s_ref, s_bat, n in decoding:
        prompt = torch.randn(1, n, 576)
        _step(step, s_ref, prompt.clone())
        _step(step, s_bat, prompt.clone())
    prefilling = [(_Session(backends), _Session(backends), n) for n in (7, 1, 12)]
    entries = [(s_ref, s_bat, torch.randn(1, n, 576)) for s_ref, s_bat, n in prefilling]
    entries += [(s_ref, s_bat, torch.randn(1, 1, 576)) for s_ref, s_bat, _ in decoding]
    expected = [_step(step, s_ref, h.clone()) for s_ref, _, h in entries]
    hidden = torch.cat([h for _, _, h in entries], dim=1)
    pool.submit_task(hidden, Cohort([s.infos() for _, s, _ in entries], [h.shape[1] for _, _, h in entries]))
    task = pool.submitted_tasks.get()  # in one process, the queued copy's future is the one that gets the result
    pool._ordered_tasks.put(task)
    uid, batch = pool.load_batch_to_runtime()
    pool.send_outputs_from_runtime(uid, list(step(*batch)))
    (got,) = task.future.result(timeout=10)
    assert got.shape == hidden.shape
    for (_, s_bat, h), want, part in zip(entries, expected, got.split([h.shape[1] for _, _, h in entries], dim=1)):
        s_bat.length += h.shape[1]
        assert torch.allclose(part, want, atol=1e-4, rtol=1e-4), (part - want).abs().max()
    for s_ref, s_bat, _ in entries:
        for uid_ in backends:
            mc = backends[uid_].memory_cache
            for h_ref, h_bat in zip(s_ref.handles[uid_], s_bat.handles[uid_]):
                a, b = mc._allocated_tensors[h_ref], mc._allocated_tensors[h_bat]
                assert torch.allclose(a, b, atol=1e-4), (uid_, (a - b).abs().max())
    assert pool.stats["batched_tasks"] == 5 and pool.stats["largest_batch"] == 5


def test_batched_decode_honours_prefix_offsets_and_isolates_a_bad_session(backends):
    """A session that loaded a stored prefix steps at its offset position; one that ran out of KV slots fails
    alone while its batch mates get their results."""
    from server.batching import _Group

    step = BatchedInferenceStep(backends)
    torch.manual_seed(1)
    plain, offset, full = _Session(backends), _Session(backends), _Session(backends, max_length=4)
    prompt = torch.randn(1, 6, 576)
    _step(step, plain, prompt.clone())
    _step(step, offset, prompt[:, :2].clone())  # "stored prefix": the first 2 positions ...
    for uid, b in backends.items():  # ... then positions are offset as after a prefix load
        b._offsets[offset.handles[uid]] = 2
    offset.length = 0
    _step(step, offset, prompt[:, 2:].clone())
    _step(step, full, torch.randn(1, 4, 576))
    token = torch.randn(1, 1, 576)
    group = _Group([[token.clone(), DUMMY_INT64, s.infos(), *([None] * len(BLOCKS))] for s in (plain, offset, full)])
    (got,) = step(group)
    assert group.errors[0] is None and group.errors[1] is None
    assert isinstance(group.errors[2], ValueError)
    assert torch.allclose(got[0], got[1], atol=1e-4)
    expected = _step(step, plain, token.clone())
    assert torch.allclose(got[0], expected[0], atol=1e-4)
    for b in backends.values():
        b._offsets.clear()


def test_a_session_freed_while_its_step_is_queued_fails_no_batch_mate(backends, monkeypatch):
    """A handler frees a session's cache (it closed) while the session's step waits in a group: the pool removes
    its handles as the next lookup reads the handler's pipe. The pass uses the tensors taken at the check, so
    neither that session nor its batch mates fail (a CI run saw a whole cohort step fail with KeyError)."""
    from server.batching import _Group

    step = BatchedInferenceStep(backends)
    torch.manual_seed(2)
    closing, staying = _Session(backends), _Session(backends)
    _step(step, closing, torch.randn(1, 3, 576))
    _step(step, staying, torch.randn(1, 5, 576))
    freed: set = set()
    for backend in backends.values():
        def use_cache(*handles, original=backend.memory_cache.use_cache):
            if tuple(handles) in freed:  # what the pool's lookup does once the deletion has arrived
                raise KeyError(handles[0])
            return original(*handles)
        monkeypatch.setattr(backend.memory_cache, "use_cache", use_cache)
    checked = step._check

    def check(group, index):
        taken = checked(group, index)
        if index == len(group.inputs) - 1:  # every session checked: now the handler's deletion arrives
            freed.update(tuple(h) for h in closing.handles.values())
        return taken
    monkeypatch.setattr(step, "_check", check)
    token = torch.randn(1, 1, 576)
    group = _Group([[token.clone(), DUMMY_INT64, s.infos(), *([None] * len(BLOCKS))] for s in (closing, staying)])
    (got,) = step(group)
    assert group.errors == [None, None]
    freed.clear()
    expected = _step(step, staying, token.clone())
    assert torch.allclose(got[1], expected[0], atol=1e-4)


def test_pool_groups_queued_decodes_and_keeps_prefills_and_ops_apart(backends):
    """The pool takes what is queued: decode steps over the same span become one group (up to max_batch
    rows); a prefill lets one decode group go first, once; a PrefixOp and other spans never join a group."""
    step = BatchedInferenceStep(backends)
    pool = BatchingTaskPool(step, max_batch=3, max_batch_size=2048, name="test_pool")
    span = tuple(backends)
    sessions = [_Session(backends) for _ in range(5)]

    def submit(hidden, infos):
        pool.submit_task(hidden, DUMMY_INT64, infos, *([None] * len(infos)))
        pool._ordered_tasks.put(pool.submitted_tasks.get())  # what the pool's thread does

    submit(torch.randn(1, 4, 576), sessions[0].infos())  # a prefill first
    for s in sessions[1:]:
        submit(torch.randn(1, 1, 576), s.infos())  # four decodes over the whole span
    op = tuple(PrefixOp(uid, 0, h, None, op=("forget",)) for uid, h in sessions[0].handles.items())
    submit(torch.zeros(1, 1, 1), op)
    one_block = (InferenceMetadata(span[0], 0, sessions[1].handles[span[0]], None),)
    submit(torch.randn(1, 1, 576), one_block)

    sizes = []
    while not pool._ordered_tasks.empty():
        uid, batch = pool.load_batch_to_runtime()
        group = pool._groups.get(uid)
        sizes.append(len(group[0]) if group else ("prefill" if batch[0].shape[1] == 4 else "single"))
    # a group of 3, the prefill, the 4th decode (a group of one), the op alone, the one-block decode (its own span)
    assert sizes == [3, "prefill", 1, "single", 1]
    assert decode_key([torch.zeros(1, 1, 576), DUMMY_INT64, op, None]) is None
    assert pool.stats["batched_steps"] == 1 and pool.stats["batched_tasks"] == 3
