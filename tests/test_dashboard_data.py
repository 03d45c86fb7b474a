"""What the dashboard reads besides the plan: the bounded per-client service history, membership and refusal
events, per-client deficits, and the pages themselves as the orchestrator serves them (the browser tests are
in tests/test_browser.py)."""
import asyncio
import re
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from swarm.api import web_pages
from swarm.control.orchestrator import QueueFull
from swarm.control.service_history import OTHER, ServiceHistory
from swarm.trust.identity import owned_subkey
from test_orchestrator_logic import PREFIX, node_key, profile, publish, records, run, serving_orchestrator


def test_service_history_keeps_per_period_deltas_bounded():
    h = ServiceHistory(period_s=2.0, samples=3, clients_per_sample=2)
    assert h.sample(100.0, {"a": 10.0}) and h.to_dict()["samples"] == []  # the first call is the baseline
    assert not h.sample(101.0, {"a": 50.0})  # within the period: nothing taken
    assert h.sample(102.0, {"a": 50.0, "b": 5.0})
    assert h.to_dict()["samples"] == [{"time": 102.0, "service": {"a": 40.0, "b": 5.0}}]
    h.sample(104.0, {"a": 50.0, "b": 5.0})  # nobody served: an empty sample (the chart shows the gap)
    h.sample(106.0, {"a": 51.0, "b": 8.0, "c": 20.0, "d": 4.0})  # the two largest, the rest as "other"
    h.sample(108.0, {"a": 51.0, "b": 8.0, "c": 20.0, "d": 4.0})
    samples = h.to_dict()["samples"]
    assert len(samples) == 3 and [s["time"] for s in samples] == [104.0, 106.0, 108.0]
    assert samples[1]["service"] == {"c": 20.0, "d": 4.0, OTHER: 4.0}  # a 1 + b 3
    with pytest.raises(ValueError):
        ServiceHistory(period_s=0)


def test_status_has_joins_leaves_refusals_deficits_and_service_history():
    async def scenario():
        orch, dht = await serving_orchestrator("dlpm", [profile("solo", 3)], max_queue_per_client=1)
        status = orch.status()
        assert status["num_blocks"] == 4 and status["torch_dtype"] == "float32"
        assert [e["node"] for e in status["events"] if e["event"] == "server_joined"] == ["solo"]
        orch.service_history.period_s = 1e-6  # sample on every refresh
        grant = await orch.acquire("alice", 50, 20, timeout=1)
        orch.tokens(grant.request_id, 5)
        orch.finish(grant.request_id, 5)
        await orch.refresh()
        status = orch.status()
        assert status["clients"]["alice"]["service"] > 0 and "deficit" in status["clients"]["alice"]
        served = [s["service"].get("alice", 0) for s in status["service_history"]["samples"]]
        assert sum(served) == pytest.approx(status["clients"]["alice"]["service"])
        # a refusal is an event
        capacity = sum(c.capacity for c in orch.view.chains)
        running = [await orch.acquire("bob", 10, 10, timeout=1) for _ in range(capacity)]
        waiting = asyncio.ensure_future(orch.acquire("bob", 10, 10, timeout=30))
        await asyncio.sleep(0.05)
        with pytest.raises(QueueFull):
            await orch.acquire("bob", 10, 10, timeout=1)
        for _ in range(3):
            with pytest.raises(QueueFull):
                await orch.acquire("bob", 10, 10, timeout=1)
        assert orch.status()["events"][-1] | {"time": 0} == {"time": 0, "event": "refused", "client": "bob",
                                                             "reason": "queue full", "count": 4}
        for g in running:
            orch.finish(g.request_id, 1)
        orch.finish((await waiting).request_id, 1)
        # a server whose record vanished has left
        publish(dht, profile("other", 3))
        await orch.refresh()
        dht.drop(f"{PREFIX}.{records.PROFILES}", owned_subkey("other", node_key("other")))
        await orch.refresh()
        kinds = [(e["event"], e.get("node")) for e in orch.status()["events"]]
        assert kinds.index(("server_joined", "other")) < kinds.index(("server_left", "other"))
        await orch.stop()

    run(scenario())


def test_pages_are_served_with_a_strict_policy_and_never_build_markup_from_data():
    app = FastAPI()
    app.include_router(web_pages.router)
    with TestClient(app) as http:
        for path, kind in [("/", "text/html"), ("/chat", "text/html"), ("/static/app.js", "text/javascript"),
                           ("/static/style.css", "text/css"), ("/static/favicon.svg", "image/svg+xml")]:
            response = http.get(path)
            assert response.status_code == 200 and response.headers["content-type"].startswith(kind), path
            assert "script-src 'self'" in response.headers["content-security-policy"]
        assert http.get("/static/index.html").status_code == 404
        assert http.get("/static/nothing.js").status_code == 404
        for page in ("/", "/chat"):  # every script and style is the orchestrator's own
            html = http.get(page).text
            assert re.findall(r'(?:src|href)="([^"]+)"', html) and all(
                ref.startswith("/") and not ref.startswith("//") for ref in re.findall(r'(?:src|href)="([^"]+)"', html))
            assert "<script>" not in html and " style=" not in html
    script = (Path(web_pages.__file__).parent / "web" / "app.js").read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
        assert sink not in script, f"app.js must not use {sink}"
