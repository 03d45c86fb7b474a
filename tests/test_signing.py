"""The signed control plane without processes: keys, owned subkeys, the DHT validators, node-id pins, the
orchestrator trust of a server, session tickets and the server's ticket gate (tests/test_hostile_peer.py runs the
same protections against a hostile peer on a live swarm)."""
from __future__ import annotations

import dataclasses

import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.timed_storage import get_dht_time

from swarm.trust import prefix as protocol, records, tickets
from swarm.trust.identity import BadKeyError, Identity, KeyPins, parse_public_key, split_subkey
from swarm.trust.validation import swarm_validators
from test_orchestrator_logic import MemoryDHT, profile

PREFIX = "tiny-cs"
ORCH, NODE, STRANGER = Identity.generate(), Identity.generate(), Identity.generate()


# -- keys -------------------------------------------------------------------------------------------------


def test_keys_load_from_files_and_parse_in_every_form(tmp_path):
    path = tmp_path / "node.der"
    made = Identity.load_or_create(path)
    assert (path.stat().st_mode & 0o777) == 0o600
    assert Identity.load_or_create(path).public == made.public  # stable across restarts
    assert parse_public_key(made.public.decode()) == made.public
    assert parse_public_key(made.public_b64) == made.public
    (tmp_path / "orch.pub").write_bytes(made.public + b" comment@host\n")
    assert parse_public_key(str(tmp_path / "orch.pub")) == made.public
    for bad in ("not a key", "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIB", str(tmp_path / "missing.pub")):
        with pytest.raises(BadKeyError):
            parse_public_key(bad)
    (tmp_path / "garbage.der").write_bytes(b"garbage")
    with pytest.raises(BadKeyError):
        Identity.load_or_create(tmp_path / "garbage.der")


def test_owned_subkeys_round_trip_and_reject_lookalikes():
    assert split_subkey(NODE.subkey("n1")) == ("n1", NODE.public)
    assert split_subkey("n1") is None and split_subkey(b"n1") is None
    assert split_subkey(NODE.subkey(ORCH.subkey("n1"))) is None  # two owners in one subkey


# -- the DHT validators ------------------------------------------------------------------------------------


def _record(kind: str, subkey: str, value) -> DHTRecord:
    return DHTRecord(DHTID.generate(source=f"{PREFIX}.{kind}").to_bytes(), MSGPackSerializer.dumps(subkey),
                     MSGPackSerializer.dumps(value), get_dht_time() + 30)


def _signed(identity: Identity, record: DHTRecord) -> DHTRecord:
    """What the writer's DHT stores: the value signed by the writer's validators."""
    return dataclasses.replace(record, value=CompositeValidator(swarm_validators(identity, PREFIX)).sign_value(record))


def _accepts(record: DHTRecord) -> bool:
    """What any honest peer's DHT (its own key does not matter for validation) accepts."""
    return CompositeValidator(swarm_validators(Identity.generate(), PREFIX)).validate(record)


def test_validators_accept_records_signed_by_the_key_their_subkey_names():
    good = profile("n1", 3).to_dict() | {"node_id": "n1"}
    assert _accepts(_signed(NODE, _record(records.PROFILES, NODE.subkey("n1"), good)))
    assignment = records.Assignment("p", 0, 2, 1, 64).to_dict()
    assert _accepts(_signed(ORCH, _record(records.ASSIGNMENTS, ORCH.subkey("n1"), assignment)))
    info = records.OrchestratorInfo("peer").to_dict()
    assert _accepts(_signed(ORCH, _record(records.ORCHESTRATOR, ORCH.subkey("main"), info)))
    report = {"epoch": "e", "seq": 1, "evicted": [[1, "00" * 16]]}
    assert _accepts(_signed(NODE, _record(protocol.REPORTS, NODE.subkey("n1"), report)))
    # petals' own records (and anything else outside Chainswarm's keys) are not touched
    petals_record = DHTRecord(DHTID.generate(source=f"{PREFIX}.0").to_bytes(), MSGPackSerializer.dumps("peer"),
                              MSGPackSerializer.dumps((2, 1.0, {})), get_dht_time() + 30)
    assert _accepts(petals_record)


