"""The chainswarm command line: subcommands listed, bad input is a one-line error with exit code 2."""
import os
import subprocess
import sys
import time

import pytest


def chainswarm(*args, timeout=120, env=None):
    return subprocess.run([sys.executable, "-m", "swarm.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=None if env is None else {**os.environ, **env})


def test_help_lists_every_subcommand():
    result = chainswarm("--help")
    assert result.returncode == 0
    for name in ("demo", "orchestrator", "server", "generate", "plan", "simulate", "wan", "make-model"):
        assert name in result.stdout


def test_unknown_subcommand_exits_2():
    result = chainswarm("frobnicate")
    assert result.returncode == 2 and "invalid choice" in result.stderr


@pytest.mark.parametrize("args, message", [
    (["--model", "/no/such/model"], "not a model directory"),
    (["--http", "localhost"], "--http must be HOST:PORT"),
    (["--api-key", "justakey"], "--api-key must be KEY=CLIENT"),
    (["--batch-sessions", "-1"], "--batch-sessions must be between 0 and 1024"),
    (["--batch-lanes", "0"], "--batch-lanes must be between 1 and 16"),
    (["--failure-grace", "-5"], "--failure-grace must be between 0 and 86400 seconds"),
    (["--expect-servers", "-1"], "--expect-servers must be between 0 and 100000"),
    (["--http", "127.0.0.1:99999"], "--http must name a port between 0 and 65535, got 99999"),
    (["--dht-port", "-5"], "--dht-port must name a port between 0 and 65535, got -5"),  # was bound as 65531
    (["--max-length", "0"], "--max-length) must be at least 2 tokens, got 0"),  # was read as "the default"
])
def test_orchestrator_rejects_bad_input(tiny_model, args, message):
    argv = ["orchestrator", "--model", tiny_model, *args] if args[0] != "--model" else ["orchestrator", *args]
    result = chainswarm(*argv)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_api_keys_from_the_environment_are_checked_like_the_flag(tiny_model):
    result = chainswarm("orchestrator", "--model", tiny_model, env={"CHAINSWARM_API_KEYS": "k1=alice,justakey"})
    assert result.returncode == 2 and "CHAINSWARM_API_KEYS must be KEY=CLIENT" in result.stderr


def test_api_keys_match_in_constant_time_and_only_exactly():
    from swarm.api.app import match_api_key

    keys = {"s3cret-alice": "alice", "t0ken-bob": "bob"}
    assert match_api_key("t0ken-bob", keys) == "bob" and match_api_key("s3cret-alice", keys) == "alice"
    assert match_api_key("t0ken-bo", keys) is None and match_api_key("t0ken-bobx", keys) is None
    assert match_api_key("", keys) is None and match_api_key("é", keys) is None


def test_orchestrator_rejects_impossible_expectations(tiny_model):
    result = chainswarm("orchestrator", "--model", tiny_model, "--max-length", "64",
                        "--expected-input-tokens", "60", "--expected-output-tokens", "10")
    assert result.returncode == 2 and "exceed max_length" in result.stderr


def test_generate_reports_an_unreachable_orchestrator():
    began = time.monotonic()
    result = chainswarm("generate", "hi", "--orchestrator", "http://127.0.0.1:9", "--max-new-tokens", "2",
                        "--reconnect-s", "2")
    assert result.returncode == 1 and "cannot reach" in result.stderr
    assert 1 <= time.monotonic() - began < 30  # retried for about --reconnect-s, then gave up


UNREACHABLE = "/ip4/127.0.0.1/tcp/9/p2p/QmTvHSGBJKfBZ3aBbV4ki2kuyHRsX6vNe8oUhnLpkYKmH9"  # nothing listens on port 9


@pytest.mark.parametrize("argv, message", [
    (["server", "--join-timeout", "0", "--initial-peers", UNREACHABLE],
     f"cannot reach any initial peer ({UNREACHABLE}): is the orchestrator"),
    (["orchestrator", "--ephemeral", "--dht-port", "{port}"], "cannot listen on 127.0.0.1:{port}: the address is "
                                                              "already in use (choose another --dht-port)"),
    (["orchestrator", "--ephemeral", "--http", "127.0.0.1:{port}"], "cannot listen on 127.0.0.1:{port} (--http)"),
])
def test_a_peer_that_cannot_start_says_why_in_one_line(tiny_model, argv, message):
    """What a volunteer or an operator gets wrong first — a port another process holds, the orchestrator's address
    mistyped or the orchestrator not up — is one line naming the address and the option, exit code 2, and no
    process left behind (it was a traceback from inside hivemind)."""
    import socket

    import psutil

    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        result = chainswarm(*(a.replace("{port}", port) for a in argv), "--model", tiny_model, timeout=180)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2, result.stderr
        assert lines[-1].startswith(f"chainswarm {argv[0]}: error: " + message.replace("{port}", port)), lines[-1]
        assert "Traceback" not in result.stderr
        # the daemons of these peers name the unreachable peer or the port in their command lines
        marks = (UNREACHABLE.rpartition("/")[2], f"/tcp/{port}")
        left = [p.pid for p in psutil.process_iter(["name", "cmdline"])
                if p.info["name"] == "p2pd" and any(m in " ".join(p.info["cmdline"] or []) for m in marks)]
        assert not left, f"libp2p daemons left behind: {left}"


def test_a_server_whose_initial_peers_are_down_keeps_trying_then_says_why(tiny_model):
    """A server started before its orchestrator (a reboot, a power cut) does not exit at the first try: it says
    once a try that it cannot reach the swarm yet and tries again, until --join-timeout; then the one line."""
    began = time.monotonic()
    result = chainswarm("server", "--model", tiny_model, "--initial-peers", UNREACHABLE, "--join-timeout", "5",
                        timeout=180)
    took = time.monotonic() - began
    assert result.returncode == 2, result.stderr
    tries = [line for line in result.stderr.splitlines() if "cannot reach the swarm yet" in line]
    assert len(tries) >= 2, result.stderr  # waits 2 s, then 3 s (what is left): three tries in all
    assert "giving up in" in tries[0] and UNREACHABLE in tries[0]
    assert result.stderr.strip().splitlines()[-1].startswith(
        f"chainswarm server: error: cannot reach any initial peer ({UNREACHABLE})")
    assert "Traceback" not in result.stderr
    assert took >= 5


@pytest.mark.filterwarnings("ignore:path is deprecated:DeprecationWarning")  # hivemind's own use of importlib
def test_the_libp2p_daemons_own_start_failures_read_as_one_line():
    """The daemon's real messages (a port in use, no initial peer answering) become the one-line reasons; any other
    exception, or a daemon error after the start, is left alone (its traceback kept)."""
    import asyncio
    import socket

    from hivemind.p2p import P2P
    from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError

    from swarm.runtime.dht import p2p_start_failure

    async def failure(**options):
        try:
            p2p = await P2P.create(**options)
        except P2PDaemonError as exc:
            return exc
        await p2p.shutdown()
        raise AssertionError(f"the daemon started with {options}")

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        in_use = asyncio.run(failure(host_maddrs=[f"/ip4/127.0.0.1/tcp/{port}"]))
    unreachable = asyncio.run(failure(initial_peers=[UNREACHABLE]))
    assert str(p2p_start_failure(in_use, option="--port")) == (
        f"cannot listen on 127.0.0.1:{port}: the address is already in use (choose another --port)")
    assert str(p2p_start_failure(unreachable, [UNREACHABLE], hint="check them")) == (
        f"cannot reach any initial peer ({UNREACHABLE}): check them")
    assert p2p_start_failure(ValueError("x")) is None
    assert p2p_start_failure(P2PDaemonError("stream reset")) is None


@pytest.mark.parametrize("args, message", [
    (["fig3", "--runs", "0"], "--runs must be at least 1"),
    (["fig3", "--jobs", "-5"], "--jobs must be at least 100"),
    (["fairness", "--policies", "nope"], "unknown policy 'nope'"),
])
def test_simulate_rejects_bad_input_in_one_line(tmp_path, args, message):
    result = chainswarm("simulate", *args, "--out", str(tmp_path))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("chainswarm simulate") and ": error: " in lines[0] and message in lines[0], lines
    assert not any(tmp_path.iterdir())  # nothing written
