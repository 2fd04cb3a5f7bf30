"""Bearer tokens with roles for the directory's REST API.

The tokens file (`--auth-tokens-file`, `KVDIR_AUTH_TOKENS_FILE`) holds one token
per line as `ROLE[@TENANT]:NODE_PATTERN:TOKEN`; blank lines and lines starting
with `#` are ignored, and the token is everything after the second colon:

    engine:worker-*:s3cr3t      # may write entries, heartbeats, (de)registration of nodes matching worker-*
    gateway:*:abc               # may only read: lookups, nodes, cluster
    gateway@acme:*:def          # reads too, but only in tenant acme (directory.tenancy)
    admin:*:xyz                 # may do everything, including deleting any node

`@TENANT` confines an engine or gateway token to one tenant: routes that take
a `tenant` (publish, remove, lookup) act in that tenant when the request names
none, and refuse any other (403), the shared tenant "" included. A token
without it may name any tenant and defaults to "". The tenant rides on the
role because node ids may contain `@`, so NODE_PATTERN could not carry it
unambiguously; admin tokens cannot be confined (they may delete any node).

NODE_PATTERN is a shell-style glob (`fnmatch`, case-sensitive) over node ids; it
only matters for engine tokens. Every role may read (GET routes and
`POST /v1/lookup`): engines read `/v1/nodes` to find a pull source's transfer
endpoint. Every request needs a token except `/healthz`, `/readyz` and
`/metrics`: 401 without one or with an unknown one, 403 for a route or node the
token's role may not write. Engine tokens confined to different tenants must have node patterns that
match no common node id (the file is refused otherwise). Tokens are compared in constant time (SHA-256 of
both sides through `hmac.compare_digest`, against every entry, so neither the
match nor its position nor the length leaks through timing).
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path

from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from directory.globs import overlap
from kvproto.schemas import TENANT_MAX_LEN

ROLES = ("engine", "gateway", "admin")
# The paths probes and scrapers fetch without a token. Not the API docs: /docs and its assets (kvproto.offline_docs)
# need one like /openapi.json, which they render and which would show anyone who reaches a replica every route to
# try; an open page would only show the schema's 401. A browser or proxy that adds the header loads all three.
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
READ_METHODS = frozenset({"GET", "HEAD"})
READ_POSTS = frozenset({"/v1/lookup"})
PRINCIPAL = "kvdir.principal"
"""The ASGI scope key under which the middleware leaves the request's `Principal`."""

_TOKEN = re.compile(r"[\x21-\x7e]+")  # visible ASCII: what an Authorization header can carry
_TENANT = re.compile(rf"[A-Za-z0-9._-]{{1,{TENANT_MAX_LEN}}}")  # kvproto.schemas.TENANT_PATTERN, non-empty


@dataclass(frozen=True)
class Principal:
    """Who a token speaks for: a role, for engines the node ids it may write, and the tenant it is confined to (None: any)."""

    role: str
    pattern: str
    line: int
    tenant: str | None = None

    def may_write(self, node_id: str) -> bool:
        return self.role == "admin" or (self.role == "engine" and fnmatchcase(node_id, self.pattern))

    def tenant_for(self, requested: str | None) -> str | None:
        """The tenant a request naming `requested` (None: none) acts in, or None when this token may not use it."""
        if self.tenant is None:
            return requested or ""
        return self.tenant if requested in (None, self.tenant) else None

    def __str__(self) -> str:
        confined = f"@{self.tenant}" if self.tenant is not None else ""
        return f"{self.role}{confined}:{self.pattern} (line {self.line})"


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


class TokenTable:
    """The tokens of a tokens file, looked up in constant time."""

    def __init__(self, entries: list[tuple[str, Principal]]) -> None:
        self._entries = [(_digest(t.encode()), p) for t, p in entries]

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def confined(self) -> bool:
        """Whether any token is confined to a tenant."""
        return any(p.tenant is not None for _, p in self._entries)

    def find(self, token: bytes) -> Principal | None:
        """The principal of `token`, or None; compares against every entry, whatever matches."""
        given = _digest(token)
        found = None
        for secret, principal in self._entries:
            if hmac.compare_digest(secret, given):
                found = principal
        return found


