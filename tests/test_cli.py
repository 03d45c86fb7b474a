"""The chainswarm command line: subcommands listed, bad input is a one-line error with exit code 2."""
import subprocess
import sys

import pytest


def chainswarm(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "swarm.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


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
])
def test_orchestrator_rejects_bad_input(tiny_model, args, message):
    argv = ["orchestrator", "--model", tiny_model, *args] if args[0] != "--model" else ["orchestrator", *args]
    result = chainswarm(*argv)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_orchestrator_rejects_impossible_expectations(tiny_model):
    result = chainswarm("orchestrator", "--model", tiny_model, "--max-length", "64",
                        "--expected-input-tokens", "60", "--expected-output-tokens", "10")
    assert result.returncode == 2 and "exceed max_length" in result.stderr


def test_generate_reports_an_unreachable_orchestrator():
    result = chainswarm("generate", "hi", "--orchestrator", "http://127.0.0.1:9", "--max-new-tokens", "2")
    assert result.returncode == 1 and "cannot reach" in result.stderr
