"""The orchestrator's state directory (``--state-dir``): files that make a restart lose nothing.

Mechanism only (what is kept and when is :mod:`swarm.state.persistence`'s business). The directory holds:

* ``identity.key`` — the DHT peer's private key (hivemind's ``identity_path``): the same peer id on every
  start, so the multiaddr servers were given as ``--initial-peers`` still names this orchestrator;
* ``node.json`` — the DHT and HTTP ports actually bound (a first start on "any free port" records what it
  got, later starts bind the same), the secret that roots the prefix-hash namespace and the multiaddrs of the
  servers' DHT peers seen last;
* ``api_keys.json`` — API key -> client (mode 0600): written when keys are given, loaded when present;
* ``plan.json`` — the current plan and its assignments; ``fairness.json`` — the scheduler's counters;
* ``pins.json`` — which key each node id's profile is signed with (:class:`swarm.trust.identity.KeyPins`).

Every write is atomic: a temporary file in the same directory is written, fsynced, renamed over the target
(``os.replace``) and the directory fsynced, so a crash at any point leaves either the old or the new file,
never a mix. Temporary files are never read (a crash mid-write leaves one behind; it is removed on the next
open). A missing file means "not saved yet"; a file that exists but cannot be read or parsed is a
:class:`StateError` naming it, never a silent fresh start.
"""
from __future__ import annotations

import json
import os
import secrets
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["StateError", "StateDir", "atomic_write"]

_TMP_PREFIX = ".tmp-"


class StateError(Exception):
    """A state file exists but cannot be used; the message is one line and names the file."""


def atomic_write(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Replace ``path`` with ``data`` atomically (temp file in the same directory, fsync, rename, fsync dir)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_TMP_PREFIX + path.name + ".")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with _suppress_os():
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _suppress_os:
    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        return kind is not None and issubclass(kind, OSError)


class StateDir:
    """One orchestrator's state directory (created, mode 0700, when missing)."""

    IDENTITY = "identity.key"
    NODE = "node.json"
    API_KEYS = "api_keys.json"
    PLAN = "plan.json"
    FAIRNESS = "fairness.json"
    PINS = "pins.json"

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
            for leftover in self.path.glob(_TMP_PREFIX + "*"):  # a write that a crash interrupted
                leftover.unlink()
        except OSError as exc:
            raise StateError(f"state directory {self.path} is unusable: {exc}") from None
        if not os.access(self.path, os.W_OK):
            raise StateError(f"state directory {self.path} is not writable")

    def file(self, name: str) -> Path:
        return self.path / name

    # -- JSON documents ------------------------------------------------------------------------------
    def read(self, name: str) -> dict[str, Any] | None:
        """The JSON object saved as ``name``; None when it was never saved."""
        path = self.file(name)
        try:
            text = path.read_text()
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as exc:
            raise StateError(f"state file {path} is unreadable: {exc}") from None
        try:
            doc = json.loads(text)
        except ValueError as exc:
            raise StateError(f"state file {path} is corrupt (not JSON: {exc})") from None
        if not isinstance(doc, dict):
            raise StateError(f"state file {path} is corrupt (a JSON {type(doc).__name__}, not an object)")
        return doc

    def write(self, name: str, doc: dict[str, Any]) -> None:
        atomic_write(self.file(name), (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode())

    # -- the DHT identity ----------------------------------------------------------------------------
    def identity_path(self) -> str:
        """The DHT private key file for hivemind's ``identity_path``, generated (atomically) on first start."""
        from hivemind.p2p import P2P

        path = self.file(self.IDENTITY)
        if not path.exists():
            fd, tmp = tempfile.mkstemp(dir=self.path, prefix=_TMP_PREFIX + self.IDENTITY + ".")
            os.close(fd)
            try:  # hivemind writes the key to a file: generate it aside, then replace atomically
                P2P.generate_identity(tmp)
                atomic_write(path, Path(tmp).read_bytes())
            finally:
                with _suppress_os():
                    os.unlink(tmp)
        self.peer_id()  # a key hivemind cannot load is an error here, naming the file
        return str(path)

    def peer_id(self) -> str:
        """The base58 peer id of the saved identity."""
        from hivemind.p2p import PeerID

        path = self.file(self.IDENTITY)
        try:
            return PeerID.from_identity(path.read_bytes()).to_base58()
        except OSError as exc:
            raise StateError(f"state file {path} is unreadable: {exc}") from None
        except Exception as exc:  # protobuf / DER parse errors
            raise StateError(f"state file {path} is corrupt (not a private key: {type(exc).__name__})") from None

    # -- ports and the prefix secret -----------------------------------------------------------------
    def node(self) -> dict[str, Any]:
        """``{"dht_port", "http_port", "prefix_secret"}`` as saved (a fresh secret is created and saved on
        first use; ports are None until :meth:`record_ports`)."""
        doc = self.read(self.NODE) or {}
        changed = "prefix_secret" not in doc
        doc.setdefault("prefix_secret", secrets.token_hex(32))
        doc.setdefault("dht_port", None)
        doc.setdefault("http_port", None)
        try:
            bytes.fromhex(doc["prefix_secret"])
            for key in ("dht_port", "http_port"):
                if doc[key] is not None and not (isinstance(doc[key], int) and 0 < doc[key] < 65536):
                    raise ValueError(f"{key} {doc[key]!r}")
        except (TypeError, ValueError) as exc:
            raise StateError(f"state file {self.file(self.NODE)} is corrupt ({exc})") from None
        if changed:
            self.write(self.NODE, doc)
        return doc

    def peers(self) -> list[str]:
        """Multiaddrs of the servers' DHT peers seen last (the orchestrator dials them on a restart)."""
        peers = self.node().get("peers", [])
        if not isinstance(peers, list) or not all(isinstance(p, str) for p in peers):
            raise StateError(f"state file {self.file(self.NODE)} is corrupt (peers is not a list of multiaddrs)")
        return peers

    def record_peers(self, peers: list[str]) -> None:
        doc = self.node()
        if sorted(peers) != sorted(doc.get("peers", [])):
            self.write(self.NODE, {**doc, "peers": sorted(peers)})

    def prefix_secret(self) -> bytes:
        return bytes.fromhex(self.node()["prefix_secret"])

    def record_ports(self, dht_port: int | None = None, http_port: int | None = None) -> None:
        doc = self.node()
        new = {**doc, **{k: v for k, v in (("dht_port", dht_port), ("http_port", http_port)) if v}}
        if new != doc:
            self.write(self.NODE, new)

    # -- API keys ------------------------------------------------------------------------------------
    def api_keys(self, given: dict[str, str]) -> dict[str, str]:
        """The keys to serve: ``given`` ones (then saved, replacing the file) or else the saved ones."""
        if given:
            self.write(self.API_KEYS, {"keys": dict(given)})
            return dict(given)
        doc = self.read(self.API_KEYS)
        if doc is None:
            return {}
        keys = doc.get("keys")
        if not isinstance(keys, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in keys.items()):
            raise StateError(f"state file {self.file(self.API_KEYS)} is corrupt (no key -> client object)")
        return keys


def default_state_root() -> Path:
    """Where the ``chainswarm`` commands keep state by default (as ssh keeps host keys and etcd its data dir):
    ``$CHAINSWARM_STATE``, else ``$XDG_STATE_HOME/chainswarm``, else ``~/.local/state/chainswarm``."""
    if os.environ.get("CHAINSWARM_STATE"):
        return Path(os.environ["CHAINSWARM_STATE"])
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "chainswarm"

