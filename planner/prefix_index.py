"""Radix index over token pages: who holds which prompt prefix.

A prompt is cut into pages of ``page_size`` tokens; page k is keyed by the hash
chain h_k = H(h_{k-1} || tokens of page k) (``page_hashes``), so two prompts
share page hashes exactly as far as their tokens agree page by page, and a hash
identifies its whole prefix.  The tree stores hash sequences with compressed
edges (each node is a maximal run of pages shared by its descendants, as in a
radix cache); every node records its holders (chain or server ids) with a
per-holder last-access time.  Invariant: a holder that holds a node holds all
its ancestors, so a holder's longest match is the depth of the deepest node on
the query path that it holds.

Operations (L = pages in the query):
* ``longest_match(holder, hashes)`` / ``match_all(hashes)`` /
  ``longest_match_holders(hashes)`` — O(L) walks (plus O(holders) per node);
* ``insert(holder, hashes, now)`` — O(L), then LRU eviction of the holder's
  leaf nodes down to its page budget (never the path just inserted nor locked
  nodes); returns the evicted page hashes;
* ``remove(holder, hashes)`` — asynchronous eviction report: the holder loses
  those pages and everything below them (a later page is useless without its
  prefix); O(removed + node length);
* ``evict(holder, pages)``, ``lock``/``unlock``, ``remove_holder``;
* ``pages_held_by_all(holders)`` — pages every one of the holders holds (what a
  chain of servers could reuse), O(nodes they share).

Pure Python, no clocks: every time stamp is passed in.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import struct
from typing import Hashable, Iterable, Mapping, Sequence

__all__ = ["page_hashes", "PrefixIndex", "ChainPrefixMatcher", "ROOT_HASH"]

_DIGEST = 16
ROOT_HASH = hashlib.blake2b(b"chainswarm/prefix-pages/v1", digest_size=_DIGEST).digest()


def page_hashes(token_ids: Sequence[int], page_size: int, *, root: bytes = ROOT_HASH) -> list[bytes]:
    """Hash chain over the FULL pages of ``token_ids`` (a trailing partial page is not
    cached, so it gets no hash).  h_0 = ``root``; h_k = blake2b-128(h_{k-1} ||
    little-endian int64 token ids of page k).  Deterministic across processes,
    machines and Python hash seeds."""
    if page_size < 1:
        raise ValueError("page_size must be >= 1")
    full = len(token_ids) // page_size
    fmt = struct.Struct(f"<{page_size}q")
    out = []
    prev = root
    for k in range(full):
        page = token_ids[k * page_size : (k + 1) * page_size]
        prev = hashlib.blake2b(prev + fmt.pack(*page), digest_size=_DIGEST).digest()
        out.append(prev)
    return out


class _Node:
    __slots__ = ("pages", "children", "parent", "holders", "locks")

    def __init__(self, pages: list, parent: "_Node | None") -> None:
        self.pages = pages
        self.children: dict = {}
        self.parent = parent
        self.holders: dict = {}  # holder -> last access time
        self.locks: dict = {}  # holder -> lock count


class PrefixIndex:
    """Radix tree over page hashes with per-holder LRU page budgets."""

    def __init__(self, page_size: int = 16, *, default_budget: int | None = None) -> None:
        if page_size < 1:
            raise ValueError("page_size must be >= 1")
        self.page_size = page_size
        self.default_budget = default_budget
        self._root = _Node([], None)
        self._where: dict = {}  # page hash -> node holding it in its edge
        self._held: dict = {}  # holder -> pages held
        self._nodes: dict = {}  # holder -> set of nodes held
        self._budget: dict = {}

    # ----------------------------------------------------------- bookkeeping
    def set_budget(self, holder: Hashable, pages: int | None) -> list:
        """Per-holder page budget (None = unlimited); evicts LRU leaves if now over it."""
        self._budget[holder] = pages
        return self._evict_to_budget(holder, set())

    def budget(self, holder: Hashable) -> int | None:
        return self._budget.get(holder, self.default_budget)

    def pages_held(self, holder: Hashable) -> int:
        return self._held.get(holder, 0)

    def holders(self) -> list:
        return [h for h, n in self._held.items() if n > 0]

    def pages_held_by_all(self, holders: Iterable) -> int:
        """Pages that every one of ``holders`` holds (summed over all prefixes): O(nodes they share)."""
        holders = tuple(holders)
        total = 0
        stack = [self._root]
        while stack:
            node = stack.pop()
            for child in node.children.values():
                if all(h in child.holders for h in holders):
                    total += len(child.pages)
                    stack.append(child)
        return total

    def node_count(self) -> int:
        return sum(1 for _ in self._iter_nodes()) - 1

    def _iter_nodes(self):
        stack = [self._root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _add_holder(self, node: _Node, holder, now) -> None:
        if holder not in node.holders:
            self._held[holder] = self._held.get(holder, 0) + len(node.pages)
            self._nodes.setdefault(holder, set()).add(node)
        node.holders[holder] = now

    def _drop_holder(self, node: _Node, holder) -> int:
        if holder not in node.holders:
            return 0
        del node.holders[holder]
        node.locks.pop(holder, None)
        self._held[holder] -= len(node.pages)
        self._nodes[holder].discard(node)
        return len(node.pages)

    def _split(self, node: _Node, k: int) -> _Node:
        """Cut ``node`` after its first k pages; returns the new upper node."""
        parent = node.parent
        top = _Node(node.pages[:k], parent)
        node.pages = node.pages[k:]
        node.parent = top
        top.children[node.pages[0]] = node
        parent.children[top.pages[0]] = top
        top.holders = dict(node.holders)
        top.locks = dict(node.locks)
        for h in top.pages:
            self._where[h] = top
        for holder in top.holders:
            self._nodes[holder].add(top)
        return top

    def _prune(self, node: _Node) -> None:
        while node is not self._root and not node.holders and not node.children:
            parent = node.parent
            del parent.children[node.pages[0]]
            for h in node.pages:
                self._where.pop(h, None)
            node = parent

    def _walk(self, hashes: Sequence):
        """Yield (node, pages matched in node, depth before node) along the query path."""
        node, i, n = self._root, 0, len(hashes)
        while i < n:
            child = node.children.get(hashes[i])
            if child is None:
                return
            k, edge = 0, child.pages
            while k < len(edge) and i + k < n and edge[k] == hashes[i + k]:
                k += 1
            yield child, k, i
            i += k
            if k < len(edge):
                return
            node = child

    # ----------------------------------------------------------------- match
    def longest_match(self, holder: Hashable, hashes: Sequence, now: float | None = None) -> int:
        """Leading pages of ``hashes`` that ``holder`` holds.  With ``now`` the matched
        nodes count as used (LRU recency)."""
        matched = 0
        for node, k, depth in self._walk(hashes):
            if holder not in node.holders:
                break
            matched = depth + k
            if now is not None:
                node.holders[holder] = now
        return matched

    def match_all(self, hashes: Sequence) -> dict:
        """{holder: leading pages held} for every holder with a match >= 1 page."""
        out = {}
        for node, k, depth in self._walk(hashes):
            for holder in node.holders:
                out[holder] = depth + k
        return out

    def longest_match_holders(self, hashes: Sequence) -> tuple[int, frozenset]:
        """(pages, holders) of the deepest matched node: the DoubleQ set G."""
        best, who = 0, frozenset()
        for node, k, depth in self._walk(hashes):
            if node.holders and k > 0:
                best, who = depth + k, frozenset(node.holders)
        return best, who

    def touch(self, holder: Hashable, hashes: Sequence, now: float) -> int:
        return self.longest_match(holder, hashes, now)

    # ---------------------------------------------------------------- insert
    def insert(self, holder: Hashable, hashes: Sequence, now: float) -> list:
        """Record that ``holder`` holds the prefix ``hashes``; returns the page hashes
        evicted from this holder (LRU leaves) to respect its budget.  A prefix
        longer than the whole budget is truncated to it."""
        budget = self.budget(holder)
        if budget is not None and len(hashes) > budget:
            hashes = hashes[:budget]
        node, i, n = self._root, 0, len(hashes)
        path = []
        while i < n:
            child = node.children.get(hashes[i])
            if child is None:
                new = _Node(list(hashes[i:]), node)
                node.children[hashes[i]] = new
                for h in new.pages:
                    self._where[h] = new
                path.append(new)
                break
            k, edge = 0, child.pages
            while k < len(edge) and i + k < n and edge[k] == hashes[i + k]:
                k += 1
            if k < len(edge):
                child = self._split(child, k)
            path.append(child)
            i += k
            node = child
        for nd in path:
            self._add_holder(nd, holder, now)
        return self._evict_to_budget(holder, set(map(id, path)))

    # ------------------------------------------------------------ eviction
    def _is_leaf_for(self, node: _Node, holder) -> bool:
        return not any(holder in c.holders for c in node.children.values())

    def _evict_to_budget(self, holder, protect: set) -> list:
        budget = self.budget(holder)
        if budget is None or self._held.get(holder, 0) <= budget:
            return []
        return self._evict_lru(holder, self._held[holder] - budget, protect)

    def evict(self, holder: Hashable, pages: int) -> list:
        """Free at least ``pages`` pages of ``holder`` in LRU leaf order (if possible)."""
        return self._evict_lru(holder, pages, set())

    def _evict_lru(self, holder, need: int, protect: set) -> list:
        counter = itertools.count()
        heap = []
        for node in self._nodes.get(holder, ()):
            if id(node) not in protect and not node.locks.get(holder) and self._is_leaf_for(node, holder):
                heapq.heappush(heap, (node.holders[holder], next(counter), node))
        evicted = []
        freed = 0
        while freed < need and heap:
            _, _, node = heapq.heappop(heap)
            if holder not in node.holders:
                continue
            evicted.extend(node.pages)
            freed += self._drop_holder(node, holder)
            parent = node.parent
            self._prune(node)
            if (
                parent is not self._root
                and holder in parent.holders
                and id(parent) not in protect
                and not parent.locks.get(holder)
                and self._is_leaf_for(parent, holder)
            ):
                heapq.heappush(heap, (parent.holders[holder], next(counter), parent))
        return evicted

    def remove(self, holder: Hashable, hashes: Iterable) -> int:
        """Eviction report: ``holder`` no longer holds these pages (nor, consequently,
        any page after them in a prefix).  Unknown hashes are ignored (the report
        may be stale).  Returns the pages removed from the holder."""
        removed = 0
        for h in hashes:
            node = self._where.get(h)
            if node is None or holder not in node.holders:
                continue
            idx = node.pages.index(h)
            if idx > 0:
                self._split(node, idx)  # ``node`` now starts at h
            removed += self._drop_subtree(holder, node)
        return removed

    def _drop_subtree(self, holder, node: _Node) -> int:
        removed = 0
        stack = [node]
        emptied = []
        while stack:
            nd = stack.pop()
            if holder not in nd.holders:
                continue
            removed += self._drop_holder(nd, holder)
            emptied.append(nd)
            stack.extend(nd.children.values())
        for nd in reversed(emptied):
            if nd.parent is not None and nd.parent.children.get(nd.pages[0]) is nd:
                self._prune(nd)
        return removed

    def remove_holder(self, holder: Hashable) -> int:
        """Forget a holder entirely (server left, chain dissolved)."""
        removed = 0
        for node in list(self._nodes.get(holder, ())):
            removed += self._drop_holder(node, holder)
        self._prune_all()
        self._nodes.pop(holder, None)
        self._held.pop(holder, None)
        self._budget.pop(holder, None)
        return removed

    def _prune_all(self) -> None:
        leaves = [n for n in self._iter_nodes() if n is not self._root and not n.children]
        for leaf in leaves:
            self._prune(leaf)

    # ------------------------------------------------------------------ locks
    def lock(self, holder: Hashable, hashes: Sequence) -> int:
        """Protect the holder's matched path from LRU eviction (running session)."""
        matched = 0
        for node, k, depth in self._walk(hashes):
            if holder not in node.holders:
                break
            node.locks[holder] = node.locks.get(holder, 0) + 1
            matched = depth + k
        return matched

    def unlock(self, holder: Hashable, hashes: Sequence) -> None:
        for node, k, depth in self._walk(hashes):
            if holder not in node.holders:
                break
            c = node.locks.get(holder, 0) - 1
            if c > 0:
                node.locks[holder] = c
            else:
                node.locks.pop(holder, None)


class ChainPrefixMatcher:
    """``prefix_match`` callable for the schedulers (§14.2):
    m_k(r) = page_size * min over the chain's servers of their matched pages,
    so a chain reuses only what every server on it holds.  A chain listed with
    no servers is itself the holder (simulator per-chain caches).  Requests are
    duck-typed: only ``page_hashes`` is read (the caller caps at len - 1)."""

    def __init__(self, index: PrefixIndex, chain_servers: Mapping[Hashable, Sequence[Hashable]] | None = None):
        self.index = index
        self.chain_servers = dict(chain_servers or {})

    def __call__(self, request, chain_id: Hashable) -> int:
        hashes = getattr(request, "page_hashes", ())
        if not hashes:
            return 0
        servers = self.chain_servers.get(chain_id) or (chain_id,)
        found = self.index.match_all(hashes)
        pages = min(found.get(s, 0) for s in servers)
        return pages * self.index.page_size