def load_tokens(path: Path) -> TokenTable:
    """Parse a tokens file; ValueError (with the line number, never the secret) when it is malformed."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the auth tokens file: {exc}") from exc
    entries: list[tuple[str, Principal]] = []
    seen: set[str] = set()
    for no, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split(":", 2)
        if len(parts) != 3:
            raise ValueError(f"{path}:{no}: expected ROLE[@TENANT]:NODE_PATTERN:TOKEN")
        scope, pattern, token = (p.strip() for p in parts)
        role, at, tenant = scope.partition("@")
        if role not in ROLES:
            raise ValueError(f"{path}:{no}: unknown role {role!r}; expected one of {', '.join(ROLES)}")
        if at and not _TENANT.fullmatch(tenant):
            raise ValueError(f"{path}:{no}: a tenant is 1-{TENANT_MAX_LEN} of A-Z a-z 0-9 . _ -, got {tenant!r}")
        if at and role == "admin":
            raise ValueError(f"{path}:{no}: admin tokens cannot be confined to a tenant (they may delete any node)")
        if not pattern:
            raise ValueError(f"{path}:{no}: empty node pattern (use * for any node)")
        if not _TOKEN.fullmatch(token):
            raise ValueError(f"{path}:{no}: the token must be non-empty visible ASCII without spaces")
        if token in seen:
            raise ValueError(f"{path}:{no}: the same token appears twice")
        seen.add(token)
        entries.append((token, Principal(role, pattern, no, tenant if at else None)))
    if not entries:
        raise ValueError(f"{path}: no tokens (auth would refuse every request); leave the setting unset to turn auth off")
    _check_confined_patterns(path, [p for _, p in entries])
    return TokenTable(entries)


def _check_confined_patterns(path: Path, principals: list[Principal]) -> None:
    """ValueError when engine tokens confined to different tenants have node patterns that match a common node id:
    each could then write a node the other tenant's engines register."""
    confined = [p for p in principals if p.role == "engine" and p.tenant is not None]
    for k, a in enumerate(confined):
        for b in confined[k + 1 :]:
            if a.tenant != b.tenant and overlap(a.pattern, b.pattern):
                raise ValueError(
                    f"{path}:{a.line} and {path}:{b.line}: engine tokens of tenants {a.tenant!r} and {b.tenant!r} have "
                    f"node patterns {a.pattern!r} and {b.pattern!r} that match common node ids: give each tenant's "
                    "engines node ids of their own"
                )


def bearer_token(scope: Scope) -> bytes | None:
    """The token of an `Authorization: Bearer TOKEN` header, if there is one."""
    name: bytes
    value: bytes  # ASGI header names and values are byte strings
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            token = token.strip()
            if scheme.lower() == b"bearer" and token:
                return token
            return None
    return None


class BearerAuth:
    """ASGI middleware: authenticates every request but the open paths, and refuses writes by read-only roles.

    Node-level checks (an engine token writing another node) happen in the
    routes, which know the node id once the body is parsed; they read the
    principal from `scope[PRINCIPAL]`.
    """

    def __init__(self, app: ASGIApp, tokens: TokenTable) -> None:
        self.app, self.tokens = app, tokens

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        token = bearer_token(scope)
        if token is None:
            return await self._deny(
                scope, receive, send, 401, "unauthorized", "this API needs an `Authorization: Bearer TOKEN` header"
            )
        principal = self.tokens.find(token)
        if principal is None:
            return await self._deny(scope, receive, send, 401, "unauthorized", "unknown token")
        is_read = scope["method"] in READ_METHODS or (scope["method"] == "POST" and scope["path"] in READ_POSTS)
        if not is_read and principal.role == "gateway":
            return await self._deny(
                scope, receive, send, 403, "forbidden", "a gateway token may only read (lookups, nodes, cluster)"
            )
        scope[PRINCIPAL] = principal
        await self.app(scope, receive, send)

    @staticmethod
    async def _deny(scope: Scope, receive: Receive, send: Send, status: int, error: str, detail: str) -> None:
        app = scope.get("app")
        metrics = getattr(getattr(app, "state", None), "metrics", None)
        if metrics is not None:
            metrics.rejected.labels(error).inc()
        headers = {"WWW-Authenticate": 'Bearer realm="kvdir"'} if status == 401 else None
        resp = JSONResponse({"error": error, "detail": jsonable_encoder(detail)}, status_code=status, headers=headers)
        await resp(scope, receive, send)
