"""Prompt-prefix reuse end to end on loopback (issue 7): servers' prefix KV stores, the probe/load/save
protocol, the orchestrator's radix index and locality-aware ``swarm`` policy.

One swarm for the module: a DHT, an orchestrator (``swarm`` policy, 128 prefix tokens per block) and three
nodes: "big" holds the whole model (fast chain), "left" → "right" split it (slow chain). Besides HTTP
completions, the test process runs its own petals client (``GenerationEngine``) on explicit routes, hashing
prompts in a namespace of its own — which also plays the client whose hashes do not match its tokens.
"""
import os
import threading
import time

import pytest
import torch

from server.local_swarm import LocalSwarm
from swarm.trust import prefix as protocol
from helpers import HTTP, describe_swarm, http_client, wait_for
from swarm.trust.identity import Identity
from test_orchestrator_logic import MemoryDHT, node_key

pytestmark = pytest.mark.swarm

MAX_LENGTH = 256
PREFIX_TOKENS = 128  # per block: 8 pages of 16 tokens
KEYS = {"key-heavy": "heavy", "key-light": "light", "key-a": "a", "key-admin": "admin"}  # admin: the events
SHARED = ("You are a careful assistant. Answer briefly and cite the document. The document says that the "
          "harbour of the old town was rebuilt twice, first after the storm and then after the fire, and that "
          "the lighthouse keeper kept a diary of every ship. ")


@pytest.fixture(scope="module")
def swarm(tiny_model, tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("profiles"))
    with LocalSwarm(tiny_model) as local:
        local.add_orchestrator(policy="swarm", quantum=400.0, expected_rate=8.0, max_length=MAX_LENGTH,
                               expected_input_tokens=128, expected_output_tokens=16, refresh_s=0.5,
                               api_keys=KEYS, request_timeout_s=8.0, prefix_cache_tokens=PREFIX_TOKENS,
                               kv_admission="slots")
        # declared compute and RTT (and max-length KV slots): the plan (big alone, left+big, left+right) must not
        # depend on machine load
        declared = {"prefill_s": 1e-5, "decode_s": 3e-4, "rtt_s": 0.002}
        nodes = {name: local.add_node(node_id=name, memory_gb=mb, wait=False, profile_cache_dir=cache,
                                      update_period=4.0, declared_profile=declared)
                 for name, mb in (("big", 0.0026), ("left", 0.0013), ("right", 0.0013))}
        for peer in nodes.values():
            local.wait_profiled(peer)
        url = local.orchestrator.info["url"]

        def ready():
            status = HTTP.get(f"{url}/v1/swarm").json()
            planned = status["plan"] and {s["id"] for s in status["plan"]["servers"]} == set(nodes)
            ok = planned and len(status["chains"]) >= 2 and all(c["ready"] for c in status["chains"])
            return status if ok else None

        local.status = wait_for(ready, 120, what="all chains ready")
        local.url, local.nodes_by_name = url, nodes
        yield local


@pytest.fixture(scope="module")
def engine(swarm, tiny_model):
    """A petals client in the test process that runs sessions on routes the test chooses."""
    from swarm.engine.generation import GenerationEngine

    eng = GenerationEngine(tiny_model, initial_peers=swarm.initial_peers, dht_prefix=swarm.dht_prefix,
                           max_retries=2, request_timeout=8.0)
    eng.test_identity = swarm.orchestrator_identity
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def reference(tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32).eval()

    def run(prompt_or_ids, max_new_tokens):
        ids = prompt_or_ids if not isinstance(prompt_or_ids, str) else tokenizer(prompt_or_ids).input_ids
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
        return out[0, len(ids):].tolist(), tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)

    return run


def complete(swarm, prompt, max_tokens=12, key="key-a"):
    with http_client(base_url=swarm.url, headers={"Authorization": f"Bearer {key}"}, timeout=120) as http:
        response = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert response.status_code == 200, response.text
    prefix = dict(kv.split("=") for kv in response.headers["x-chainswarm-prefix"].split(";"))
    return response.json(), {k: int(v) for k, v in prefix.items()}


