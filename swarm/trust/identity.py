"""Who wrote a control-plane record: signing keys, owned subkeys, node-id pins.

Every Chainswarm control-plane record (server profiles, assignments, the orchestrator record, prefix eviction
reports) is stored under a subkey ``<name>[owner:<public key>]`` (:meth:`Identity.subkey`). hivemind's
:class:`~hivemind.dht.crypto.RSASignatureValidator` then makes the DHT sign the value with the writer's key and
makes every DHT peer that has it installed refuse a value whose signature does not match the key named in the
subkey. :class:`~swarm.trust.validation.RecordSchemaValidator` (installed next to it by
:func:`swarm.trust.validation.swarm_validators`) additionally refuses,
under Chainswarm's four keys, any record that is not owned or whose value does not parse (a profile whose
``node_id`` differs from the subkey's name, a mistyped assignment, ...). Both are mechanism: *which* owner a
reader believes is policy and lives with the reader:

* servers accept assignments and the orchestrator record only when owned by the orchestrator key they were
  given or pinned (:mod:`server.trust`);
* the orchestrator binds each node id to the first key it sees for it (:class:`KeyPins`) and ignores profiles
  and prefix reports of that node id under any other key while the pinned key's profile is alive.

Keys are hivemind's ``RSAPrivateKey``/``RSAPublicKey`` (2048-bit RSA, PSS/SHA-256); a public key travels as its
OpenSSH text ``ssh-rsa AAAA...`` (what the subkeys carry) and a private key is stored as DER in a file created
with mode 0600.
"""
from __future__ import annotations

import base64
import hashlib
import logging
import os
import re
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, NamedTuple, TypeVar

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

logger = logging.getLogger(__name__)

_OWNER_RE = re.compile(r"^(.*)\[owner:(ssh-rsa [A-Za-z0-9+/=]+)\]$", re.S)
T = TypeVar("T")


class BadKeyError(ValueError):
    """A key (file or text) cannot be used."""


def fingerprint(public: bytes) -> str:
    """A short, stable name of a public key for logs and errors (sha256 of its OpenSSH text, 12 hex)."""
    return hashlib.sha256(public).hexdigest()[:12]


def parse_public_key(text: str | bytes) -> bytes:
    """A public key given as ``ssh-rsa AAAA...``, as the bare base64 body, or as a file holding either;
    returned as canonical OpenSSH bytes. Raises :class:`BadKeyError` with a one-line reason."""
    raw = text.encode() if isinstance(text, str) else bytes(text)
    candidate = raw.strip()
    if not candidate.startswith(b"ssh-rsa ") and len(candidate) < 4096 and os.path.isfile(candidate):
        candidate = Path(candidate.decode()).read_bytes().strip()
    if not candidate.startswith(b"ssh-rsa "):
        candidate = b"ssh-rsa " + candidate
    candidate = b" ".join(candidate.split()[:2])  # drop an OpenSSH comment
    try:
        return RSAPublicKey.from_bytes(candidate).to_bytes()
    except Exception as exc:
        raise BadKeyError(f"not an RSA public key (ssh-rsa AAAA... or a file holding one): {exc}") from None


def owned_subkey(name: str, public: bytes) -> str:
    return f"{name}{RSASignatureValidator.PUBLIC_KEY_FORMAT.decode().replace('_key_', public.decode())}"


def split_subkey(subkey: Any) -> tuple[str, bytes] | None:
    """``(name, owner public key)`` of an owned subkey, None for anything else."""
    if not isinstance(subkey, str):
        return None
    match = _OWNER_RE.match(subkey)
    if match is None or "[owner:" in match.group(1):
        return None
    return match.group(1), match.group(2).encode()


class Identity:
    """A signing key: its private half signs this process's records (through its DHT) and tickets."""

    def __init__(self, private_key: RSAPrivateKey):
        self.private_key = private_key
        self.public = private_key.get_public_key().to_bytes()
        self.fingerprint = fingerprint(self.public)

    @classmethod
    def generate(cls) -> "Identity":
        return cls(RSAPrivateKey())

    @classmethod
    def from_der(cls, der: bytes) -> "Identity":
        key = RSAPrivateKey.__new__(RSAPrivateKey)
        key.__setstate__({"_private_key": der})  # hivemind's own unpickling path
        return cls(key)

    @classmethod
    def load_or_create(cls, path: str | os.PathLike) -> "Identity":
        """The key in ``path`` (DER), or a new one written there (mode 0600) if the file does not exist."""
        path = Path(path)
        if path.exists():
            try:
                return cls.from_der(path.read_bytes())
            except Exception as exc:
                raise BadKeyError(f"{path} does not hold an RSA private key (DER): {exc}") from None
        identity = cls.generate()
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(identity.private_key.to_bytes())
        return identity

    def subkey(self, name: str) -> str:
        return owned_subkey(name, self.public)

    def sign(self, data: bytes) -> bytes:
        return self.private_key.sign(data)

    @property
    def public_b64(self) -> str:
        return self.public.split()[1].decode()


