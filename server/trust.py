"""Which orchestrator a server obeys: the orchestrator key, given or pinned on first use.

A server believes assignments, the orchestrator record and session tickets only when they are signed by one
orchestrator key, chosen exactly as follows (:class:`OrchestratorTrust`):

* **Given** (``chainswarm server --orchestrator-key KEY``, ``ChainswarmServer(orchestrator_key=...)``; the
  ``ssh-rsa AAAA...`` text, its base64 body or a file holding it): pinned from the start, for the life of the
  process. At start the server reads the orchestrator records of the swarm; when there are some, but none
  signed by the given key appears within ``check_s`` seconds, it refuses to start with
  :class:`WrongOrchestratorKey` (one line naming both fingerprints). When there is no orchestrator record yet
  it starts and waits, believing only the given key.
* **Trust on first use** (no key given): the first time the server reads the orchestrator records and finds
  records of *exactly one* key, it pins that key for the life of the process (logged with its fingerprint);
  it is not written to disk, so a restarted server pins again. While records of several keys are present and
  none is pinned, nothing is pinned (an impostor racing the real orchestrator is not resolved by guessing),
  and the server keeps waiting. Until a key is pinned the server accepts no assignment and serves no session.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Optional

from swarm.trust import records
from swarm.trust.identity import Identity, fingerprint, parse_public_key
from swarm.trust.validation import swarm_validators

logger = logging.getLogger(__name__)


class WrongOrchestratorKey(ValueError):
    """The server was given a key that does not sign this swarm's orchestrator record."""


class OrchestratorTrust:
    def __init__(self, given: Optional[bytes]):
        self.given = given
        self._key = given
        self.source = "given" if given is not None else None
        self._lock = threading.Lock()
        self._ambiguous_logged = False

    @property
    def pinned(self) -> Optional[bytes]:
        return self._key

    def key(self, dht, dht_prefix: str) -> Optional[bytes]:
        """The pinned key; without one, one read of the orchestrator records (and a pin if exactly one key)."""
        if self._key is not None:
            return self._key
        try:
            claims = records.fetch_orchestrator_claims(dht, dht_prefix)
        except Exception as exc:
            logger.debug("could not read the orchestrator records: %s", exc)
            return None
        with self._lock:
            if self._key is None and len(claims) == 1:
                self._key, self.source = next(iter(claims)), "first use"
                logger.info("pinned the orchestrator key %s on first use", fingerprint(self._key))
            elif self._key is None and len(claims) > 1 and not self._ambiguous_logged:
                self._ambiguous_logged = True
                logger.warning("%d keys publish an orchestrator record (%s); pinning none until one remains "
                               "(pass --orchestrator-key)", len(claims), ", ".join(fingerprint(k) for k in claims))
        return self._key

    def check_at_start(self, dht, dht_prefix: str, check_s: float = 3.0, poll_s: float = 0.25) -> None:
        """With a given key: refuse to start when the swarm's orchestrator records are all under other keys."""
        if self.given is None:
            return
        deadline = time.monotonic() + check_s
        while True:
            try:
                claims = records.fetch_orchestrator_claims(dht, dht_prefix)
            except Exception:
                claims = {}
            if not claims or self.given in claims:
                return  # no orchestrator yet (the server waits for it), or the right one
            if time.monotonic() >= deadline:
                raise WrongOrchestratorKey(
                    f"wrong orchestrator key: this server was given {fingerprint(self.given)}, but the swarm's "
                    f"orchestrator record is signed by {', '.join(fingerprint(k) for k in claims)} "
                    f"(see orchestrator_key in GET /v1/swarm)")
            time.sleep(poll_s)


def identity_and_trust(server_kwargs: dict, identity_key: Optional[str],
                       orchestrator_key: Optional[str | bytes]) -> tuple[Identity, OrchestratorTrust]:
    """A node's signing identity and its orchestrator trust; installs the record validators in the petals
    ``Server`` kwargs (they reach its DHT at construction) when the DHT prefix is already known."""
    identity = Identity.load_or_create(identity_key) if identity_key else Identity.generate()
    given = parse_public_key(orchestrator_key) if orchestrator_key else None
    if server_kwargs.get("dht_prefix"):
        server_kwargs["record_validators"] = swarm_validators(identity, server_kwargs["dht_prefix"])
    return identity, OrchestratorTrust(given)
