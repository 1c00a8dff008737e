"""Just enough of NATS decentralised auth for tests: an operator, one account and its users as
signed JWTs, a server config that trusts them, and ``.creds`` files, as ``nsc`` would write.

A NATS JWT is ``base64url(header).base64url(claims).base64url(ed25519 signature)``, signed by
the issuer's nkey: the operator signs accounts, an account signs its users. A user's
permissions travel in its JWT, so the server config lists no users.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nkeys

_HEADER = {"typ": "JWT", "alg": "ed25519-nkey"}
_UNLIMITED = {
    "subs": -1,
    "data": -1,
    "payload": -1,
    "imports": -1,
    "exports": -1,
    "wildcards": True,
    "conn": -1,
    "leaf": -1,
}


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


@dataclass(frozen=True)
class NKey:
    seed: bytes

    @classmethod
    def new(cls, prefix: int) -> NKey:
        return cls(nkeys.encode_seed(os.urandom(32), prefix))

    @property
    def public(self) -> str:
        return nkeys.from_seed(bytearray(self.seed)).public_key.decode()

    def sign(self, data: bytes) -> bytes:
        return nkeys.from_seed(bytearray(self.seed)).sign(data)


def _jwt(issuer: NKey, subject: str, name: str, claims: dict[str, Any]) -> str:
    body: dict[str, Any] = {"iat": int(time.time()), "iss": issuer.public, "name": name, "sub": subject, "nats": claims}
    body["jti"] = (
        base64.b32encode(hashlib.sha256(json.dumps(body, sort_keys=True).encode()).digest()).decode().rstrip("=")
    )
    signed = f"{_b64(json.dumps(_HEADER).encode())}.{_b64(json.dumps(body).encode())}"
    return f"{signed}.{_b64(issuer.sign(signed.encode()))}"


@dataclass
class Operator:
    """An operator with one account; ``user`` writes a .creds file for a new user of it.

    ``scope`` adds a scoped signing key to the account: users it signs (``scoped_user``) carry no
    permissions of their own but get the scope's template, in which NATS replaces ``{{name()}}``
    with each user's name. Add scopes before ``server_config``, which signs the account."""

    directory: Path
    operator: NKey = field(default_factory=lambda: NKey.new(nkeys.PREFIX_BYTE_OPERATOR))
    account: NKey = field(default_factory=lambda: NKey.new(nkeys.PREFIX_BYTE_ACCOUNT))
    scopes: dict[str, tuple[NKey, dict[str, Any]]] = field(default_factory=dict)

    def scope(self, role: str, template: dict[str, Any]) -> None:
        self.scopes[role] = (NKey.new(nkeys.PREFIX_BYTE_ACCOUNT), template)

    def server_config(self) -> Path:
        operator_jwt = _jwt(self.operator, self.operator.public, "dpcoord-test", {"type": "operator", "version": 2})
        signing_keys = [
            {
                "kind": "user_scope",
                "key": key.public,
                "role": role,
                "template": {"subs": -1, "data": -1, "payload": -1, **template},
            }
            for role, (key, template) in self.scopes.items()
        ]
        account_claims = {"limits": _UNLIMITED, "type": "account", "version": 2, "signing_keys": signing_keys}
        account_jwt = _jwt(self.operator, self.account.public, "dpcoord", account_claims)
        path = self.directory / "operator.conf"
        path.write_text(
            f"operator: {operator_jwt}\nresolver: MEMORY\nresolver_preload: {{ {self.account.public}: {account_jwt} }}\n"
        )
        return path

    def user(self, name: str, permissions: dict[str, Any] | None = None) -> Path:
        """``permissions``: the JWT's ``pub``, ``sub`` and ``resp`` fields; none means allow all."""
        user = NKey.new(nkeys.PREFIX_BYTE_USER)
        claims = {"subs": -1, "data": -1, "payload": -1, "type": "user", "version": 2, **(permissions or {})}
        user_jwt = _jwt(self.account, user.public, name, claims)
        path = self.directory / f"{name}.creds"
        path.write_text(
            f"-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n"
            f"-----BEGIN USER NKEY SEED-----\n{user.seed.decode()}\n------END USER NKEY SEED------\n"
        )
        return path

    def scoped_user(self, name: str, role: str) -> Path:
        """A user signed by ``role``'s scoped key: its permissions are that scope's template."""
        key, _ = self.scopes[role]
        user = NKey.new(nkeys.PREFIX_BYTE_USER)
        claims = {"type": "user", "version": 2, "issuer_account": self.account.public}
        user_jwt = _jwt(key, user.public, name, claims)
        path = self.directory / f"{name}.creds"
        path.write_text(
            f"-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n"
            f"-----BEGIN USER NKEY SEED-----\n{user.seed.decode()}\n------END USER NKEY SEED------\n"
        )
        return path
