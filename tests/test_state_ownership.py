"""A state directory belongs to one model (swarm.state.ownership): keyed by the checkpoint's fingerprint, never
loaded for another model, the earlier layout read or moved once."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from swarm.state import ownership
from swarm.state.store import StateDir, StateError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def two_models_one_name(tmp_path_factory):
    """Two random checkpoints of one shape and other weights, each in a folder called ``model``."""
    from swarm.model.checkpoint import TinyModelSpec, make_random_model

    root = tmp_path_factory.mktemp("same-name")
    return (str(make_random_model(root / "a" / "model", TinyModelSpec(seed=1))),
            str(make_random_model(root / "b" / "model", TinyModelSpec(seed=2))))


def test_the_fingerprint_tells_checkpoints_apart_and_follows_a_moved_one(two_models_one_name, tmp_path):
    a, b = two_models_one_name
    assert ownership.model_fingerprint(a) != ownership.model_fingerprint(b)  # same config, other weights
    moved = shutil.copytree(a, tmp_path / "elsewhere")
    assert ownership.model_fingerprint(moved) == ownership.model_fingerprint(a)
    config = json.loads((moved / "config.json").read_text())
    (moved / "config.json").write_text(json.dumps(config, indent=7))  # the same config, spelled otherwise
    assert ownership.model_fingerprint(moved) == ownership.model_fingerprint(a)
    (moved / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-3}))
    assert ownership.model_fingerprint(moved) != ownership.model_fingerprint(a)


def test_two_models_in_folders_of_one_name_get_two_state_directories(two_models_one_name, tmp_path):
    a, b = (ownership.ModelIdentity.of(m, "model-cs") for m in two_models_one_name)
    dir_a, dir_b = ownership.default_dir(a, 4, root=tmp_path), ownership.default_dir(b, 4, root=tmp_path)
    assert dir_a != dir_b and dir_a.parent == dir_b.parent == tmp_path / "orchestrator"
    assert dir_a.name == f"model-cs-{a.fingerprint}"


def test_a_state_directory_is_claimed_once_and_refused_to_another_model(two_models_one_name, tmp_path):
    a, b = (ownership.ModelIdentity.of(m, "model-cs") for m in two_models_one_name)
    store = StateDir(tmp_path / "state")
    assert ownership.claim(store, a, 4) == "new"
    store.record_peers(["/ip4/127.0.0.1/tcp/1/p2p/QmTvHSGBJKfBZ3aBbV4ki2kuyHRsX6vNe8oUhnLpkYKmH9"])
    assert ownership.claim(StateDir(store.path), a, 4) == "same"
    with pytest.raises(StateError) as err:
        ownership.claim(StateDir(store.path), b, 4)
    message = str(err.value)
    assert "belongs to another model" in message and a.fingerprint in message and b.fingerprint in message
    assert str(store.path) in message and "\n" not in message
    other_prefix = ownership.ModelIdentity("other-cs", a.fingerprint, a.model_dir)
    with pytest.raises(StateError, match="belongs to another model"):
        ownership.claim(StateDir(store.path), other_prefix, 4)
    assert json.loads(store.file(ownership.MODEL_FILE).read_text())["fingerprint"] == a.fingerprint


def test_state_of_an_earlier_version_is_adopted_unless_its_plan_is_for_another_model(two_models_one_name, tmp_path):
    a = ownership.ModelIdentity.of(two_models_one_name[0], "model-cs")
    old = StateDir(tmp_path / "old")
    old.write(StateDir.PLAN, {"plan_id": "p1", "num_blocks": 4})
    assert ownership.claim(old, a, 4) == "adopted"
    assert (old.path / ownership.MODEL_FILE).exists()
    other = StateDir(tmp_path / "other")
    other.write(StateDir.PLAN, {"plan_id": "p1", "num_blocks": 30})
    with pytest.raises(StateError, match="plan for 30 blocks"):
        ownership.claim(other, a, 4)
    assert not (other.path / ownership.MODEL_FILE).exists()


def test_the_earlier_default_layout_is_moved_once(two_models_one_name, tmp_path):
    a, b = (ownership.ModelIdentity.of(m, "model-cs") for m in two_models_one_name)
    legacy = StateDir(tmp_path / "orchestrator" / "model-cs")  # keyed by the folder's name only
    legacy.write(StateDir.PLAN, {"plan_id": "p1", "num_blocks": 4})
    key = legacy.identity_path()
    peer = legacy.peer_id()
    target = ownership.default_dir(a, 4, root=tmp_path)
    assert target.name == f"model-cs-{a.fingerprint}" and not legacy.path.exists()
    assert StateDir(target).peer_id() == peer and not Path(key).exists()
    ownership.claim(StateDir(target), a, 4)
    # the other model of that folder name starts afresh in its own directory; nothing is moved twice
    assert ownership.default_dir(b, 4, root=tmp_path) == tmp_path / "orchestrator" / f"model-cs-{b.fingerprint}"
    assert not (tmp_path / "orchestrator" / f"model-cs-{b.fingerprint}").exists()


def test_an_earlier_directory_of_another_model_is_not_moved(two_models_one_name, tmp_path):
    a = ownership.ModelIdentity.of(two_models_one_name[0], "model-cs")
    legacy = StateDir(tmp_path / "orchestrator" / "model-cs")
    legacy.write(StateDir.PLAN, {"plan_id": "p1", "num_blocks": 30})
    target = ownership.default_dir(a, 4, root=tmp_path)
    assert legacy.path.exists() and not target.exists()


def test_the_cli_refuses_another_models_state_directory_in_one_line(two_models_one_name, tmp_path):
    a, b = two_models_one_name
    state = StateDir(tmp_path / "state")
    ownership.claim(state, ownership.ModelIdentity.of(a, "model-cs"), 4)
    result = subprocess.run([sys.executable, "-m", "swarm.cli", "orchestrator", "--model", b, "--state-dir",
                             str(state.path), "--http", "127.0.0.1:0"], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(f"chainswarm orchestrator: error: state directory {state.path} belongs to another model")
    assert "Traceback" not in result.stderr and not state.file("node.json").exists()  # nothing of it was touched
