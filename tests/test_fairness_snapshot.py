"""export_state()/import_state(): a scheduler's fairness counters survive a JSON round trip exactly, and a
restored scheduler decides as the original would have."""
import json

import pytest

from planner.fairness import ChainSpec, make_scheduler


def _drive(s, t0=0.0):
    """A flooding client 'heavy' and a light client 'light' through two one-slot chains; everything finishes."""
    s.set_chains([ChainSpec("a", 1), ChainSpec("b", 1)])
    t = t0
    for i in range(6):
        s.submit(f"h{t0}-{i}", "heavy", 900, t, max_new_tokens=40)
    s.submit(f"l{t0}-0", "light", 100, t, max_new_tokens=10)
    while s.waiting() or s.running():
        for g in s.dispatch(t):
            s.on_prefill(g.request_id, 0, t)
            s.on_tokens(g.request_id, 7, t)
        t += 1.0
        for r in list(s.running()):
            s.on_finish(r.request_id, t, output_tokens=r.output_tokens + 3)
    return t


def _order(s, t):
    """Who is granted first when both clients send one request at once onto one slot."""
    s.set_chains([ChainSpec("a", 1)])
    s.submit("x-heavy", "heavy", 900, t, max_new_tokens=40)
    s.submit("x-light", "light", 900, t, max_new_tokens=40)
    return [g.client_id for g in s.dispatch(t)]


@pytest.mark.parametrize("policy", ["dlpm", "vtc", "swarm", "fcfs"])
def test_round_trip_is_exact(policy):
    s = make_scheduler(policy, **({"quantum": 1000.0} if policy in ("dlpm", "swarm") else {}))
    t = _drive(s)
    doc = json.loads(json.dumps(s.export_state()))
    fresh = make_scheduler(policy, **({"quantum": 1000.0} if policy in ("dlpm", "swarm") else {}))
    fresh.import_state(doc, now=123.0)
    assert fresh.export_state() == s.export_state()
    for c in ("heavy", "light"):
        assert fresh.service(c) == s.service(c)
        assert fresh.client_view_service(c) == s.client_view_service(c)
    if policy in ("dlpm", "swarm"):
        assert fresh.deficit("heavy") == s.deficit("heavy") and fresh.refills("heavy") == s.refills("heavy")
    if policy == "vtc":
        assert fresh.counter("heavy") == s.counter("heavy") and fresh.last_left == s.last_left
    # the restored scheduler goes on exactly as the original
    t2 = _drive(s, t)
    _drive(fresh, t)
    assert fresh.export_state() == s.export_state()
    assert _order(fresh, t2) == _order(s, t2)


def test_restored_deficit_changes_who_goes_first():
    """The counters matter: after the heavy client's flood, a restored DLPM serves the light client first;
    one that started fresh (what a restart without state did) serves the heavy client first (it came first)."""
    s = make_scheduler("dlpm", quantum=1000.0)
    t = _drive(s)
    assert s.deficit("heavy") < s.deficit("light")
    restored = make_scheduler("dlpm", quantum=1000.0)
    restored.import_state(s.export_state(), now=t)
    assert _order(restored, t) == ["light"]
    assert _order(make_scheduler("dlpm", quantum=1000.0), t) == ["heavy"]


def test_mismatched_or_malformed_state_is_refused_and_changes_nothing():
    s = make_scheduler("dlpm", quantum=1000.0)
    _drive(s)
    doc = s.export_state()
    with pytest.raises(ValueError, match="policy 'dlpm'"):
        make_scheduler("vtc").import_state(doc, now=0.0)
    bad = dict(doc, counters={"deficit": [["heavy", "lots"]], "refills": [], "refill_rounds": 0})
    target = make_scheduler("dlpm", quantum=1000.0)
    before = target.export_state()
    with pytest.raises(ValueError, match="malformed fairness state"):
        target.import_state(bad, now=0.0)
    assert target.export_state() == before
    with pytest.raises(ValueError, match="version"):
        target.import_state(dict(doc, version=99), now=0.0)
    busy = make_scheduler("dlpm", quantum=1000.0)
    busy.submit("r", "c", 10, 0.0)
    with pytest.raises(ValueError, match="no request queued or running"):
        busy.import_state(doc, now=0.0)
