"""petals' distributed model, opened and closed cleanly.

``open_distributed_model`` wraps ``AutoDistributedModelForCausalLM.from_pretrained`` for a private swarm
(explicit peers, DHT prefix, bounded retries) and tears down its DHT, p2p daemon and routing thread at the
end, so a client process exits without the event-loop tracebacks hivemind 1.1.12 prints otherwise.
"""
from __future__ import annotations

import contextlib
from typing import Iterator


def close_distributed_model(model, *, own_dht: bool = True) -> None:
    """Shut down the routing thread, p2p daemon and DHT of a petals distributed model (``own_dht=False``: a DHT
    the model was given, which its owner shuts down, is left running; only the model's replica of it closes)."""
    from hivemind.moe.client.remote_expert_worker import RemoteExpertWorker

    manager = model.model.layers.sequence_manager
    manager.shutdown()
    with contextlib.suppress(Exception):
        RemoteExpertWorker.run_coroutine(manager.state.p2p.shutdown(), return_future=True).result(timeout=10)
    if own_dht:
        with contextlib.suppress(Exception):
            manager.dht.shutdown()


def load_distributed_model(model_dir: str, *, initial_peers: list[str], dht_prefix: str, max_retries: int = 3,
                           dht=None, **config):
    """petals' ``AutoDistributedModelForCausalLM`` for ``model_dir`` on a private swarm (explicit peers, DHT prefix,
    bounded retries; ``config``: more of petals' client options, ``torch_dtype``).

    ``dht``: a running hivemind DHT of the swarm to find the servers through, instead of a client DHT of the model's
    own (a process and a libp2p daemon); :func:`close_distributed_model` with ``own_dht=False`` leaves it running.
    """
    from swarm.model.compat import petals
    from swarm.model.families import using_dht

    with using_dht(dht):
        return petals.AutoDistributedModelForCausalLM.from_pretrained(
            model_dir, initial_peers=list(initial_peers), dht_prefix=dht_prefix, max_retries=max_retries,
            show_route=False, **config)


@contextlib.contextmanager
def open_distributed_model(
    model_dir: str, *, initial_peers: list[str], dht_prefix: str, max_retries: int = 3, **config
) -> Iterator[object]:
    """A petals ``DistributedLlamaForCausalLM`` (or other family) on a private swarm, closed on exit."""
    model = load_distributed_model(model_dir, initial_peers=initial_peers, dht_prefix=dht_prefix,
                                   max_retries=max_retries, **config)
    try:
        yield model
    finally:
        close_distributed_model(model)
