"""Accelerator emulation (server.emulation): fast and slow "GPUs" on a CPU box.

Unit checks of the step-time model and its parsing, then one real petals server (4 blocks) with an emulated
accelerator: a decode step takes at least 4 × decode time, a prefill step 4 × tokens × prefill time,
concurrent sessions overlap instead of queueing behind each other, the server announces the emulated speed
to petals' routing, and the output is still exactly transformers'. An orchestrated node reports the emulated
time in its profile.
"""
import threading
import time

import pytest
import torch

from server.emulation import EmulatedCompute

DECODE_S, PREFILL_S = 0.025, 0.004
BLOCKS = 4  # tiny_model


def test_step_time_model():
    emulated = EmulatedCompute(prefill_s=0.002, decode_s=0.01)
    assert emulated.step_delay(blocks=4, tokens=1) == pytest.approx(0.04)
    assert emulated.step_delay(blocks=4, tokens=10) == pytest.approx(0.08)
    assert emulated.step_delay(blocks=0, tokens=5) == 0.0 and emulated.step_delay(blocks=3, tokens=0) == 0.0
    assert EmulatedCompute.parse("2.5, 10") == EmulatedCompute(0.0025, 0.01)
    assert EmulatedCompute.from_dict(emulated.to_dict()) == emulated


@pytest.mark.parametrize("bad", ["", "1", "1,2,3", "a,b", "-1,2", "1,inf"])
def test_bad_emulation_settings_are_refused(bad):
    with pytest.raises(ValueError):
        EmulatedCompute.parse(bad)


def test_emulation_needs_both_times():
    with pytest.raises(ValueError, match="prefill_s and decode_s"):
        EmulatedCompute.from_dict({"decode_s": 0.1})
    with pytest.raises(ValueError, match="prefill_s and decode_s"):
        EmulatedCompute.from_dict({"prefill_s": 0.1, "decode_s": 0.1, "speed": 2})


@pytest.fixture(scope="module")
def emulated_server(tiny_model):
    from server.local_swarm import LocalSwarm
    from swarm.engine.petals_client import open_distributed_model

    with LocalSwarm(tiny_model) as swarm:
        swarm.add_server((0, BLOCKS), max_length=128, num_handlers=2,
                         emulated_compute={"prefill_s": PREFILL_S, "decode_s": DECODE_S})
        with open_distributed_model(tiny_model, initial_peers=swarm.initial_peers,
                                    dht_prefix=swarm.dht_prefix) as model:
            yield swarm, model


def _step_times(model, prompt_tokens: int, decode_steps: int, hidden: int) -> tuple[float, list[float]]:
    with model.transformer.h.inference_session(max_length=64) as session:
        started = time.perf_counter()
        session.step(torch.randn(1, prompt_tokens, hidden))
        prefill = time.perf_counter() - started
        decode = []
        for _ in range(decode_steps):
            started = time.perf_counter()
            session.step(torch.randn(1, 1, hidden))
            decode.append(time.perf_counter() - started)
    return prefill, decode


@pytest.mark.swarm
def test_steps_take_the_emulated_time(emulated_server):
    _, model = emulated_server
    hidden = model.config.hidden_size
    prefill, decode = _step_times(model, prompt_tokens=12, decode_steps=6, hidden=hidden)
    assert prefill >= BLOCKS * 12 * PREFILL_S
    assert min(decode) >= BLOCKS * DECODE_S
    # the CPU part of a step on this tiny model is a few ms: the emulated 100 ms dominates
    assert sorted(decode)[len(decode) // 2] < BLOCKS * DECODE_S + 0.08


@pytest.mark.swarm
def test_concurrent_sessions_overlap(emulated_server):
    _, model = emulated_server
    hidden = model.config.hidden_size
    steps = 8
    _step_times(model, 2, 1, hidden)  # warm the route
    started = time.perf_counter()
    _step_times(model, 2, steps, hidden)
    alone = time.perf_counter() - started

    errors = []

    def run():
        try:
            _step_times(model, 2, steps, hidden)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(2)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    together = time.perf_counter() - started
    assert not errors
    # queued one after the other, two sessions would take 2 x alone; overlapping, about 1 x
    assert together < 1.5 * alone, (together, alone)


@pytest.mark.swarm
def test_server_announces_the_emulated_speed(emulated_server):
    _, model = emulated_server
    manager = model.transformer.h.sequence_manager
    manager.update(wait=True)
    infos = [span.server_info for span in manager.state.sequence_info.spans_by_priority]
    assert infos and all(info.inference_rps == pytest.approx(1 / DECODE_S) for info in infos)
    assert all(info.throughput == pytest.approx(1 / DECODE_S) for info in infos)


@pytest.mark.swarm
def test_emulated_server_generates_like_transformers(emulated_server, tiny_model, reference_generate):
    from transformers import AutoTokenizer

    _, model = emulated_server
    ids = AutoTokenizer.from_pretrained(tiny_model)("an emulated accelerator", return_tensors="pt")["input_ids"]
    expected = reference_generate(ids, max_new_tokens=6)
    assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False), expected)


@pytest.mark.swarm
def test_node_profile_adds_the_emulated_time(tiny_model, tmp_path):
    from server.local_swarm import LocalSwarm

    with LocalSwarm(tiny_model) as swarm:
        swarm.start_dht()
        node = swarm.add_node(node_id="gpu", memory_gb=0.01, profile_cache_dir=str(tmp_path),
                              declared_profile={"prefill_s": 0.001, "decode_s": 0.002},
                              emulated_compute={"prefill_s": 0.003, "decode_s": 0.02})
        profile = node.info["profile"]
    assert profile["prefill_s"] == pytest.approx(0.004) and profile["decode_s"] == pytest.approx(0.022)
