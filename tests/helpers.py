"""Small helpers shared by the multi-process tests."""
import contextlib
import time

import httpx

# One SSL context for every client of the tests (HTTP below, and those they make of their own per headers, base URL
# or thread): each ``httpx.Client()`` builds one otherwise, 22 ms of CPU here (2026-11-30), and the queueing and
# fairness tests make one per request in a burst of dozens.
_SSL = httpx.create_ssl_context()


def http_client(**options) -> httpx.Client:
    """``httpx.Client(**options)`` sharing the tests' one SSL context."""
    return httpx.Client(verify=_SSL, **options)


# One client for the tests' plain requests. ``httpx.get``/``post``/``stream`` build a client, and with it an SSL
# context (certifi's bundle), on every call: ~60 ms of CPU each on this machine, paid again by every poll of a
# wait loop (two API modules made 143 such calls). Otherwise as those calls: httpx's default timeout (5 s) where a
# call names none; no keep-alive, so each request opens its own connection (a pooled connection could outlive an
# orchestrator the test restarts); no bound on concurrent connections (the overload tests send more requests at
# once than httpx's default pool of 100 would take).
HTTP = http_client(limits=httpx.Limits(max_connections=None, max_keepalive_connections=0))


def wait_for(predicate, timeout=90.0, period=0.25, what="condition", explain=None):
    """Poll ``predicate`` until it returns something truthy (returned) or ``timeout`` seconds pass; on a timeout
    the error carries ``explain()`` (what was missing), if given."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(period)
    raise TimeoutError(f"timed out waiting for {what}" + (f": {explain()}" if explain is not None else ""))


def describe_swarm(status: dict) -> str:
    """What an orchestrator's ``/v1/swarm`` status says, in one line, for a wait that timed out: the re-plan in
    progress, the queue, each chain (servers, ready, active), each server (node, state, suspect, banned, told KV
    slots, planned KV slots), the running sessions of each client (admin view) and the last events."""
    servers = [(s["node_id"], s.get("state"), "suspect" if s.get("suspect") else "",
                "banned" if s.get("banned") else "", (s.get("assignment") or {}).get("cache_slots"),
                (s.get("target") or {}).get("cache_slots")) for s in status.get("servers", [])]
    chains = [(c["servers"], c["ready"], c["active"]) for c in status.get("chains", [])]
    running = {c: v["running"] for c, v in status.get("clients", {}).items() if v.get("running")}
    return (f"transition {status.get('transition')}, queue {status.get('queue')}, chains {chains}, servers {servers}, "
            f"running by client {running}, events {status.get('events', [])[-8:]}")


def wait_idle(url: str, headers: dict, timeout: float, what: str) -> None:
    """Wait until the orchestrator at ``url`` has no active session on any chain and nothing queued (``headers``: an
    admin key's, for the queue); a timeout says what was left (:func:`describe_swarm`)."""
    last: dict = {}

    def idle():
        status = last["status"] = HTTP.get(f"{url}/v1/swarm", headers=headers, timeout=30).json()
        return all(c["active"] == 0 for c in status["chains"]) and not status["queue"]

    wait_for(idle, timeout, what=what, explain=lambda: describe_swarm(last.get("status", {})))


def server_info(p2p, peer_id: str, uid: str = "", timeout: float = 10.0) -> dict:
    """A server's petals ``rpc_info`` (with Chainswarm's counters), asked over ``p2p`` within ``timeout``."""
    import asyncio

    from hivemind import MSGPackSerializer
    from hivemind.moe.client.remote_expert_worker import RemoteExpertWorker
    from hivemind.p2p import PeerID
    from hivemind.proto import runtime_pb2

    info = RemoteExpertWorker.run_coroutine(asyncio.wait_for(p2p.call_protobuf_handler(
        PeerID.from_base58(peer_id), "TransformerConnectionHandler.rpc_info", runtime_pb2.ExpertUID(uid=uid),
        runtime_pb2.ExpertInfo), timeout))
    return MSGPackSerializer.loads(info.serialized_info)


@contextlib.contextmanager
def two_hop_tiny_swarm(tiny_model: str, cache_dir: str):
    """The tiny model split over two nodes, ``left`` and ``right`` (open sessions), with an orchestrator; yields the
    LocalSwarm with ``route``, its longest chain's ``(peer, start, end)`` spans."""
    from server.local_swarm import LocalSwarm

    with LocalSwarm(tiny_model, open_sessions=True) as local:
        # the memory budgets of tests/test_runtime.py's "left" and "right": the model split in two
        local.add_orchestrator(expected_rate=4.0, max_length=256, expected_input_tokens=128,
                               expected_output_tokens=28, refresh_s=0.5)
        declared = {"prefill_s": 1e-5, "decode_s": 3e-4, "rtt_s": 0.002}
        nodes = [local.add_node(node_id=name, memory_gb=0.0012, wait=False, profile_cache_dir=cache_dir,
                                declared_profile=declared) for name in ("left", "right")]
        for node in nodes:
            local.wait_profiled(node)
        chains = local.wait_chains_ready([n.name for n in nodes])["chains"]
        local.route = [tuple(r) for r in max(chains, key=lambda c: len(c["route"]))["route"]]
        yield local


@contextlib.contextmanager
def client_model(swarm, model_dir: str):
    """petals' client model of ``swarm`` (float32): its sequence manager reaches the servers, its head runs here."""
    import torch

    from swarm.engine.petals_client import open_distributed_model

    with open_distributed_model(model_dir, initial_peers=swarm.initial_peers, dht_prefix=swarm.dht_prefix,
                                torch_dtype=torch.float32) as model:
        yield model
