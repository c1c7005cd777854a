"""API keys: with a key set (`--api-key`, or the environment variable CUPOOL_API_KEY), every
endpoint but GET /health answers 401 unless the request carries it, as OpenAI's clients send it
(`Authorization: Bearer KEY`) or as Anthropic's do (`x-api-key: KEY`). Keys are compared in
constant time."""

from __future__ import annotations

import hmac
import os

ENV = "CUPOOL_API_KEY"
OPEN_PATHS = frozenset({"/health"})


def key_from_env(given: str | None) -> str | None:
    """The key to require: the one given, else the environment's, else None (no key)."""
    if given:
        return given
    return os.environ.get(ENV) or None


def presented(headers) -> str | None:
    """The key a request carries (the bearer token, else x-api-key), or None."""
    auth = headers.get("authorization")
    if auth:
        scheme, _, token = auth.partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    return headers.get("x-api-key") or None


def allowed(path: str, headers, key: str | None) -> bool:
    """Whether a request to `path` with `headers` may proceed."""
    if key is None or path in OPEN_PATHS:
        return True
    got = presented(headers)
    return got is not None and hmac.compare_digest(got.encode(), key.encode())


def refusal(headers) -> str:
    """The message of a 401: says whether a key was missing or wrong."""
    if presented(headers) is None:
        return ("this server needs an API key: send it as 'Authorization: Bearer KEY' or "
                "'x-api-key: KEY'")
    return "the API key is not valid for this server"
