"""Optional API keys, checked as ``Authorization: Bearer <key>`` on ``/v1/*``.

Keys come from ``--api-key`` (repeatable) and from ``gateway_api_key_file`` (one key per line;
blank lines and lines starting with ``#`` are skipped). With no key configured every request is
let in. ``/healthz``, ``/readyz`` and ``/metrics`` are always open. Keys are kept as SHA-256
digests and compared as digests, so the check takes the same time whatever a guess shares with
a real key.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

_BEARER = "bearer "


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class ApiKeys:
    def __init__(self, keys: Iterable[str] = ()) -> None:
        self._digests = frozenset(_digest(key) for key in keys if key)

    @classmethod
    def load(cls, keys: Iterable[str], key_file: str | None) -> ApiKeys:
        """The keys given plus those of ``key_file``; a named file with no key is an error."""
        every = [key.strip() for key in keys if key.strip()]
        if key_file is not None:
            lines = [line.strip() for line in Path(key_file).read_text().splitlines()]
            from_file = [line for line in lines if line and not line.startswith("#")]
            if not from_file:
                raise ValueError(f"API key file {key_file} holds no key")
            every += from_file
        return cls(every)

    @classmethod
    def from_digests(cls, digests: Iterable[str]) -> ApiKeys:
        """Keys as :meth:`digests` gives them (hex), for a gateway worker process."""
        keys = cls()
        keys._digests = frozenset(bytes.fromhex(digest) for digest in digests)
        return keys

    def digests(self) -> list[str]:
        return sorted(digest.hex() for digest in self._digests)

    @property
    def required(self) -> bool:
        return bool(self._digests)

    def allows(self, authorization: str | None) -> bool:
        if not self._digests:
            return True
        if authorization is None or authorization[: len(_BEARER)].lower() != _BEARER:
            return False
        return _digest(authorization[len(_BEARER) :].strip()) in self._digests
