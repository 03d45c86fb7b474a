"""The swarm's DHT: the bootstrap peer every server and client joins.

(Chainswarm's own DHT records — server profiles and block assignments — are added here by the runtime.)
"""
from __future__ import annotations

import os


def bootstrap_dht_main(host: str, port: int, launcher_pid: int, report, dht_prefix: str | None = None) -> None:
    """Child-process entry point: run a bootstrap hivemind DHT peer until SIGTERM.

    Sends ``("ready", [multiaddr, ...])`` through ``report`` once the peer listens. It runs the swarm's record
    validators (:mod:`swarm.trust.identity`: signatures, and Chainswarm's schemas under ``dht_prefix``), so it stores
    no forged control-plane record either.
    """
    from swarm.runtime.process import become_group_leader

    become_group_leader(launcher_pid)
    import hivemind

    from hivemind.dht.crypto import RSASignatureValidator

    from swarm.trust.identity import Identity
    from swarm.trust.validation import swarm_validators

    validators = (swarm_validators(Identity.generate(), dht_prefix) if dht_prefix is not None
                  else [RSASignatureValidator()])
    dht = hivemind.DHT(start=True, host_maddrs=[f"/ip4/{host}/tcp/{port}"], client_mode=False,
                       record_validators=validators)
    try:
        report.send(("ready", [str(addr) for addr in dht.get_visible_maddrs()]))
        while dht.is_alive():
            dht.join(1.0)
    finally:
        dht.shutdown()
        os._exit(0)