def route_of(swarm, *names):
    """A route over the named nodes' live ranges, the first name that covers a block serving it: e.g.
    ("left", "big") = left's blocks, big's for the rest."""
    status = HTTP.get(f"{swarm.url}/v1/swarm").json()
    servers = {s["node_id"]: s for s in status["servers"]}
    route, block = [], 0
    while block < 4:
        s = next(servers[n] for n in names
                 if servers[n]["start"] is not None and servers[n]["start"] <= block < servers[n]["end"])
        route.append((s["peer_id"], block, s["end"]))
        block = s["end"]
    return route


def run_direct(engine, route, ids, hashes, max_new_tokens=10):
    from swarm.engine.sampling import SamplingParams
    from swarm.engine.routing import Lease

    from swarm.trust import tickets

    request_id = os.urandom(4).hex()
    # the test plays the orchestrator: its ticket grants the route and names the pages the servers may store
    ticket = tickets.mint(engine.test_identity, request_id=request_id, chain_id="test", route=route,
                          max_length=MAX_LENGTH, page_hashes=hashes or ())
    lease = Lease(request_id, "test", tuple(route), MAX_LENGTH, ticket=ticket)
    return engine.generate(lease, None, ids, SamplingParams(max_new_tokens, temperature=0), page_hashes=hashes)


def test_multi_session_streams_load_and_store_prompt_pages(swarm, engine):
    """(First in the module: the servers' stores are empty, nothing is pinned.) The batched path's prefix reuse on the wire (``swarm.engine.multi_wire.Prefix``): a session that opens with
    its prompt's hashes has the prompt's full pages stored after its prefill; one that loads them sends only the
    positions after them and gets the hidden states the full prefill gave there, and the same decode step after;
    a session that asks for pages nobody holds fails alone, with the missing-pages message."""
    from swarm.engine.multi_client import ChainBatch
    from swarm.engine.multi_wire import Prefix
    from swarm.trust import tickets

    manager = engine.model.transformer.h.sequence_manager
    route = route_of(swarm, "left", "right")
    ids = engine.encode(SHARED + "Question: which ship came first?")
    hashes = protocol.prompt_hashes(ids, protocol.namespace_root(os.urandom(8), swarm.dht_prefix))
    elsewhere = protocol.prompt_hashes(ids, protocol.namespace_root(os.urandom(8), swarm.dht_prefix))
    load = (len(ids) - 1) // 16
    assert load >= 2
    with torch.inference_mode():
        hidden = engine.model.transformer.word_embeddings(torch.tensor([ids + [ids[-1]]]))
    prompt, decode = hidden[:, :-1], hidden[:, -1:]

    def ticket(page_hashes):
        return tickets.mint(engine.test_identity, request_id=os.urandom(4).hex(), chain_id="test", route=route,
                            max_length=MAX_LENGTH, page_hashes=page_hashes)

    with ChainBatch(manager.state.p2p, route, manager.block_uids) as batch:
        full, failed = batch.step({"full": prompt}, {"full": MAX_LENGTH}, {"full": ticket(hashes)},
                                  prefixes={"full": Prefix(tuple(hashes))})
        assert not failed
        full_next, failed = batch.step({"full": decode})
        assert not failed
        reused, failed = batch.step({"reused": prompt[:, load * 16:]}, {"reused": MAX_LENGTH},
                                    {"reused": ticket(hashes)}, prefixes={"reused": Prefix(tuple(hashes), load)})
        assert not failed
        torch.testing.assert_close(reused["reused"], full["full"][:, load * 16:], atol=1e-4, rtol=1e-4)
        reused_next, failed = batch.step({"reused": decode})
        assert not failed
        torch.testing.assert_close(reused_next["reused"], full_next["full"], atol=1e-4, rtol=1e-4)
        outputs, failed = batch.step({"gone": prompt[:, 16:], "reused": decode}, {"gone": MAX_LENGTH},
                                     {"gone": ticket(elsewhere)}, prefixes={"gone": Prefix(tuple(elsewhere), 1)})
        assert set(failed) == {"gone"} and protocol.MISSING_MESSAGE in failed["gone"].reason, failed
        assert set(outputs) == {"reused"}


