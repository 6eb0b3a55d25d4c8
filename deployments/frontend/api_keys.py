"""API keys: where they come from, and the constant-time check of a request's bearer token.

Keys come from an environment variable (comma-separated) or a secrets file (one key per line,
`#` comments allowed), both read inside the ingress replica, so a key never travels in Serve's
deployment arguments or its checkpoint. A key is never logged: errors name the variable or the
file, never its content.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass
from pathlib import Path

MIN_KEY_CHARS = 16  # shorter keys are guessable; refuse them rather than serve behind them


class ApiKeyConfigError(ValueError):
    """The manifest asks for keys that cannot be read, or that are too weak to use."""


def load_api_keys(env_var: str | None, file: str | None, environ: dict | None = None) -> list[str]:
    """Every key from `env_var` and `file` (either may be None). Raises ApiKeyConfigError when a
    named source is missing or empty, or holds a key shorter than MIN_KEY_CHARS."""
    environ = os.environ if environ is None else environ
    keys: list[str] = []
    if env_var:
        value = environ.get(env_var, "")
        from_env = [k.strip() for k in value.split(",") if k.strip()]
        if not from_env:
            raise ApiKeyConfigError(f"http.auth.api_keys_env names ${env_var}, which is unset or empty on this "
                                    "node; export it (comma-separated keys) before `ray start`/`moe-serve up`")
        keys += from_env
    if file:
        path = Path(file).expanduser()
        try:
            lines = path.read_text().splitlines()
        except OSError as exc:
            raise ApiKeyConfigError(f"http.auth.api_keys_file {str(path)!r} cannot be read on this node: "
                                    f"{exc.strerror}") from None
        from_file = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        if not from_file:
            raise ApiKeyConfigError(f"http.auth.api_keys_file {str(path)!r} holds no key (one per line)")
        keys += from_file
    weak = sum(len(k) < MIN_KEY_CHARS for k in keys)
    if weak:
        raise ApiKeyConfigError(f"{weak} API key(s) shorter than {MIN_KEY_CHARS} characters; use long random "
                                "keys, e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`")
    return keys


@dataclass(frozen=True)
class ApiKeyCheck:
    """Accepts `Authorization: Bearer <key>` for any configured key.

    Keys are kept as SHA-256 digests and compared with hmac.compare_digest against every key
    (no early exit), so neither the time taken nor the order of keys tells a caller anything
    about how close a guess was."""

    digests: tuple[bytes, ...]

    @classmethod
    def of(cls, keys: list[str]) -> "ApiKeyCheck":
        return cls(tuple(_digest(k) for k in keys))

    def allows(self, authorization: str | None) -> bool:
        if not authorization:
            return False
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return False
        offered = _digest(token.strip())
        matched = False
        for digest in self.digests:
            matched |= hmac.compare_digest(offered, digest)
        return matched


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()