def test_validators_refuse_forged_unowned_and_malformed_records():
    assignment = records.Assignment("p", 0, 2, 1, 64).to_dict()
    # a stranger signs an assignment in the orchestrator's name: the signature does not match the subkey's key
    forged = _signed(STRANGER, _record(records.ASSIGNMENTS, ORCH.subkey("victim"), assignment))
    assert not _accepts(forged)
    stranger_sig = _signed(STRANGER, _record(records.ASSIGNMENTS, STRANGER.subkey("victim"), assignment))
    assert not _accepts(dataclasses.replace(forged, value=stranger_sig.value))  # a signature moved over
    # the value changed after signing (the expiration is signed too)
    signed = _signed(ORCH, _record(records.ASSIGNMENTS, ORCH.subkey("victim"), assignment))
    tampered = assignment | {"end": 4}
    assert not _accepts(dataclasses.replace(signed, value=signed.value.replace(
        MSGPackSerializer.dumps(assignment), MSGPackSerializer.dumps(tampered))))
    assert not _accepts(dataclasses.replace(signed, expiration_time=signed.expiration_time + 3600))
    # unowned subkeys are refused under Chainswarm's keys
    assert not _accepts(_record(records.ASSIGNMENTS, "victim", assignment))
    assert not _accepts(_record(records.ORCHESTRATOR, "main", records.OrchestratorInfo("peer").to_dict()))
    # malformed values are refused even when properly signed
    for kind, value in ((records.ASSIGNMENTS, assignment | {"start": "zero"}),
                        (records.ASSIGNMENTS, assignment | {"start": 3, "end": 1}),
                        (records.PROFILES, profile("someone-else", 3).to_dict()),  # node id != subkey name
                        (protocol.REPORTS, {"epoch": 1, "seq": "x"}),
                        (records.ORCHESTRATOR, "not a mapping")):
        assert not _accepts(_signed(ORCH, _record(kind, ORCH.subkey("victim"), value))), (kind, value)
    assert not _accepts(_signed(ORCH, _record(records.ORCHESTRATOR, ORCH.subkey("other"),
                                              records.OrchestratorInfo("peer").to_dict())))


def test_a_validator_verifies_each_signed_record_once_and_still_refuses_every_forgery(monkeypatch):
    """The same signed record, received again, is answered from the validator's memory (no second RSA check);
    anything that differs in one byte — a moved signature, a changed value or expiration — is checked afresh."""
    from hivemind.utils.crypto import RSAPublicKey

    checks = []
    verify = RSAPublicKey.verify
    monkeypatch.setattr(RSAPublicKey, "verify", lambda self, data, sig: checks.append(1) or verify(self, data, sig))
    peer = CompositeValidator(swarm_validators(Identity.generate(), PREFIX))  # one peer's DHT, many receptions
    assignment = records.Assignment("p", 0, 2, 1, 64).to_dict()
    signed = _signed(ORCH, _record(records.ASSIGNMENTS, ORCH.subkey("n1"), assignment))
    assert all(peer.validate(signed) for _ in range(5)) and len(checks) == 1
    forged = _signed(STRANGER, _record(records.ASSIGNMENTS, ORCH.subkey("n1"), assignment))
    tampered = dataclasses.replace(signed, value=signed.value.replace(
        MSGPackSerializer.dumps(assignment), MSGPackSerializer.dumps(assignment | {"end": 4})))
    bad = (forged, tampered, dataclasses.replace(signed, expiration_time=signed.expiration_time + 3600))
    assert not any(peer.validate(record) for record in bad)
    assert len(checks) == 1 + 2  # the tampered copies are checked (the unsigned forgery fails before any check)
    assert not any(peer.validate(record) for record in bad) and len(checks) == 3  # refused again from memory
    assert peer.validate(signed) and len(checks) == 3


# -- readers: who is believed -----------------------------------------------------------------------------


def test_readers_believe_only_the_owner_they_name():
    dht = MemoryDHT()
    records.publish_assignment(dht, PREFIX, "n1", records.Assignment("real", 0, 2, 1, 64), 30, ORCH.public)
    records.publish_assignment(dht, PREFIX, "n2", records.Assignment("fake", 0, 4, 1, 64), 30, STRANGER.public)
    assert {n: a.plan_id for n, a in records.fetch_assignments(dht, PREFIX, ORCH.public).items()} == {"n1": "real"}
    records.publish_orchestrator(dht, PREFIX, records.OrchestratorInfo("real-peer"), 30, ORCH.public)
    records.publish_orchestrator(dht, PREFIX, records.OrchestratorInfo("fake-peer"), 30, STRANGER.public)
    assert records.fetch_orchestrator(dht, PREFIX, ORCH.public).peer_id == "real-peer"
    assert records.fetch_orchestrator(dht, PREFIX, None) is None
    protocol.publish_report(dht, PREFIX, "n1", {"epoch": "real", "seq": 1, "evicted": []}, 30, NODE.public)
    protocol.publish_report(dht, PREFIX, "n1", {"epoch": "fake", "seq": 1, "evicted": []}, 30, STRANGER.public)
    assert protocol.fetch_reports(dht, PREFIX, {"n1": NODE.public})["n1"]["epoch"] == "real"
    assert protocol.fetch_reports(dht, PREFIX, {}) == {}