def test_reuse_gives_the_same_tokens_as_no_reuse_and_transformers(swarm, reference):
    first, head1 = complete(swarm, SHARED + "Question: who kept the diary?")
    assert head1["reused"] == 0 and head1["prefill"] > 0
    for question in ("Question: what happened after the storm?", "Question: how often was it rebuilt?"):
        doc, head = complete(swarm, SHARED + question)
        assert doc["choices"][0]["text"] == reference(SHARED + question, 12)[1]
        assert head["reused"] >= 32 and head["prefill"] + head["reused"] == doc["usage"]["prompt_tokens"]
    assert first["choices"][0]["text"] == reference(SHARED + "Question: who kept the diary?", 12)[1]
    status = HTTP.get(f"{swarm.url}/v1/swarm").json()
    assert status["prefix"]["hits"] >= 2 and status["prefix"]["tokens_saved"] >= 64
    # (every chain said 0 here after the hits in 3 of ~25 full runs, until the servers' profiles carried their store
    # epochs: a reload's first report, read after the hits, dropped them; the message says which chains and events)
    detail = HTTP.get(f"{swarm.url}/v1/swarm", headers={"Authorization": "Bearer key-admin"}).json()
    assert any(e["event"] == "plan" for e in detail["events"])  # the operator's view, with the events
    assert not [e for e in detail["events"] if e["event"] == "prefix_index_reset"], detail["events"]
    assert max(c["cached_prefix_tokens"] for c in status["chains"]) >= 64, (
        f"{[(c['servers'], c['cached_prefix_tokens']) for c in status['chains']]}, prefix {status['prefix']}, "
        f"{describe_swarm(detail)}")
    metrics = HTTP.get(f"{swarm.url}/metrics").text
    assert "chainswarm_prefix_hit_rate" in metrics and "chainswarm_chain_cached_prefix_tokens" in metrics
    hit_rate = next(float(line.split()[-1]) for line in metrics.splitlines()
                    if line.startswith("chainswarm_prefix_hit_rate"))
    assert hit_rate > 0


def test_chain_where_only_some_servers_hold_the_prefix_recomputes(swarm, engine, reference):
    root = protocol.namespace_root(b"test-namespace-1", swarm.dht_prefix)
    ids = engine.encode(SHARED + "Only left holds this one. Question: where is the lighthouse?")
    hashes = protocol.prompt_hashes(ids, root)
    expected = reference(ids, 10)[0]
    warm = run_direct(engine, route_of(swarm, "left", "big"), ids, hashes)  # left (0:2) and big (2:4) store it
    assert warm.token_ids == expected and warm.reused_tokens == 0
    partial = run_direct(engine, route_of(swarm, "left", "right"), ids, hashes)  # right holds nothing
    assert partial.token_ids == expected and partial.reused_tokens == 0
    big_alone = run_direct(engine, route_of(swarm, "big"), ids, hashes)  # big holds blocks 2:4 only
    assert big_alone.token_ids == expected and big_alone.reused_tokens == 0
    full = run_direct(engine, route_of(swarm, "left", "right"), ids, hashes)  # both hold it now
    assert full.token_ids == expected and full.reused_tokens == (len(ids) - 1) // 16 * 16


