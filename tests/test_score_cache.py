"""swarm/engine/scoring.py's ScoreCache: the scores of page-aligned prompt prefixes, by the hash that ends each."""
import torch

from swarm.engine.sampling import TokenLogprob
from swarm.engine.scoring import RECORD_BYTES, ScoreCache


def records(n: int, top: int) -> list[TokenLogprob]:
    """Targets 1 … n − 1 of an n-token prompt, each with ``top`` alternatives."""
    return [TokenLogprob(t, -float(t), [(t + j, -float(j)) for j in range(top)]) for t in range(1, n)]


def hashes(*tags: str) -> list[bytes]:
    return [tag.encode().ljust(16, b".") for tag in tags]


def test_the_longest_cached_prefix_within_the_bound_with_its_last_output():
    cache = ScoreCache(page_tokens=4)
    prompt = hashes("a", "ab", "abc")  # a 12-token prompt: three full pages
    outputs = {p: torch.full((3,), float(p)) for p in (1, 2, 3)}
    cache.store(prompt, records(12, 2), outputs, top=2)
    found = cache.lookup(prompt, max_pages=3, top=2)
    assert found.pages == 3 and len(found.records) == 11 and found.last.tolist() == [3.0] * 3
    # a prompt that shares the first two pages; at most (n - 1) // page pages, so one position is left to compute
    other = hashes("a", "ab", "abX", "abXY")
    found = cache.lookup(other, max_pages=2, top=2)
    assert found.pages == 2 and [r.token_id for r in found.records] == list(range(1, 8))
    assert found.last.tolist() == [2.0] * 3
    assert cache.lookup(other, max_pages=1, top=2).pages == 1
    assert cache.lookup(hashes("z", "zz"), max_pages=2, top=2) is None


def test_fewer_alternatives_are_cut_and_more_are_a_miss():
    cache = ScoreCache(page_tokens=4)
    prompt = hashes("a", "ab")
    cache.store(prompt, records(8, 3), {1: torch.zeros(2), 2: torch.ones(2)}, top=3)
    assert all(len(r.top) == 1 for r in cache.lookup(prompt, 2, top=1).records)
    assert cache.lookup(prompt, 2, top=4) is None


def test_the_cache_stays_within_its_bytes_least_recently_used_out():
    vector = torch.zeros(8)  # 32 bytes
    entry = 32 + 4 * RECORD_BYTES  # one page of 4 tokens
    cache = ScoreCache(max_bytes=3 * entry, page_tokens=4)
    for name in "abcd":
        cache.store(hashes(name), records(5, 1), {1: vector}, top=1)
        assert cache.bytes <= cache.max_bytes
    assert len(cache) == 3 and cache.lookup(hashes("a"), 1, 1) is None  # the first out
    cache.lookup(hashes("b"), 1, 1)  # used: now the most recent
    cache.store(hashes("e"), records(5, 1), {1: vector}, top=1)
    assert cache.lookup(hashes("b"), 1, 1) is not None and cache.lookup(hashes("c"), 1, 1) is None
    # an entry larger than the whole cache is not kept, and evicts nothing
    cache.store(hashes("f", "ff", "fff", "ffff"), records(17, 1), {4: torch.zeros(10_000)}, top=1)
    assert len(cache) == 3 and cache.bytes <= cache.max_bytes
    # a prompt's entries count its records once: four pages of one prompt cost four pages
    cache = ScoreCache(max_bytes=4 * entry, page_tokens=4)
    cache.store(hashes("a", "ab", "abc", "abcd"), records(16, 1), {p: vector for p in (1, 2, 3, 4)}, top=1)
    assert len(cache) == 4 and cache.bytes == 4 * entry
