"""A vanilla petals swarm on loopback: DHT + two servers (blocks split), greedy output == transformers."""
import os
import time

import psutil
import pytest
import torch

from server.local_swarm import LocalSwarm, SwarmStartError

pytestmark = pytest.mark.swarm


@pytest.fixture(scope="module")
def two_server_swarm(tiny_model):
    with LocalSwarm(tiny_model) as swarm:
        swarm.add_server((0, 2))
        swarm.add_server((2, 4))
        yield swarm


def test_two_server_swarm_matches_local_transformers(two_server_swarm, tiny_model, reference_generate):
    from transformers import AutoTokenizer

    from swarm.engine.petals_client import open_distributed_model

    swarm = two_server_swarm
    assert [(s.start, s.end) for s in swarm.servers] == [(0, 2), (2, 4)]
    assert len({s.peer_id for s in swarm.servers}) == 2
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    input_ids = tokenizer("A journey of a thousand miles", return_tensors="pt").input_ids
    expected = reference_generate(input_ids, 32)
    with open_distributed_model(tiny_model, initial_peers=swarm.initial_peers, dht_prefix=swarm.dht_prefix) as model:
        produced = model.generate(input_ids, max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert produced.shape == expected.shape == (1, input_ids.shape[1] + 32)
    assert torch.equal(produced, expected)


def test_stop_leaves_no_process_behind(tiny_model):
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    swarm = LocalSwarm(tiny_model)
    swarm.start_dht()
    swarm.add_server((0, 4), cache_tokens=1024)
    started = {p.pid for p in me.children(recursive=True)} - before
    assert len(started) >= 4  # DHT + its p2pd, server + its DHT/p2pd/handlers
    swarm.stop()
    left = [p for p in psutil.Process().children(recursive=True) if p.pid in started and p.is_running()
            and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, [p.cmdline() for p in left]


def test_a_server_that_cannot_start_reports_its_error(tiny_model, tmp_path):
    swarm = LocalSwarm(tmp_path / "no-such-model", dht_prefix="missing")
    try:
        swarm.start_dht()
        with pytest.raises(SwarmStartError, match="server0"):
            swarm.add_server((0, 2), timeout=60)
    finally:
        swarm.stop()


def _hang(launcher_pid):
    from swarm.runtime.process import become_group_leader

    become_group_leader(launcher_pid)
    time.sleep(600)


def _ready(report):
    report.send(("ready",))


def test_a_peer_that_never_comes_up_is_killed_and_the_next_one_starts_from_a_fresh_forkserver(tmp_path):
    """LocalSwarm gives up on a child that never reports: its process group is killed and the forkserver retired,
    so a wedged forkserver cannot fail every later start (two CI runs saw that cascade)."""
    from multiprocessing import forkserver

    from server.local_swarm import Peer, _await_report, _context

    ctx = _context()
    receive, send = ctx.Pipe(duplex=False)
    stuck = ctx.Process(target=_hang, args=(os.getpid(),), daemon=False)
    stuck.start()
    old_server = forkserver._forkserver._forkserver_pid
    with pytest.raises(SwarmStartError, match="was not ready after 2 s"):
        _await_report(Peer("stuck", stuck), receive, 2.0)
    stuck.join(10)
    assert not stuck.is_alive()
    receive, send = ctx.Pipe(duplex=False)
    fresh = ctx.Process(target=_ready, args=(send,))
    fresh.start()
    assert _await_report(Peer("fresh", fresh), receive, 60.0) == ("ready",)
    fresh.join(10)
    assert forkserver._forkserver._forkserver_pid != old_server
