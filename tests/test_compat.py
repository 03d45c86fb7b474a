"""The hivemind/petals shim: without it petals does not import, with it petals imports offline-safe."""
import subprocess
import sys

import pytest


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=120)


def test_plain_petals_import_breaks_without_the_shim():
    result = _run("import petals")
    assert result.returncode != 0, "petals imports without the shim: swarm/model/compat.py may no longer be needed"
    assert "cannot import name" in result.stderr and "hivemind" in result.stderr


def test_petals_imports_through_the_shim_with_offline_patches():
    result = _run(
        "from swarm.model.compat import petals, HIVEMIND_TOP_LEVEL_NAMES\n"
        "import hivemind, petals.constants, petals.server.throughput as t, petals.utils.version as v\n"
        "from petals.server.server import Server\n"
        "missing = [n for names in HIVEMIND_TOP_LEVEL_NAMES.values() for n in names if not hasattr(hivemind, n)]\n"
        "assert not missing, missing\n"
        "assert petals.constants.PUBLIC_INITIAL_PEERS == []\n"
        "assert petals.__version__ == '2.2.0.post1'\n"
        "class C: hidden_size = 64\n"
        "assert t.measure_network_rps(C()) == 100e6 / (64 * 16)\n"
        "v.validate_version()\n"
        "print('ok')"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("ok")


def test_every_petals_submodule_imports_through_the_shim():
    result = _run(
        "from swarm.model.compat import petals\n"
        "import importlib, pkgutil\n"
        "bad = []\n"
        "for m in pkgutil.walk_packages(petals.__path__, 'petals.'):\n"
        "    try: importlib.import_module(m.name)\n"
        "    except Exception as e: bad.append((m.name, repr(e)))\n"
        "assert not bad, bad\n"
        "print('ok')"
    )
    assert result.returncode == 0, result.stderr[-3000:]
