"""The orchestrator's view of prompt-prefix reuse: which server holds which prompt pages.

:class:`PrefixView` owns the radix index over page hashes (:class:`planner.prefix_index.PrefixIndex`, one
holder per server, each with the prefix store's page budget), the chain matcher the fairness scheduler asks for
m_k(r) (a chain reuses what *all* its servers hold), the hit statistics and the bookkeeping of the servers'
eviction reports (:mod:`swarm.trust.prefix`). The index is optimistic: a dispatched request's pages count as held on
every server of its chain at once (§14.4); the servers' eviction reports correct it later. Pure bookkeeping,
no I/O: the orchestrator fetches the reports and calls :meth:`apply_reports`.
"""
from __future__ import annotations

import contextlib
from typing import Any, Sequence

from planner.prefix_index import ChainPrefixMatcher, PrefixIndex
from swarm.trust import prefix as prefix_protocol
from swarm.control.planning import RoutableChain


class PrefixView:
    def __init__(self, cache_tokens_per_block: int, secret: bytes, dht_prefix: str):
        self.cache_tokens_per_block = cache_tokens_per_block
        self.enabled = cache_tokens_per_block > 0
        self.index = PrefixIndex(prefix_protocol.PAGE_TOKENS)
        self.matcher = ChainPrefixMatcher(self.index, {})
        self.root = prefix_protocol.namespace_root(secret, dht_prefix)
        self.stats = dict(requests=0, hits=0, prompt_tokens=0, reused_tokens=0, expected_tokens=0,
                          stale=0, evictions_applied=0, resets=0)
        self._report_state: dict[str, tuple[str, int]] = {}  # node -> (store epoch, last eviction seq applied)
        self.reset_log: list[tuple[str, str]] = []  # (node, why) of the holders forgotten since last drained
        self._epochs: dict[str, str] = {}  # node -> store epoch its profile record announced last

    def prompt_hashes(self, token_ids) -> list[bytes]:
        """Page hashes of a prompt the orchestrator tokenized, in its secret namespace ([] when off)."""
        if not self.enabled:
            return []
        return prefix_protocol.prompt_hashes(token_ids, self.root)

    def set_chains(self, ready: Sequence[RoutableChain]) -> None:
        """The chains requests may be matched to now; their servers get the prefix store's page budget."""
        self.matcher.chain_servers = {c.chain_id: tuple(c.servers) for c in ready}
        if self.enabled:
            pages = self.cache_tokens_per_block // prefix_protocol.PAGE_TOKENS
            for node in {n for c in ready for n in c.servers}:
                if self.index.budget(node) != pages:
                    self.index.set_budget(node, pages)

    def dispatched(self, chain_id: str, page_hashes: Sequence[bytes], now: float) -> None:
        """Optimistic insert at dispatch (§14.4): every server of the chain will hold the prompt's pages once
        the session's prefill is done (the servers' eviction reports correct it later)."""
        if self.enabled and page_hashes:
            for node in self.matcher.chain_servers.get(chain_id, ()):
                self.index.insert(node, list(page_hashes), now)

    def prefilled(self, reused_tokens: int, prompt_tokens: int, expected_tokens: int = 0) -> None:
        """A session's probe found ``reused_tokens`` on every server of its chain: count the hit."""
        stats = self.stats
        stats["requests"] += 1
        stats["hits"] += reused_tokens > 0
        stats["prompt_tokens"] += prompt_tokens
        stats["reused_tokens"] += reused_tokens
        stats["expected_tokens"] += expected_tokens
        stats["stale"] += reused_tokens < expected_tokens

    def follow_epochs(self, epochs: dict[str, str | None]) -> None:
        """The store epochs the servers' profile records announce (read every refresh, with their state). A new
        epoch means the server (re)loaded or restarted: what the index held for it is gone, and only that epoch's
        reports count from now on. A server announces its new epoch in the same record as the state that makes its
        chains ready, so the index forgets its old pages before any request is dispatched to the new ones; the
        reports (read less often) could otherwise announce the epoch after requests had been indexed under it, and
        drop them. Servers that announce no epoch (older ones) are followed by their reports alone."""
        for node, epoch in epochs.items():
            known = self._epochs.get(node)
            if epoch is None or known == epoch:
                continue
            last = self._report_state.get(node)
            if known is not None or (last is not None and last[0] != epoch):
                self._reset_holder(node, f"new store epoch {epoch} (was {known or last[0]})")
            self._epochs[node] = epoch
            if last is None or last[0] != epoch:
                self._report_state[node] = (epoch, 0)

    def apply_reports(self, reports: dict[str, dict], live: set[str] | None = None) -> None:
        """Follow the servers' eviction reports (``swarm.trust.prefix``): drop evicted pages from the radix index;
        a new store epoch (reload) or a gap in the eviction sequence drops everything the node held. A report of
        another epoch than the one the node's profile announced (:meth:`follow_epochs`) is stale or early: ignored."""
        for node, report in reports.items():
            epoch, seq = report["epoch"], report["seq"]
            if node in self._epochs and epoch != self._epochs[node]:
                continue
            last = self._report_state.get(node)
            if last is not None and last[0] == epoch and seq <= last[1]:
                continue
            entries = [e for e in report.get("evicted", ())
                       if isinstance(e, (list, tuple)) and len(e) == 2 and isinstance(e[0], int)]
            if last is None or last[0] != epoch:
                if last is not None:  # the server's store restarted (reload): what it held is gone
                    self._reset_holder(node, f"new store epoch {epoch} (was {last[0]})")
                base = 0
            else:
                base = last[1]
            fresh = [e for e in entries if e[0] > base]
            if seq > base and (not fresh or min(e[0] for e in fresh) != base + 1):
                # reports were lost: forget what we believed about this node
                first = min((e[0] for e in fresh), default=seq + 1)
                self._reset_holder(node, f"evictions {base + 1}..{first - 1} missing from its reports (seq {seq})")
            else:
                hashes = []
                for _, h in fresh:
                    with contextlib.suppress(ValueError, TypeError):
                        hashes.append(bytes.fromhex(h))
                self.stats["evictions_applied"] += self.index.remove(node, hashes)
            self._report_state[node] = (epoch, seq)
        if live is not None:
            for node in [n for n in self.index.holders() if n not in live]:
                self._reset_holder(node, "left the swarm")
                self._report_state.pop(node, None)
                self._epochs.pop(node, None)

    def drain_resets(self) -> list[tuple[str, str]]:
        """The (node, why) of every holder forgotten since the last call (the orchestrator logs them as events)."""
        out, self.reset_log = self.reset_log, []
        return out

    def _reset_holder(self, node: str, why: str) -> None:
        if self.index.pages_held(node):
            self.reset_log.append((node, why))
        budget = self.index.budget(node)
        self.index.remove_holder(node)
        self.index.set_budget(node, budget)
        self.stats["resets"] += 1

    def chain_cached_tokens(self, chain: RoutableChain) -> int:
        """Prompt tokens cached on every server of the chain, per the radix index (what a request could reuse
        there)."""
        if not self.enabled or not chain.servers:
            return 0
        return self.index.pages_held_by_all(chain.servers) * prefix_protocol.PAGE_TOKENS

    def status(self) -> dict[str, Any]:
        stats = dict(self.stats)
        page = prefix_protocol.PAGE_TOKENS
        requests, prompt = stats["requests"], stats["prompt_tokens"]
        return {
            "enabled": self.enabled, "page_tokens": page,
            "cache_tokens_per_block": self.cache_tokens_per_block,
            "hit_rate": stats["hits"] / requests if requests else 0.0,
            "token_hit_rate": stats["reused_tokens"] / prompt if prompt else 0.0,
            "tokens_saved": stats["reused_tokens"], **stats,
            "servers": {str(n): self.index.pages_held(n) * page for n in self.index.holders()},
        }
