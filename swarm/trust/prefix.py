"""Prompt-prefix reuse: the wire protocol and the eviction-report record (no torch, no petals).

Protocol (petals-integration spec §6.2.3, issue 7):

1. **Hashes.** A prompt is cut into pages of :data:`PAGE_TOKENS` tokens; page k is keyed by the hash chain
   ``h_k = blake2b(h_{k-1} || tokens of page k)`` (:func:`planner.prefix_index.page_hashes`). The chain
   starts at a *namespace root*: the orchestrator derives its root from a secret it never shares
   (:func:`namespace_root`), so only the orchestrator — which hashes the token ids it tokenized itself —
   can name pages in its namespace. A client that sends hashes that do not match its tokens can only name
   pages in some other namespace: it misses (and can poison nothing the orchestrator's sessions read).
   Only hashes travel, never text or token ids.
2. **Probe.** Before the first step, the client asks every server of its route, in parallel, how many
   leading pages of the prompt it holds for the requested blocks (``rpc_prefix_probe``, unary). The server
   answers and pins those pages for a few seconds. The chain reuses the *minimum* over its servers,
   ``m = page · min_s h_s`` capped so that at least one position is computed (all-or-nothing per chain).
3. **Open.** The opening metadata of every span carries ``cs_prefix = {page, hashes, load}``. The server
   copies the first ``load`` pages into the session's KV cache (or fails the session if it no longer holds
   them — the client then restarts from the full tokens), and offsets every later step's positions by
   ``load · page``. The client sends hidden states only for positions ``[m, len)``.
4. **Insert.** After the first step the server stores the new full pages the session computed, keyed by
   ``hashes``. LRU within the planned prefix budget; evictions are published in the ``_cs.prefix`` DHT
   record (:func:`publish_report`), which the orchestrator's radix index follows.
"""
from __future__ import annotations

import hashlib
from typing import Any, Mapping, Sequence

from planner.prefix_index import ROOT_HASH, page_hashes

PAGE_TOKENS = 16  # tokens per prefix page; servers and orchestrator must agree (§14.6 default)
META_KEY = "cs_prefix"  # opening-metadata key of the session protocol
PROBE_RPC = "TransformerConnectionHandler.rpc_prefix_probe"
MISSING_MESSAGE = "chainswarm prefix pages missing"  # in the error of a session whose pages were evicted
REPORTS = "_cs.prefix"  # DHT key (under the model prefix): subkey node id -> report dict
MAX_HASHES = 4096  # pages per request a server accepts (64k tokens at 16/page)


def namespace_root(secret: bytes | str, model: str = "") -> bytes:
    """The hash-chain root of a namespace: only who knows ``secret`` can compute its page hashes."""
    if isinstance(secret, str):
        secret = secret.encode()
    return hashlib.blake2b(ROOT_HASH + model.encode(), key=secret[:64], digest_size=16).digest()


def prompt_hashes(token_ids: Sequence[int], root: bytes, page_tokens: int = PAGE_TOKENS) -> list[bytes]:
    """Page hashes of the full pages of ``token_ids`` in the namespace ``root``."""
    return page_hashes(list(token_ids), page_tokens, root=root)


def reusable_pages(held_pages: Sequence[int], prompt_tokens: int, page_tokens: int = PAGE_TOKENS) -> int:
    """Pages a chain can reuse: the minimum over its servers, keeping at least one position to compute."""
    if not held_pages or prompt_tokens < 2:
        return 0
    return max(0, min(min(held_pages), (prompt_tokens - 1) // page_tokens))


def check_hashes(hashes: Any) -> list[bytes]:
    """Validate page hashes received on the wire (list of 16-byte strings)."""
    if not isinstance(hashes, (list, tuple)) or len(hashes) > MAX_HASHES:
        raise ValueError("prefix hashes must be a list of at most %d entries" % MAX_HASHES)
    out = []
    for h in hashes:
        if not isinstance(h, (bytes, bytearray)) or len(h) != 16:
            raise ValueError("every prefix hash must be 16 bytes")
        out.append(bytes(h))
    return out


def session_spec(hashes: Sequence[bytes], load: int) -> dict:
    """A session's prefix spec as it travels (petals' opening metadata under :data:`META_KEY`, a multi-session
    open): its prompt's full-page ``hashes``, the first ``load`` of which the server copies into its cache."""
    return {"page": PAGE_TOKENS, "hashes": list(hashes), "load": int(load)}


def parse_session_spec(spec: Any) -> tuple[list[bytes], int]:
    """(hashes, load) of a received :func:`session_spec`; ``ValueError`` if malformed."""
    if not isinstance(spec, dict) or spec.get("page") != PAGE_TOKENS:
        raise ValueError(f"{META_KEY} must be a dict with page={PAGE_TOKENS}")
    hashes = check_hashes(spec.get("hashes", []))
    load = spec.get("load", 0)
    if not isinstance(load, int) or isinstance(load, bool) or not 0 <= load <= len(hashes):
        raise ValueError(f"{META_KEY}.load must be an int in [0, {len(hashes)}]")
    return hashes, load


# -- eviction reports (server -> orchestrator, through the DHT) -------------------------------------------


def valid_report(value: Any) -> bool:
    return (isinstance(value, dict) and isinstance(value.get("epoch"), str) and isinstance(value.get("seq"), int)
            and isinstance(value.get("evicted", []), (list, tuple)))


def publish_report(dht, prefix: str, node_id: str, report: Mapping[str, Any], ttl: float, owner: bytes) -> bool:
    """Publish ``node_id``'s report signed by ``owner`` (the node's key; swarm.trust.identity)."""
    from hivemind.utils.timed_storage import get_dht_time

    from swarm.trust.identity import owned_subkey

    return bool(dht.store(f"{prefix}.{REPORTS}", dict(report), expiration_time=get_dht_time() + ttl,
                          subkey=owned_subkey(node_id, owner)))


def fetch_reports(dht, prefix: str, owners: Mapping[str, bytes]) -> dict[str, dict]:
    """{node id: report} for well-formed reports signed by the key ``owners`` pins for their node id (a report
    in another key's name, or for a node id nobody pinned, is ignored)."""
    from swarm.trust.identity import fetch_owned

    out = {}
    for node, owner, value, _ in fetch_owned(dht, f"{prefix}.{REPORTS}"):
        if owners.get(node) == owner and valid_report(value):
            out[node] = value
    return out
