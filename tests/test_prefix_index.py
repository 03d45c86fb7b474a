"""Radix index over page hashes: hashing, matching against a brute-force reference, LRU, reports."""

from __future__ import annotations

import os
import subprocess
import sys

from hypothesis import given, settings, strategies as st

from planner.prefix_index import ChainPrefixMatcher, PrefixIndex, page_hashes


def test_page_hashes_chain_and_partial_pages():
    a = page_hashes(list(range(40)) + [7, 7], 8)
    assert len(a) == 5  # the trailing partial page has no hash
    b = page_hashes(list(range(24)) + [99] + list(range(25, 40)), 8)
    assert a[:3] == b[:3] and all(x != y for x, y in zip(a[3:], b[3:]))  # diverge at page 3 and stay apart
    assert len(set(a)) == 5 and all(len(h) == 16 for h in a)
    assert page_hashes([1, 2, 3], 4) == []


def test_page_hashes_same_across_processes():
    code = "from planner.prefix_index import page_hashes; print(page_hashes(list(range(64)), 16)[-1].hex())"
    here = page_hashes(list(range(64)), 16)[-1].hex()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=root)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == here


class BruteIndex:
    """Reference: every holder keeps the set of prefixes (tuples of page hashes) it holds."""

    def __init__(self):
        self.held = {}

    def insert(self, holder, hashes):
        s = self.held.setdefault(holder, set())
        for k in range(1, len(hashes) + 1):
            s.add(tuple(hashes[:k]))

    def remove(self, holder, h):
        s = self.held.get(holder, set())
        for p in [p for p in s if h in p]:
            s.discard(p)

    def match(self, holder, hashes):
        s = self.held.get(holder, set())
        k = 0
        while k < len(hashes) and tuple(hashes[: k + 1]) in s:
            k += 1
        return k

    def pages(self, holder):
        return len(self.held.get(holder, ()))


def check_structure(index: PrefixIndex):
    """Closure invariant and page counts, by walking the private tree."""
    counts = {}
    stack = [index._root]
    while stack:
        node = stack.pop()
        for child in node.children.values():
            assert child.parent is node and child.pages and node.children[child.pages[0]] is child
            for holder in child.holders:
                assert node is index._root or holder in node.holders
                counts[holder] = counts.get(holder, 0) + len(child.pages)
            assert child.holders or child.children, "empty leaf left behind"
            stack.append(child)
    for holder in set(counts) | set(index._held):
        assert counts.get(holder, 0) == index.pages_held(holder)


tokens = st.lists(st.integers(0, 2), min_size=0, max_size=14)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.sampled_from("xyz"), tokens),
        st.tuples(st.just("remove"), st.sampled_from("xyz"), tokens),
    ),
    max_size=25,
)


@settings(max_examples=150, deadline=None)
@given(ops=ops, queries=st.lists(tokens, min_size=1, max_size=6))
def test_radix_agrees_with_brute_force(ops, queries):
    index, brute = PrefixIndex(page_size=2), BruteIndex()
    for t, (op, holder, toks) in enumerate(ops):
        hashes = page_hashes(toks, 2)
        if op == "insert":
            index.insert(holder, hashes, t)
            brute.insert(holder, hashes)
        elif hashes:
            h = hashes[len(hashes) // 2]
            index.remove(holder, [h])
            brute.remove(holder, h)
        check_structure(index)
    for q in queries + [toks for _, _, toks in ops]:
        hashes = page_hashes(q, 2)
        all_ = index.match_all(hashes)
        for holder in "xyz":
            expected = brute.match(holder, hashes)
            assert index.longest_match(holder, hashes) == expected
            assert all_.get(holder, 0) == expected
        best, who = index.longest_match_holders(hashes)
        top = max([brute.match(h, hashes) for h in "xyz"])
        assert best == top
        assert who == (frozenset(h for h in "xyz" if brute.match(h, hashes) == top) if top else frozenset())
    for holder in "xyz":
        assert index.pages_held(holder) == brute.pages(holder)


@settings(max_examples=80, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from("xy"), tokens), max_size=30), budget=st.integers(1, 10))
def test_budget_respected_and_structure_kept(ops, budget):
    index = PrefixIndex(page_size=1, default_budget=budget)
    for t, (holder, toks) in enumerate(ops):
        hashes = page_hashes(toks, 1)
        evicted = index.insert(holder, hashes, t)
        assert index.pages_held(holder) <= budget
        # the just-inserted prefix (truncated to the budget) is never evicted
        assert index.longest_match(holder, hashes) == min(len(hashes), budget)
        assert not set(evicted) & set(hashes[:budget])
        check_structure(index)


def test_lru_evicts_whole_leaves_t1_style():
    index = PrefixIndex(page_size=1, default_budget=250)
    pa, pb = list(range(200)), list(range(1000, 1200))
    a1 = page_hashes(pa + list(range(5000, 5020)), 1)
    a2 = page_hashes(pa + list(range(6000, 6020)), 1)
    b1 = page_hashes(pb + list(range(7000, 7020)), 1)
    index.insert("W", a1, 0)
    assert index.longest_match("W", a2) == 200  # a match may end inside a node
    index.insert("W", a2, 1)
    assert index.pages_held("W") == 240
    evicted = index.insert("W", b1, 2)  # 460 > 250: LRU leaves A1, A2, then P_A
    assert index.pages_held("W") == 220 and len(evicted) == 240
    assert index.longest_match("W", a2) == 0


def test_lru_order_and_locks():
    index = PrefixIndex(page_size=1, default_budget=6)
    x, y, z = (page_hashes([k, k, k], 1) for k in (1, 2, 3))
    index.insert("s", x, 0)
    index.insert("s", y, 1)
    index.touch("s", x, 2)  # x is now more recent than y
    index.insert("s", z, 3)
    assert index.longest_match("s", x) == 3 and index.longest_match("s", y) == 0
    index.lock("s", x)
    w = page_hashes([4, 4, 4], 1)
    index.insert("s", w, 4)  # x locked, so z (LRU among the unlocked) goes
    assert index.longest_match("s", x) == 3 and index.longest_match("s", z) == 0
    index.unlock("s", x)
    assert index.evict("s", 3) == x


def test_eviction_report_splits_and_prunes():
    index = PrefixIndex(page_size=4)
    toks = list(range(40))
    hashes = page_hashes(toks, 4)
    index.insert("s1", hashes, 0)
    index.insert("s2", hashes[:6], 0)
    assert index.remove("s1", [hashes[4]]) == 6  # pages 4..9 of s1 go
    assert index.longest_match("s1", hashes) == 4
    assert index.longest_match("s2", hashes) == 6
    assert index.remove("s1", [b"unknown"]) == 0  # stale report ignored
    index.remove_holder("s2")
    assert index.match_all(hashes) == {"s1": 4}
    check_structure(index)
    assert index.node_count() == 1


def test_chain_matcher_is_min_over_servers():
    index = PrefixIndex(page_size=16)
    toks = list(range(100))
    hashes = page_hashes(toks, 16)
    index.insert("s1", hashes, 0)
    index.insert("s2", hashes[:3], 0)
    match = ChainPrefixMatcher(index, {"c1": ("s1", "s2"), "c2": ("s1",)})

    class R:
        page_hashes = tuple(hashes)

    assert match(R, "c1") == 48 and match(R, "c2") == 96 and match(R, "c3") == 0
