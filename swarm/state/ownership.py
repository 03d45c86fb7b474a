"""Which model a state directory belongs to, and where a model's state lives by default.

An orchestrator's state (remembered peers, pinned node keys, the plan, fairness counters) is only meaningful for
the swarm it was written by. That swarm is named by its **model identity**: the DHT prefix it is served under and
a fingerprint of the checkpoint (:func:`model_fingerprint`: its ``config.json`` and the contents of its weight
files, sampled). The identity is kept in the directory's ``model.json``:

* :func:`claim` — before anything else is read: an unmarked directory is stamped with the model's identity (a
  directory written by a version that did not mark it is adopted, unless its saved plan is for another number of
  blocks); a directory marked for another model is a :class:`~swarm.state.store.StateError` naming both, never
  loaded;
* :func:`default_dir` — ``<state root>/orchestrator/<dht prefix>-<fingerprint>``: two models in folders of the
  same name get two directories. A directory of the earlier layout (``orchestrator/<dht prefix>``, keyed by the
  folder name only) that this model may have written is moved there once (:func:`default_dir` does it, and logs it).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from swarm.state.store import StateDir, StateError, atomic_write, default_state_root

__all__ = ["ModelIdentity", "model_fingerprint", "claim", "default_dir", "MODEL_FILE"]

logger = logging.getLogger(__name__)

MODEL_FILE = "model.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
SAMPLE_BYTES = 1 << 16  # read at the start, the middle and the end of every weight file
FINGERPRINT_CHARS = 12


def model_fingerprint(model_dir: str | os.PathLike) -> str:
    """A short hex digest of a checkpoint: its ``config.json`` (as parsed, so whitespace does not count) and, per
    weight file, its name, size and three sampled 64 KiB windows (start — a safetensors header with every tensor's
    name, shape and offset — middle and end). It reads about 200 KiB a file, so a 70B checkpoint is fingerprinted in
    milliseconds; two checkpoints of one shape but other weights differ in the sampled bytes."""
    root = Path(model_dir)
    digest = hashlib.sha256()
    try:
        config = json.loads((root / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise StateError(f"cannot fingerprint the model in {root}: config.json unreadable ({exc})") from None
    digest.update(json.dumps(config, sort_keys=True).encode())
    for path in sorted(p for p in root.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES)):
        size = path.stat().st_size
        digest.update(f"\0{path.name}\0{size}\0".encode())
        with path.open("rb") as f:
            for offset in sorted({0, max(0, size // 2 - SAMPLE_BYTES // 2), max(0, size - SAMPLE_BYTES)}):
                f.seek(offset)
                digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()[:FINGERPRINT_CHARS]


@dataclass(frozen=True)
class ModelIdentity:
    """What a state directory is for: the swarm's DHT prefix and the checkpoint's fingerprint (``model_dir`` is
    where it was read from: shown in messages, not compared — a model may move)."""

    dht_prefix: str
    fingerprint: str
    model_dir: str = ""

    @classmethod
    def of(cls, model_dir: str | os.PathLike, dht_prefix: str) -> "ModelIdentity":
        return cls(dht_prefix, model_fingerprint(model_dir), str(Path(model_dir).resolve()))

    def same_model(self, other: "ModelIdentity") -> bool:
        return (self.dht_prefix, self.fingerprint) == (other.dht_prefix, other.fingerprint)

    def describe(self) -> str:
        where = f" in {self.model_dir}" if self.model_dir else ""
        return f"prefix {self.dht_prefix}, fingerprint {self.fingerprint}{where}"


def _read_identity(path: Path) -> ModelIdentity | None:
    file = path / MODEL_FILE
    if not file.exists():
        return None
    doc = StateDir(path).read(MODEL_FILE)
    try:
        return ModelIdentity(str(doc["dht_prefix"]), str(doc["fingerprint"]), str(doc.get("model_dir", "")))
    except (KeyError, TypeError):
        raise StateError(f"state file {file} is corrupt (no dht_prefix and fingerprint)") from None


def _saved_blocks(path: Path) -> int | None:
    """The number of blocks of the plan saved in ``path`` (None when none is saved)."""
    doc = StateDir(path).read(StateDir.PLAN) if (path / StateDir.PLAN).exists() else None
    return None if doc is None or doc.get("plan_id") is None else doc.get("num_blocks")


def claim(store: StateDir, identity: ModelIdentity, num_blocks: int) -> str:
    """Mark ``store`` as ``identity``'s state, or refuse it; what was done: ``"new"`` (an empty directory),
    ``"same"`` (already this model's), ``"adopted"`` (written by an earlier version, now marked)."""
    saved = _read_identity(store.path)
    if saved is not None:
        if not saved.same_model(identity):
            raise StateError(f"state directory {store.path} belongs to another model ({saved.describe()}); this "
                             f"orchestrator serves {identity.describe()}: give it its own --state-dir (or "
                             "--ephemeral), or remove that directory")
        if saved.model_dir != identity.model_dir:  # the same model from a new place: remember where
            _write_identity(store.path, identity)
        return "same"
    blocks = _saved_blocks(store.path)
    if blocks is not None and blocks != num_blocks:
        raise StateError(f"state directory {store.path} holds a plan for {blocks} blocks, the model "
                         f"({identity.describe()}) has {num_blocks}: it belongs to another model; give this one "
                         "its own --state-dir (or --ephemeral)")
    adopted = any(store.path.iterdir())
    _write_identity(store.path, identity)
    if adopted:
        logger.info("state directory %s was written by an earlier version: adopted for %s", store.path,
                    identity.describe())
    return "adopted" if adopted else "new"


def _write_identity(path: Path, identity: ModelIdentity) -> None:
    atomic_write(path / MODEL_FILE, (json.dumps(asdict(identity), indent=1, sort_keys=True) + "\n").encode())


def default_dir(identity: ModelIdentity, num_blocks: int, root: Path | None = None) -> Path:
    """``identity``'s default state directory, ``<root>/orchestrator/<prefix>-<fingerprint>``. When it does not
    exist yet and the earlier layout's ``<root>/orchestrator/<prefix>`` does, unmarked and holding no plan for
    another number of blocks, that directory is moved here (once, logged); one that is not this model's is left
    where it is (logged)."""
    base = (root or default_state_root()) / "orchestrator"
    target = base / f"{identity.dht_prefix}-{identity.fingerprint}"
    legacy = base / identity.dht_prefix
    if target.exists() or not legacy.is_dir() or (legacy / MODEL_FILE).exists():
        return target
    try:
        blocks = _saved_blocks(legacy)
    except StateError as exc:
        logger.warning("not moving the earlier state directory %s: %s", legacy, exc)
        return target
    if blocks is not None and blocks != num_blocks:
        logger.warning("not moving the earlier state directory %s to %s: its plan is for %d blocks, this model has "
                       "%d (another model's state)", legacy, target, blocks, num_blocks)
        return target
    try:
        os.rename(legacy, target)
    except OSError as exc:
        logger.warning("could not move the earlier state directory %s to %s (%s): starting afresh there", legacy,
                       target, exc)
        return target
    logger.info("moved the state of an earlier version from %s to %s (state directories are now keyed by the "
                "model's fingerprint)", legacy, target)
    return target