def test_hashes_that_do_not_match_the_tokens_cannot_change_an_answer(swarm, engine, reference):
    prompt_a = SHARED + "Question: who rebuilt the harbour?"
    complete(swarm, prompt_a)  # cached in the orchestrator's (secret) namespace
    ids_a = engine.encode(prompt_a)
    ids_b = engine.encode("A different prompt entirely, about mountains and rivers and the snow on them. " * 2)
    expected_b = reference(ids_b, 10)[0]
    for route in (route_of(swarm, "big"), route_of(swarm, "left", "right")):
        # a client claims prompt A's pages (public namespace, or random bytes) while sending prompt B's tokens
        forged = protocol.prompt_hashes(ids_a, protocol.namespace_root(b"", swarm.dht_prefix))
        for hashes in (forged[: len(ids_b) // 16], [os.urandom(16) for _ in range(len(ids_b) // 16)]):
            result = run_direct(engine, route, ids_b, hashes)
            assert result.token_ids == expected_b and result.reused_tokens == 0
    # and the pages those sessions stored under the forged keys did not poison the orchestrator's sessions
    doc, head = complete(swarm, prompt_a)
    assert doc["choices"][0]["text"] == reference(prompt_a, 12)[1] and head["reused"] > 0


def test_prefix_evicted_between_dispatch_and_prefill_is_recomputed(swarm, engine, reference):
    for attempt in range(3):
        prompt = SHARED + f"Attempt {attempt}. Question: what did the keeper write down?"
        doc, head = complete(swarm, prompt)
        chain = next(c for c in HTTP.get(f"{swarm.url}/v1/swarm").json()["chains"]
                     if c["id"] == doc["chainswarm"]["chain_id"])
        names = chain["servers"]
        # another namespace's sessions fill that chain's stores: the prompt's pages are evicted (LRU), or were
        # never saved for lack of room; the orchestrator hears of either only with the servers' next report
        root = protocol.namespace_root(os.urandom(8), swarm.dht_prefix)
        for i in range(2):
            filler = engine.encode(f"Filler {attempt}.{i}: " + "the quick brown fox jumps over the lazy dog. " * 12)
            run_direct(engine, route_of(swarm, *names), filler, protocol.prompt_hashes(filler, root), 1)
        again, head = complete(swarm, prompt, max_tokens=12)
        assert again["choices"][0]["text"] == reference(prompt, 12)[1]
        if again["chainswarm"]["chain_id"] == chain["id"] and head["expected"] > head["reused"]:
            break  # the orchestrator expected a hit that the servers no longer had: recomputed correctly
    else:
        pytest.fail("never caught the orchestrator with a stale index")
    # the eviction reports reach the orchestrator's radix index
    wait_for(lambda: HTTP.get(f"{swarm.url}/v1/swarm").json()["prefix"]["evictions_applied"] > 0, 30,
             what="eviction reports applied")


# -- the orchestrator's radix index and locality on an in-memory DHT (no processes) ------------------------


def test_pages_a_save_could_not_keep_are_reported_like_evictions():
    from server.prefix_cache import PrefixStore

    page = torch.zeros(1, 1, 1, 16)
    store = PrefixStore(budget_bytes=2 * page.numel() * page.element_size())
    a, b, c = (bytes([i]) * 16 for i in (1, 2, 3))
    store.touch([a])
    assert store.put("blk", a, None, (page,), set()) and store.put("blk", b, a, (page,), set())
    store.touch([a, b], pin_s=60)  # both pinned (a probe): nothing may make room for the third page
    assert not store.put("blk", c, b, (page,), {c})
    before = store.report()
    assert store.report_unheld("blk", [b, c]) == 1  # b is held; c was never kept
    report = store.report()
    # the sequence moved, so the node's next heartbeat publishes the report (server.node._publish_prefix_report)
    assert report["evicted"] == [[1, c.hex()]] and report["seq"] == 1 and report["seq"] != before["seq"]
    assert store.report_unheld("other-block", [a]) == 1  # held, but not for that block


def test_a_save_is_sized_so_every_block_of_the_span_keeps_the_same_pages():
    """A save runs block by block; sized per block, the first block took the room and the span matched no page."""
    from server.prefix_cache import PrefixStore

    page = torch.zeros(1, 1, 1, 16)
    unit = page.numel() * page.element_size()
    store = PrefixStore(budget_bytes=5 * unit)
    other = bytes([9]) * 16
    assert store.put("a", other, None, (page,), set())
    store.touch([other], pin_s=60)  # another prompt's page, pinned by a probe: 4 units stay free
    hashes = [bytes([i]) * 16 for i in (1, 2, 3)]
    uids = ("a", "b")
    stored = {}
    for uid in uids:  # the backend's save op, one block after the other
        count = store.fit_span(uids, hashes, 0, 3, unit, set(hashes))
        stored[uid] = count
        for i in range(count):
            assert store.put(uid, hashes[i], hashes[i - 1] if i else None, (page,), set(hashes))
    assert stored == {"a": 2, "b": 2}  # both blocks the same two pages (sized per block: a 3, b 1)
    assert store.match(uids, hashes) == 2
    assert store.nbytes == 5 * unit
    # with the pin gone, the old page makes way for the whole prompt on both blocks
    store = PrefixStore(budget_bytes=6 * unit)
    assert store.put("a", other, None, (page,), set())
    assert store.fit_span(uids, hashes, 0, 3, unit, set(hashes)) == 3 and other not in store.pages
    assert store.fit_span(uids, hashes, 1, 3, unit, set(hashes)) == 2  # from a loaded prefix on
    # pages a block already holds need no room: block a holds all three, 3 units left are block b's
    store = PrefixStore(budget_bytes=6 * unit)
    for i, h in enumerate(hashes):
        assert store.put("a", h, hashes[i - 1] if i else None, (page,), set(hashes))
    assert store.fit_span(uids, hashes, 0, 3, unit, set(hashes)) == 3
    store.budget_bytes = 5 * unit
    assert store.fit_span(uids, hashes, 0, 3, unit, set(hashes)) == 2


def test_orchestrator_index_follows_dispatch_and_eviction_reports():
    import asyncio

    from swarm.control import planning
    from swarm.trust import records
    from swarm.control.orchestrator import Orchestrator, OrchestratorConfig

    expect = planning.Expectations(max_length=1024, input_tokens=64, output_tokens=16, arrival_rate=4.0,
                                   prefix_cache_tokens=256, kv_admission="slots")  # the chain layout it was written for
    dht, prefix = MemoryDHT(), "tiny-cs"

    def profile(node, mb, **kw):
        return records.ServerProfile(node_id=node, peer_id=f"peer-{node}", memory_bytes=int(mb * 1e6),
                                     block_bytes=200_000, cache_bytes_per_token=512, prefill_s=1e-5, decode_s=5e-4,
                                     rtt_s=0.001, **kw)

    sizes = {"a": 6, "b": 3, "c": 3}
    for node, mb in sizes.items():
        records.publish_profile(dht, prefix, profile(node, mb), ttl=10, owner=node_key(node))
    orch = Orchestrator(OrchestratorConfig(model_dir="unused", dht_prefix=prefix, num_blocks=4, expect=expect,
                                           policy="swarm", settle_s=0, reports_s=0), dht)  # reports: every refresh

    async def scenario():
        await orch.start()
        assigned = records.fetch_assignments(dht, prefix, orch.identity.public)
        assert all(a.prefix_cache_tokens == 256 for a in assigned.values() if a.end > a.start)
        # the planner saw block + prefix reservation: its model's block size includes 256 tokens of KV
        model, _ = planning.planner_inputs(list(records.fetch_profiles(dht, prefix).values()), 4, expect)
        assert model.block_size_gb * 1e9 == 200_000 + 512 * 256
        for node, a in assigned.items():
            served = dict(state=records.SERVING, start=a.start, end=a.end, cache_slots=a.cache_slots) \
                if a.end > a.start else {}
            records.publish_profile(dht, prefix, profile(node, sizes[node], **served), ttl=10, owner=node_key(node))
        await orch.refresh()
        chains = [c for c in orch.view.chains if c.ready]
        assert chains
        ids = list(range(100, 180))  # 5 pages
        hashes = orch.prompt_hashes(ids)
        assert len(hashes) == 5 and hashes != protocol.prompt_hashes(ids, protocol.namespace_root(b""))
        first = await orch.acquire("x", len(ids), 8, page_hashes=hashes)
        assert first.matched_tokens == 0
        chain = orch.chain(first.chain_id)
        assert orch.chain_cached_tokens(chain) == 80  # optimistic insert at dispatch, on every server
        orch.prefilled(first.request_id, 0, len(ids))
        second = await orch.acquire("x", len(ids) + 8, 8, page_hashes=hashes)
        assert second.chain_id == first.chain_id and second.matched_tokens == 80  # locality: the hit chain
        orch.prefilled(second.request_id, 48, len(ids) + 8, second.matched_tokens)  # servers had less
        assert orch.prefix_status()["stale"] == 1 and orch.prefix_status()["tokens_saved"] == 48
        orch.finish(first.request_id, 8)
        orch.finish(second.request_id, 8)
        # an eviction report from one server of the chain: pages 3.. are gone there, so the chain holds 3
        node = chain.servers[-1]
        # a report in the node's name signed by another key (a stranger's) is ignored: nothing is dropped
        stranger = Identity.generate().public
        protocol.publish_report(dht, prefix, node, {"epoch": "forged", "seq": 9, "evicted": []}, 10, owner=stranger)
        await orch.refresh()
        assert orch.chain_cached_tokens(chain) == 80 and orch.status()["prefix"]["resets"] == 0
        report = {"epoch": "e1", "seq": 2, "evicted": [[1, hashes[4].hex()], [2, hashes[3].hex()]]}
        protocol.publish_report(dht, prefix, node, report, 10, owner=node_key(node))
        await orch.refresh()
        assert orch.chain_cached_tokens(chain) == 48 and orch.prefix_index.longest_match(node, hashes) == 3
        # a gap in the sequence (lost reports) forgets what the node held
        protocol.publish_report(dht, prefix, node, {"epoch": "e1", "seq": 9, "evicted": [[9, "00" * 16]]}, 10,
                                owner=node_key(node))
        await orch.refresh()
        assert orch.prefix_index.longest_match(node, hashes) == 0 and orch.chain_cached_tokens(chain) == 0
        assert orch.status()["prefix"]["resets"] >= 1
        # and the operator can see which server was forgotten, and why
        resets = [e for e in orch.events if e["event"] == "prefix_index_reset"]
        assert [(e["node"], e["reason"]) for e in resets] == [
            (node, "evictions 3..8 missing from its reports (seq 9)")]
        # a reload its profile announces is followed even in a refresh whose read of the reports hangs: the index
        # forgets the server before the chains are brought up to date (and requests dispatched to its new pages)
        again = await orch.acquire("x", len(ids), 8, page_hashes=hashes)
        orch.finish(again.request_id, 8)
        assert orch.prefix_index.longest_match(node, hashes) == 5
        release, original = threading.Event(), dht.get

        def hanging_get(key, *args, **kwargs):
            if key.endswith(protocol.REPORTS):
                release.wait(30)
            return original(key, *args, **kwargs)

        dht.get, orch._reports_read.timeout_s = hanging_get, 0.2
        served = {n: dict(state=records.SERVING, start=a.start, end=a.end, cache_slots=a.cache_slots)
                  for n, a in assigned.items() if a.end > a.start}
        records.publish_profile(dht, prefix, profile(node, sizes[node], **served[node], prefix_epoch="e2"), ttl=10,
                                owner=node_key(node))
        orch._reports_read_at = 0.0
        await orch.refresh()
        assert orch._reports_read.timeouts == 1 and orch.prefix_index.longest_match(node, hashes) == 0
        assert [e["reason"] for e in orch.events if e["event"] == "prefix_index_reset"][-1] == \
            "new store epoch e2 (was e1)"
        release.set()
        dht.get = original
        await orch.stop()

    asyncio.run(scenario())


def test_a_reload_the_profile_announces_resets_the_index_before_dispatch_and_its_reports_do_not_again():
    """A server's store epoch travels in its profile record, with the state that makes its chains ready. Before, the
    orchestrator learnt of a reload only from the eviction reports, read every 2 s: a report of the new epoch read
    after requests had been dispatched (and indexed) under it dropped what the servers did hold, and every chain of
    the swarm said 0 cached tokens after real hits (the full suite's reuse test failed that way)."""
    from swarm.control.planning import RoutableChain
    from swarm.control.prefix_view import PrefixView

    view = PrefixView(128, b"secret", "tiny-cs")
    chain = RoutableChain("k", 0, ("a", "b"), ((0, 2), (2, 4)), 2, 1.0, (("pa", 0, 2), ("pb", 2, 4)), True)
    view.set_chains([chain])
    pages = view.prompt_hashes(list(range(64)))  # 4 pages
    # a and b were waiting (epoch w-a, w-b: what their stores were before the assignment), and said so
    view.follow_epochs({"a": "w-a", "b": "w-b"})
    view.apply_reports({"a": {"epoch": "w-a", "seq": 0, "evicted": []}, "b": {"epoch": "w-b", "seq": 0}}, {"a", "b"})
    # they load their blocks (new epochs) and their profiles say so when they serve: the chain is ready, dispatch
    view.follow_epochs({"a": "e-a", "b": "e-b"})
    view.dispatched("k", pages, 0.0)
    assert view.chain_cached_tokens(chain) == 64
    # the reports of the new epochs come later, one with an eviction; a stale one of the old epoch is ignored
    view.apply_reports({"a": {"epoch": "e-a", "seq": 1, "evicted": [[1, pages[3].hex()]]},
                        "b": {"epoch": "w-b", "seq": 5, "evicted": [[5, pages[0].hex()]]}}, {"a", "b"})
    assert view.chain_cached_tokens(chain) == 48 and view.drain_resets() == []
    view.apply_reports({"b": {"epoch": "e-b", "seq": 0, "evicted": []}}, {"a", "b"})
    assert view.chain_cached_tokens(chain) == 48 and view.drain_resets() == []
    # a restart or a reload announced later does forget what that server held, and says why
    view.follow_epochs({"a": "e-a", "b": "e-b2"})
    assert view.chain_cached_tokens(chain) == 0
    assert view.drain_resets() == [("b", "new store epoch e-b2 (was e-b)")]
    # a server that announces no epoch (an older one) is followed by its reports, as before
    old = PrefixView(128, b"secret", "tiny-cs")
    old.set_chains([chain])
    old.apply_reports({"a": {"epoch": "x", "seq": 0}, "b": {"epoch": "y", "seq": 0}}, {"a", "b"})
    old.follow_epochs({"a": None, "b": None})
    old.dispatched("k", pages, 0.0)
    old.apply_reports({"a": {"epoch": "x2", "seq": 0}}, {"a", "b"})
    assert old.chain_cached_tokens(chain) == 0 and old.drain_resets() == [("a", "new store epoch x2 (was x)")]


def test_a_session_that_reuses_a_prefix_is_batched_and_speculates(swarm, reference):
    """Through the HTTP API: a prompt whose pages are stored (the shared document) with a copy-heavy question, sent
    twice; the second reuses the stored pages on the batched path, where its decode steps carry drafted tokens,
    and its answer is the reference's. (Before the failover test, which kills a server; the shared pages are in
    the stores by now.)"""
    def drafted() -> float:
        metrics = HTTP.get(f"{swarm.url}/metrics").text
        return sum(float(line.split()[-1]) for line in metrics.splitlines()
                   if line.startswith("chainswarm_speculative_drafted_tokens"))

    prompt = SHARED + "Colours in order: " + "red, green, blue, yellow. " * 4
    first, _ = complete(swarm, prompt, max_tokens=16)
    before = drafted()
    again, head = complete(swarm, prompt, max_tokens=16)
    assert head["reused"] >= 32
    assert again["choices"][0]["text"] == first["choices"][0]["text"] == reference(prompt, 16)[1]
    assert drafted() > before


def test_failover_of_a_prefix_hit_session_restarts_from_the_full_tokens(swarm, reference):
    """Last in the module: kills a server. A session that reused a prefix cannot be replayed on a replacement
    server (it lacks the reused positions), so the engine restarts it from prompt + tokens so far."""
    import threading

    prompt = SHARED + "Question: tell the whole story of the harbour, the storm and the fire, in detail."
    complete(swarm, prompt, max_tokens=2)  # cache the prompt's pages
    outcome = {}

    def run():
        outcome["result"] = complete(swarm, prompt, max_tokens=96)

    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(1.0)
    status = HTTP.get(f"{swarm.url}/v1/swarm").json()
    busy = [c for c in status["chains"] if c["active"] > 0]
    victim = busy[0]["servers"][-1] if busy else "big"
    swarm.kill(swarm.nodes_by_name[victim])
    thread.join(180)
    doc, head = outcome["result"]
    assert doc["choices"][0]["text"] == reference(prompt, 96)[1]
    assert head["reused"] > 0