def test_a_second_key_cannot_take_a_live_node_id():
    pins = KeyPins()
    first, events = pins.select({"n1": {NODE.public: "profile-1"}})
    assert first == {"n1": "profile-1"} and not events
    chosen, refused = pins.select({"n1": {NODE.public: "profile-1", STRANGER.public: "impostor"}})
    assert chosen == {"n1": "profile-1"} and refused == [("n1", STRANGER.fingerprint)]
    # the first key's record expired: the node id is free, the other key takes it
    assert pins.select({"n1": {STRANGER.public: "restarted"}})[0] == {"n1": "restarted"}
    # two keys at once for a node id nobody holds: neither is believed
    chosen, refused = KeyPins().select({"n2": {NODE.public: "a", STRANGER.public: "b"}})
    assert chosen == {} and len(refused) == 2


def test_orchestrator_refuses_a_second_key_for_a_live_node_id():
    import asyncio

    from test_orchestrator_logic import make, node_key, publish

    async def scenario():
        orch, dht = make()
        publish(dht, profile("a", 6), profile("b", 3))
        await orch.start()
        records.publish_profile(dht, PREFIX, profile("a", 60), 30, owner=STRANGER.public)  # 10x the memory
        await orch.refresh()
        assert orch.view.profiles["a"].memory_bytes == profile("a", 6).memory_bytes
        assert any(e["event"] == "server_key_refused" and e["node"] == "a" for e in orch.events)
        assert orch.pins.owner("a") == node_key("a")
        await orch.stop()

    asyncio.run(scenario())


# -- a server's orchestrator trust ---------------------------------------------------------------------------


def test_server_pins_the_given_key_or_exactly_one_on_first_use():
    from server.trust import OrchestratorTrust, WrongOrchestratorKey

    dht = MemoryDHT()
    tofu = OrchestratorTrust(None)
    assert tofu.key(dht, PREFIX) is None  # nobody published yet
    records.publish_orchestrator(dht, PREFIX, records.OrchestratorInfo("p"), 30, ORCH.public)
    records.publish_orchestrator(dht, PREFIX, records.OrchestratorInfo("q"), 30, STRANGER.public)
    assert tofu.key(dht, PREFIX) is None  # two keys: no guess
    dht.drop(f"{PREFIX}.{records.ORCHESTRATOR}", STRANGER.subkey("main"))
    assert tofu.key(dht, PREFIX) == ORCH.public and tofu.source == "first use"
    records.publish_orchestrator(dht, PREFIX, records.OrchestratorInfo("q"), 30, STRANGER.public)
    dht.drop(f"{PREFIX}.{records.ORCHESTRATOR}", ORCH.subkey("main"))
    assert tofu.key(dht, PREFIX) == ORCH.public  # pinned for the life of the process
    OrchestratorTrust(STRANGER.public).check_at_start(dht, PREFIX, check_s=0.1)  # its orchestrator is there
    with pytest.raises(WrongOrchestratorKey, match=f"given {ORCH.fingerprint}.*signed by {STRANGER.fingerprint}"):
        OrchestratorTrust(ORCH.public).check_at_start(dht, PREFIX, check_s=0.1)
    OrchestratorTrust(ORCH.public).check_at_start(MemoryDHT(), PREFIX, check_s=0.1)  # no orchestrator yet: wait


# -- tickets ----------------------------------------------------------------------------------------------


ROUTE = [("peerA", 0, 2), ("peerB", 2, 4)]


def _mint(identity=ORCH, **kw):
    args = dict(request_id="r1", chain_id="c1", route=ROUTE, max_length=64) | kw
    return tickets.mint(identity, **args)


