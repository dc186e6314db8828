"""API-key checks: ``Authorization: Bearer <key>`` (or TabbyAPI's ``x-admin-key`` / ``x-api-key`` headers, which
carry the bare key and are looked at first) compared in constant time against every configured key.

No keys configured: the API is open (a warning is logged at start). The admin key (admin endpoints) is separate;
without one, admin endpoints are refused. Keys are never logged or echoed in errors.
"""

from __future__ import annotations

import hmac


def _bearer(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def credential(headers) -> str | None:
    """The key a request presents, as an Authorization value: ``x-admin-key``, then ``x-api-key``, then
    ``Authorization`` (TabbyAPI's order)."""
    for name in ("x-admin-key", "x-api-key"):
        v = headers.get(name)
        if v and v.strip():
            return "Bearer " + v.strip()
    return headers.get("authorization")


def _matches(token: str, keys: list[bytes]) -> bool:
    t = token.encode("utf-8", "surrogatepass")
    ok = False
    for k in keys:  # no early exit: the time does not say which key (or how much of one) matched
        ok |= hmac.compare_digest(t, k)
    return ok


class KeyChecker:
    def __init__(self, api_keys: list[str], admin_key: str | None):
        self._keys = [k.encode("utf-8") for k in api_keys]
        self._admin = [admin_key.encode("utf-8")] if admin_key else []

    @property
    def open(self) -> bool:
        return not self._keys

    def check_user(self, header: str | None) -> str | None:
        """None when allowed, else the reason (for a 401)."""
        token = _bearer(header)
        if self.open:
            return None
        if token is None:
            return "missing API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')"
        if _matches(token, self._keys) or (self._admin and _matches(token, self._admin)):
            return None
        return "invalid API key"

    def check_admin(self, header: str | None) -> tuple[int, str] | None:
        """None when the admin key was given, else (status, reason): 401 for no/unknown key, 403 for a user key."""
        token = _bearer(header)
        if token is None:
            return 401, "missing API key: send 'Authorization: Bearer <admin key>' (or 'x-admin-key: <key>')"
        if self._admin and _matches(token, self._admin):
            return None
        if self.open or _matches(token, self._keys):
            if not self._admin:
                return 403, "admin endpoints are disabled: start the server with --admin-key"
            return 403, "this endpoint needs the admin key"
        return 401, "invalid API key"

    def permission(self, header: str | None) -> str | None:
        """ "admin" for the admin key, "api" for a user key (or any request when no user keys are set), None for
        a key that is neither."""
        token = _bearer(header)
        if token is not None and self._admin and _matches(token, self._admin):
            return "admin"
        if self.check_user(header) is None:
            return "api"
        return None
