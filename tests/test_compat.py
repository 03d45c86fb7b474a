"""The hivemind/petals shim: without it petals does not import, with it petals imports offline-safe."""
import subprocess
import sys

import pytest


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=120)


def _assert_runs(code: str) -> None:
    """``code`` (which ends by printing ok) runs to its end in a fresh interpreter."""
    result = _run(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("ok")


def test_plain_petals_import_breaks_without_the_shim():
    result = _run("import petals")
    assert result.returncode != 0, "petals imports without the shim: swarm/model/compat.py may no longer be needed"
    assert "cannot import name" in result.stderr and "hivemind" in result.stderr


def test_petals_imports_through_the_shim_with_offline_patches():
    _assert_runs(
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


def test_a_server_block_runs_without_bitsandbytes(tmp_path):
    """bitsandbytes (90 MB of CUDA binaries) is optional: petals' backend of an unquantized block is built and
    steps without it; adapters and quantized blocks are then refused with errors that name it."""
    _assert_runs(
        "import sys; sys.modules['bitsandbytes'] = None  # as on a host where it is not installed\n"
        "from swarm.model.compat import petals\n"
        "import importlib.util, torch\n"
        "from petals.utils.convert_block import QuantType, quantize_module\n"
        "from server.batch_profile import decode_step_times, load_backends\n"
        "from swarm.model.checkpoint import TinyModelSpec, make_random_model\n"
        f"model = make_random_model({str(tmp_path / 'm')!r}, TinyModelSpec(layers=2))\n"
        "backends = load_backends(str(model), range(2))\n"
        "times = decode_step_times(backends, (1, 2), context=8, repeats=1)\n"
        "assert all(t > 0 for row in times.values() for t in row.values()) and len(times) == 2, times\n"
        "peft = sys.modules['petals.utils.peft']\n"
        "with peft.using_adapter(None): pass\n"
        "try:\n    peft.using_adapter('lora-a').__enter__(); raise SystemExit('adapter accepted')\n"
        "except ValueError as e: assert 'bitsandbytes' in str(e), e\n"
        "try:\n    from petals.utils.peft import load_peft; raise SystemExit('load_peft imported')\n"
        "except ImportError as e: assert 'bitsandbytes' in str(e), e\n"
        "try:\n    quantize_module(torch.nn.Linear(4, 4), quant_type=QuantType.INT8); raise SystemExit('quantized')\n"
        "except ImportError as e: assert 'bitsandbytes' in str(e), e\n"
        "assert importlib.util.find_spec('bitsandbytes') is None\n"
        "print('ok')"
    )


def test_only_servers_load_bitsandbytes_and_it_prints_nothing():
    """The orchestrator's stack never imports bitsandbytes (0.45 CPU-s of every orchestrator's start); petals'
    server code does, for every block, and the shim has it imported first with its CPU-host notice swallowed."""
    result = _run(
        "import sys, warnings\n"
        "import swarm.service, swarm.engine.petals_client\n"
        "assert 'bitsandbytes' not in sys.modules and 'scipy.stats' not in sys.modules\n"
        "with warnings.catch_warnings(record=True) as seen:  # as pytest records them\n"
        "    warnings.simplefilter('always')\n"
        "    import petals.utils.peft\n"
        "assert 'bitsandbytes' in sys.modules\n"
        "assert not [w for w in seen if 'bitsandbytes' in str(w.filename)], [str(w.message) for w in seen]\n"
        "print('ok')"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok", result.stdout
