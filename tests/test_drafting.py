"""Drafts without a draft model (planner.drafting): prompt lookup, the swarm-wide suffix index, adaptive k."""
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.drafting import AdaptiveK, Drafter, OwnNgrams, SuffixIndex, lookup_own


def test_the_longest_earlier_suffix_proposes_what_followed_it():
    code = [5, 6, 7, 8, 9, 10, 1, 2, 5, 6, 7]  # "5 6 7" occurred before, followed by "8 9 10"
    assert lookup_own(code, 3) == [8, 9, 10]
    assert lookup_own(code, 10) == [8, 9, 10, 1, 2, 5, 6, 7]  # up to the end of the sequence
    assert lookup_own([1, 2, 3, 4], 3) == []  # nothing repeats
    assert lookup_own([1, 2, 1, 2, 3, 1, 2], 2) == [3, 1]  # the latest earlier occurrence wins
    assert lookup_own(code, 0) == []


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 4), max_size=60), cuts=st.lists(st.integers(0, 60), max_size=8),
       k=st.integers(0, 6), other=st.lists(st.integers(0, 4), max_size=20))
def test_a_sequences_own_index_drafts_what_the_scan_drafts_as_the_sequence_grows(tokens, cuts, k, other):
    """OwnNgrams (indexed once per token) proposes exactly lookup_own's draft at every length the sequence is
    drafted at, and a sequence that does not extend the last one (another request) is indexed anew."""
    own = OwnNgrams(max_n=4, min_n=2)
    for cut in sorted(cuts) + [len(tokens)]:
        assert own.propose(tokens[:cut], k) == lookup_own(tokens[:cut], k, 4, 2)
    assert own.propose(other, k) == lookup_own(other, k, 4, 2)


def test_the_suffix_index_keeps_scopes_apart_and_its_memory_bounded():
    index = SuffixIndex(max_tokens=100, key_n=3)
    index.add("client:alice", [1, 2, 3, 4, 5, 6])
    index.add("client:bob", [1, 2, 3, 9, 9, 9])
    assert index.continuation("client:alice", [7, 1, 2, 3], 3) == [4, 5, 6]
    assert index.continuation("client:bob", [7, 1, 2, 3], 3) == [9, 9, 9]
    assert index.continuation("client:carol", [7, 1, 2, 3], 3) == []  # never another client's text
    rng = random.Random(0)
    for _ in range(50):
        index.add("client:alice", [rng.randrange(1000) for _ in range(10)])
    assert index.tokens <= 100
    assert index.continuation("client:bob", [1, 2, 3], 3) == []  # the oldest outputs were evicted
    assert sum(len(v) for v in index._keys.values()) == sum(len(t) - 3 for _, t in index._docs.values())


def test_a_drafter_uses_the_request_first_then_its_scope():
    drafter = Drafter(SuffixIndex(max_tokens=1000, key_n=2))
    drafter.learn("alice", [40, 41, 42, 43], prompt_tail=[7, 8])
    assert drafter.propose("alice", [1, 7, 8], 3) == [40, 41, 42]
    assert drafter.propose("bob", [1, 7, 8], 3) == []
    assert drafter.propose("alice", [3, 4, 5, 3, 4], 2) == [5, 3]  # its own tokens come first
    assert drafter.propose("alice", [3, 4, 5, 3, 4], 2, own=drafter.own()) == [5, 3]  # indexed: the same draft
    assert drafter.propose("alice", [1, 7, 8], 3, own=drafter.own()) == [40, 41, 42]
    shared = Drafter(SuffixIndex(max_tokens=1000, key_n=2), shared=True)
    shared.learn("alice", [40, 41], prompt_tail=[7, 8])
    assert shared.propose("bob", [7, 8], 2) == [40, 41]


def test_k_grows_on_full_acceptance_keeps_on_a_partial_one_halves_on_a_miss_and_falls_to_zero_with_probes():
    k = AdaptiveK(k_max=6, k=2, probe_every=4)
    k.update(2, 2)
    assert k.next_k() == 3
    for _ in range(10):
        k.update(k.next_k(), k.next_k())
    assert k.next_k() == 6
    k.update(6, 3)  # half accepted: k stays
    assert k.next_k() == 6
    k.update(6, 1)  # one token accepted (an edit in copied text): the source was right, k stays
    assert k.next_k() == 6
    k.update(6, 0)  # wholly rejected: half the drafts, not none
    assert k.next_k() == 3
    k.update(3, 3)
    assert k.next_k() == 4
    for proposed in (4, 2, 1):  # drafts that keep failing reach 0 in log2(k) steps
        k.update(proposed, 0)
    assert [k.next_k() for _ in range(8)] == [0, 0, 0, 1, 0, 0, 0, 1]
    strict = AdaptiveK(k_max=6, k=6, keep_fraction=0.5)  # the earlier rule: fewer than half accepted halves k
    strict.update(6, 3)
    assert strict.next_k() == 6
    strict.update(6, 2)
    assert strict.next_k() == 3
    with pytest.raises(ValueError):
        k.update(2, 3)