def test_a_ticket_grants_exactly_its_route_until_it_expires():
    ticket = tickets.verify(_mint(), ORCH.public, peer_id="peerB", start=2, end=4)
    assert (ticket.request_id, ticket.chain_id, ticket.route, ticket.pages) == ("r1", "c1", tuple(ROUTE), None)
    assert tickets.verify(_mint(), ORCH.public, peer_id="peerA", start=1, end=2)  # a sub-span (after failover)
    refusals = {
        "no ticket": (None, "peerA", 0, 2),
        "not signed by this swarm's orchestrator": (_mint(STRANGER), "peerA", 0, 2),
        "expired": (_mint(ttl_s=-1), "peerA", 0, 2),
        "does not grant blocks [0, 4)": (_mint(), "peerA", 0, 4),
        "does not grant blocks [0, 2)": (_mint(), "peerC", 0, 2),
        "malformed": (b"\x93garbage", "peerA", 0, 2),
    }
    for reason, (blob, peer, start, end) in refusals.items():
        with pytest.raises(tickets.TicketError, match=reason.replace("[", r"\[").replace(")", r"\)")):
            tickets.verify(blob, ORCH.public, peer_id=peer, start=start, end=end)
    # a body changed after signing (a longer route, a later expiry) no longer verifies
    doc = MSGPackSerializer.loads(_mint())
    body = MSGPackSerializer.loads(doc["body"])
    body["route"].append(["peerC", 0, 4])
    forged = MSGPackSerializer.dumps({"body": MSGPackSerializer.dumps(body), "sig": doc["sig"]})
    with pytest.raises(tickets.TicketError, match="not signed"):
        tickets.verify(forged, ORCH.public, peer_id="peerC", start=0, end=4)


def test_the_ticket_gate_and_prefix_writes():
    from server import tickets as gate

    hashes = [bytes([i]) * 16 for i in range(3)]
    uids = ["tiny-cs.2", "tiny-cs.3"]
    try:
        gate.configure(open=True, orchestrator_key=None, peer_id="peerB", dht_prefix="tiny-cs")
        assert gate.check({}, uids) is None
        gate.configure(open=False, orchestrator_key=None, peer_id="peerB", dht_prefix="tiny-cs")
        with pytest.raises(tickets.TicketError, match="no orchestrator key"):
            gate.check({tickets.META_KEY: _mint()}, uids)
        gate.configure(open=False, orchestrator_key=ORCH.public, peer_id="peerB", dht_prefix="tiny-cs")
        assert gate.check({tickets.META_KEY: _mint()}, uids).chain_id == "c1"
        for bad_uids in (["tiny-cs.1", "tiny-cs.2"], ["tiny-cs.2", "tiny-cs.4"], ["other.2"], []):
            with pytest.raises(tickets.TicketError):
                gate.check({tickets.META_KEY: _mint()}, bad_uids)
        with pytest.raises(tickets.TicketError, match="no ticket"):
            gate.check({}, uids)
        # prefix pages are stored only under the hashes whose digest the session's ticket carries
        handler = gate.TicketHandler.__new__(gate.TicketHandler)
        for blob, allowed in ((_mint(page_hashes=hashes), True), (_mint(), False),
                              (_mint(page_hashes=hashes[:2]), False)):
            token = gate._TICKET.set(gate.check({tickets.META_KEY: blob}, uids))
            try:
                assert handler._may_store_pages(hashes) is allowed
            finally:
                gate._TICKET.reset(token)
    finally:
        gate.configure(open=False, orchestrator_key=None, peer_id=None, dht_prefix=None)


def test_a_node_obeys_only_assignments_signed_by_its_orchestrator_key():
    """server.assignments.AssignmentInbox (what a ChainswarmServer reads its assignment with) on an in-memory DHT."""
    from server.assignments import AssignmentInbox
    from server.trust import OrchestratorTrust

    dht = MemoryDHT()
    inbox = AssignmentInbox(dht, PREFIX, "n0", OrchestratorTrust(ORCH.public), num_layers=4)
    records.publish_assignment(dht, PREFIX, "n0", records.Assignment("evil", 0, 4, 1, 64), 30, STRANGER.public)
    records.publish_assignment(dht, PREFIX, "n1", records.Assignment("other", 0, 2, 1, 64), 30, ORCH.public)
    assert inbox.fetch() is None  # the only assignment for n0 is a stranger's
    records.publish_assignment(dht, PREFIX, "n0", records.Assignment("real", 0, 2, 1, 64), 30, ORCH.public)
    assert inbox.fetch().plan_id == "real"
    tofu = AssignmentInbox(dht, PREFIX, "n0", OrchestratorTrust(None), num_layers=4)
    assert tofu.fetch() is None  # no orchestrator record yet: no key, nothing obeyed
    records.publish_orchestrator(dht, PREFIX, records.OrchestratorInfo("p"), 30, ORCH.public)
    assert tofu.fetch().plan_id == "real" and tofu.trust.pinned == ORCH.public
    tofu.failed(tofu.fetch())
    assert tofu.fetch() is None  # failed to load: not again until the orchestrator changes it
    records.publish_assignment(dht, PREFIX, "n0", records.Assignment("real", 0, 6, 1, 64), 30, ORCH.public)
    assert tofu.fetch() is None  # blocks past the model's end are refused
    records.publish_assignment(dht, PREFIX, "n0", records.Assignment("next", 1, 3, 1, 64), 30, ORCH.public)
    assert tofu.fetch().plan_id == "next"
