"""Small helpers shared by the multi-process tests."""
import time


def wait_for(predicate, timeout=90.0, period=0.25, what="condition"):
    """Poll ``predicate`` until it returns something truthy (returned) or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(period)
    raise TimeoutError(f"timed out waiting for {what}")


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
