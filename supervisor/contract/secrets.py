"""Secrets kept out of what turnkeeper shows: masked in rendered configs, logs and errors.

A secret is the value of a secret-sounding key (token, secret, password, key), and the
password and secret query parameters of any URL.
"""

from __future__ import annotations

import re
from typing import Any

MASK = "***"

_NOT_SECRET = frozenset(
    {"api_key_env", "tokens_file", "max_tokens", "turn_tokens", "session_tokens"}  # counts
)


def is_secret(key: str) -> bool:
    """Whether a key or query parameter named `key` holds a secret (a token, a password)."""
    name = key.lower()
    if name in _NOT_SECRET:
        return False
    return any(word in name for word in ("token", "secret", "password", "key"))


def mask_keys(value: Any) -> Any:
    """`value` (parsed TOML or JSON) with secret-sounding keys' values and URLs masked."""
    if isinstance(value, dict):
        return {
            key: MASK if is_secret(key) and not isinstance(item, dict | list) else mask_keys(item)
            for key, item in value.items()
        }
    if isinstance(value, list):
        return [mask_keys(item) for item in value]
    if isinstance(value, str):
        return mask_urls(value)
    return value


_URL = re.compile(r"(?P<scheme>[^:/?#]+://)(?P<authority>[^/?#]*)(?P<path>[^?#]*)(?P<rest>.*)")
# A URL inside free text: a scheme, then everything up to white space or a quote.
_URL_IN_TEXT = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>`]+")


def mask_url(url: str) -> str:
    """`url` with the password of its user and any secret query parameter masked."""
    match = _URL.fullmatch(url)
    if match is None:
        return url
    authority = match["authority"]
    userinfo, at, host = authority.rpartition("@")
    if at and ":" in userinfo:
        authority = f"{userinfo.partition(':')[0]}:{MASK}@{host}"
    query, hash_, fragment = match["rest"].partition("#")
    if query.startswith("?"):
        params = (param.partition("=") for param in query[1:].split("&"))
        query = "?" + "&".join(
            f"{name}={MASK}" if is_secret(name) else f"{name}{eq}{value}"
            for name, eq, value in params
        )
    return f"{match['scheme']}{authority}{match['path']}{query}{hash_}{fragment}"


def mask_urls(text: str) -> str:
    """`text` with every URL in it masked as by `mask_url` (for logs and error messages)."""
    if "://" not in text:
        return text
    return _URL_IN_TEXT.sub(lambda match: mask_url(match[0]), text)