def verify(public: bytes, data: bytes, signature: bytes) -> bool:
    try:
        return RSAPublicKey.from_bytes(public).verify(data, signature)
    except Exception:
        return False


# -- reading owned records -----------------------------------------------------------------------------


class Owned(NamedTuple):
    """One owned record read from the DHT: its name, the key that signed it, its value and when it expires (DHT
    time: :func:`hivemind.utils.timed_storage.get_dht_time`)."""
    name: str
    owner: bytes
    value: Any
    expires: float


def fetch_owned(dht, key: str, *, latest: bool = True) -> list[Owned]:
    """Every owned subkey under ``key`` (unowned subkeys are skipped). ``latest`` asks every replica for the
    freshest value (about 14 ms of CPU over a six-peer test swarm); without it a live local replica or cached
    copy answers at once (under 1 ms), for readers that can live with a value a few seconds old."""
    found = dht.get(key, latest=latest)
    if found is None or not isinstance(found.value, dict):
        return []
    out = []
    for subkey, item in found.value.items():
        owned = split_subkey(subkey)
        if owned is not None:
            out.append(Owned(owned[0], owned[1], getattr(item, "value", None),
                             float(getattr(item, "expiration_time", 0.0) or 0.0)))
    return out


class KeyPins:
    """The orchestrator's node id → key binding (trust on first use, for as long as the key's record lives).

    ``select`` takes every claim ``{node id: {owner key: record}}`` read in one refresh. A node id whose pinned
    key still has a record keeps that key; claims under other keys are refused (a second key cannot take over
    a live node id). A node id whose pinned key's record expired is unpinned, and a node id claimed by exactly
    one key is pinned to it; one claimed by several keys at once with none pinned is refused altogether (who
    came first cannot be told) until only one remains.

    Pins survive an orchestrator restart (:mod:`swarm.state.persistence` saves :attr:`pins` and :meth:`restore` loads
    them): a restored pin holds for ``hold_s`` even while its key's record is not seen (a restarted DHT peer
    finds records only as it reconnects), so an impostor cannot claim a live node's id in the moments after a
    restart; once its record is seen it is an ordinary pin again, and one whose record never comes back is
    dropped when the hold ends.
    """

    def __init__(self) -> None:
        self.pins: dict[str, bytes] = {}
        self._held_until: dict[str, float] = {}  # restored pins not seen since: kept until then (monotonic)

    def restore(self, pins: Mapping[str, bytes], hold_s: float, now: float | None = None) -> None:
        """Pins saved by an earlier run, each held ``hold_s`` seconds before its record must be seen."""
        until = (time.monotonic() if now is None else now) + hold_s
        for node, key in pins.items():
            self.pins[node] = key
            self._held_until[node] = until

    def select(self, claims: Mapping[str, Mapping[bytes, T]],
               now: float | None = None) -> tuple[dict[str, T], list[tuple[str, str]]]:
        """``({node id: record of its pinned key}, [(node id, refused key fingerprint), ...])``."""
        now = time.monotonic() if now is None else now
        chosen, refused = {}, []
        for node in list(self.pins):
            if node in claims and self.pins[node] in claims[node]:
                self._held_until.pop(node, None)  # seen: an ordinary pin from now on
            elif self._held_until.get(node, now) <= now:
                del self.pins[node]  # the pinned key's record is gone: the node id is free again
                self._held_until.pop(node, None)
        for node, by_owner in claims.items():
            pinned = self.pins.get(node)
            if pinned is None and len(by_owner) == 1:
                pinned = self.pins[node] = next(iter(by_owner))
            if pinned in by_owner:  # (a held pin may have no record yet)
                chosen[node] = by_owner[pinned]
            refused += [(node, fingerprint(owner)) for owner in by_owner if owner != pinned]
        return chosen, refused

    def owner(self, node: str) -> bytes | None:
        return self.pins.get(node)


def group_claims(items: Iterable[tuple[str, bytes, T]]) -> dict[str, dict[bytes, T]]:
    claims: dict[str, dict[bytes, T]] = {}
    for name, owner, value in items:
        claims.setdefault(name, {})[owner] = value
    return claims


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()
