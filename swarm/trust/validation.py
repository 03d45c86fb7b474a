"""The DHT record validators every peer of a swarm runs: hivemind's signatures, then Chainswarm's schemas.

:func:`swarm_validators` is what a DHT of the swarm installs (the orchestrator's, each server's). Under
``{prefix}._cs.*`` only owned subkeys (signed by the key they name, :mod:`swarm.trust.identity`) with values
that parse as the record they claim to be (:mod:`swarm.trust.records`, :mod:`swarm.trust.prefix`) are kept.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils.serializer import MSGPackSerializer

from swarm.trust import prefix as prefix_protocol, records
from swarm.trust.identity import Identity, split_subkey


def swarm_validators(identity: Identity, dht_prefix: str) -> list[RecordValidatorBase]:
    """What every DHT of the swarm must run: signatures (signing with this key) + Chainswarm's schemas."""
    return [VerifiedOnceValidator(identity.private_key), RecordSchemaValidator(dht_prefix)]


class VerifiedOnceValidator(RSASignatureValidator):
    """hivemind's signature check, each distinct signed record verified once.

    A swarm re-reads the same signed records all the time (the orchestrator every server's profile each refresh,
    every server its assignment each check, from up to five replicas each), and hivemind checks the RSA signature of
    every copy it receives — a fifth of a test swarm's idle DHT work. A record (key, subkey, signed value bytes,
    expiration) that verified, or failed to, gives the same answer again: the last :attr:`CACHE` results are kept.
    """

    CACHE = 4096

    def __init__(self, private_key=None):
        super().__init__(private_key)
        self._verified: OrderedDict[DHTRecord, bool] = OrderedDict()
        self._lock = threading.Lock()

    def validate(self, record: DHTRecord) -> bool:
        with self._lock:
            known = self._verified.get(record)
            if known is not None:
                self._verified.move_to_end(record)
                return known
        valid = super().validate(record)
        with self._lock:
            self._verified[record] = valid
            while len(self._verified) > self.CACHE:
                self._verified.popitem(last=False)
        return valid

    def __getstate__(self):  # validators are pickled into the DHT process: the memory (and lock) start afresh there
        return {k: v for k, v in self.__dict__.items() if k not in ("_verified", "_lock")}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._verified, self._lock = OrderedDict(), threading.Lock()


def _check_value(kind: str, name: str, value: Any) -> bool:
    try:
        if kind == records.PROFILES:
            return records.ServerProfile.from_dict(value).node_id == name
        if kind == records.ASSIGNMENTS:
            records.Assignment.from_dict(value)
            return True
        if kind == records.ORCHESTRATOR:
            records.OrchestratorInfo.from_dict(value)
            return name == "main"
        if kind == prefix_protocol.REPORTS:
            return prefix_protocol.valid_report(value)
    except (records.RecordError, TypeError, ValueError):
        return False
    return False


class RecordSchemaValidator(RecordValidatorBase):
    """Under ``{prefix}._cs.*`` only owned subkeys (so: signed, see the module doc) with well-formed values.

    Other keys (petals' own block records, ``_petals.models``) pass untouched. Runs after hivemind's
    signature validator (lower priority), on the value with the signature stripped.
    """

    def __init__(self, dht_prefix: str):
        kinds = (records.PROFILES, records.ASSIGNMENTS, records.ORCHESTRATOR, prefix_protocol.REPORTS)
        self._kinds = {DHTID.generate(source=f"{dht_prefix}.{kind}").to_bytes(): kind for kind in kinds}

    def validate(self, record: DHTRecord) -> bool:
        kind = self._kinds.get(record.key)
        if kind is None:
            return True
        try:
            owned = split_subkey(MSGPackSerializer.loads(record.subkey)) if record.subkey else None
            if owned is None:
                return False
            return _check_value(kind, owned[0], MSGPackSerializer.loads(record.value))
        except Exception:
            return False

    @property
    def priority(self) -> int:
        return 5  # below RSASignatureValidator's 10: sees the value without its signature

    def merge_with(self, other: RecordValidatorBase) -> bool:
        if not isinstance(other, RecordSchemaValidator):
            return False
        self._kinds.update(other._kinds)
        return True
