"""The swarm's DHT: the bootstrap peer every server and client joins.

(Chainswarm's own DHT records — server profiles and block assignments — are added here by the runtime.)
"""
from __future__ import annotations

import os


def bootstrap_dht_main(host: str, port: int, launcher_pid: int, report) -> None:
    """Child-process entry point: run a bootstrap hivemind DHT peer until SIGTERM.

    Sends ``("ready", [multiaddr, ...])`` through ``report`` once the peer listens.
    """
    from swarm.process import become_group_leader

    become_group_leader(launcher_pid)
    import hivemind

    dht = hivemind.DHT(start=True, host_maddrs=[f"/ip4/{host}/tcp/{port}"], client_mode=False)
    try:
        report.send(("ready", [str(addr) for addr in dht.get_visible_maddrs()]))
        while dht.is_alive():
            dht.join(1.0)
    finally:
        dht.shutdown()
        os._exit(0)
