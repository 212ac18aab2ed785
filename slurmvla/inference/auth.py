"""The API key a client must send (``Authorization: Api-Key <key>``, what openpi's
``WebsocketClientPolicy(host, port, api_key=...)`` sends): where it comes from (``serve.api_key_env``,
``serve.api_key_file``), how it is compared, and whether a listening address is this machine's only.
The key is never logged, never shown by a repr and never part of the config. A server that listens beyond
this machine needs a key, or ``serve.allow_unauthenticated=true`` (:func:`check_exposure`).
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os

log = logging.getLogger("slurmvla.serve")

# What the default serve.api_key_env names: this one may be unset (no key); another name must be set.
DEFAULT_KEY_ENV = "SLURMVLA_API_KEY"
AUTH_SCHEME = "api-key"


class ApiKey:
    """The key a client must send (``Authorization: Api-Key <key>``), and where it came from. Its
    repr and str never show the key."""

    def __init__(self, key: str, source: str):
        self._key, self.source = key.encode("ascii"), source

    def matches(self, header: str | None) -> bool:
        scheme, _, given = (header or "").strip().partition(" ")
        given_bytes = given.strip().encode("utf-8", "replace")
        # Compared in constant time, and always compared, whatever the scheme.
        same = hmac.compare_digest(given_bytes, self._key)
        return same and scheme.lower() == AUTH_SCHEME

    def __repr__(self) -> str:
        return f"ApiKey(from {self.source})"

    __str__ = __repr__


def _check_key(key: str, source: str) -> str:
    key = key.strip()
    if not key:
        raise ValueError(f"{source} holds an empty API key; put the key in it (e.g. python -c 'import secrets; "
                         "print(secrets.token_urlsafe(32))'), or leave it unset to serve without a key")
    if not all(0x21 <= ord(c) <= 0x7E for c in key):
        raise ValueError(f"the API key in {source} holds spaces, control or non-ASCII characters, which an HTTP "
                         "header cannot carry as is; use printable ASCII (e.g. secrets.token_urlsafe(32))")
    return key


def read_api_key(serve, environ=None) -> ApiKey | None:
    """The key from ``serve.api_key_file`` and/or the variable ``serve.api_key_env`` names (None: no
    key). A file that cannot be read, an empty key, a non-default variable that is unset, or two
    sources holding different keys: ValueError naming the source (never the key)."""
    env = os.environ if environ is None else environ
    found: list[tuple[str, str]] = []
    if serve.api_key_env is not None:
        source = f"${serve.api_key_env}"
        if serve.api_key_env in env:
            found.append((_check_key(env[serve.api_key_env], source), source))
        elif serve.api_key_env != DEFAULT_KEY_ENV:
            raise ValueError(f"serve.api_key_env={serve.api_key_env} names a variable that is not set in the server's "
                             f"environment; export it (sbatch passes the submitting shell's environment), or set "
                             f"serve.api_key_env=null")
    if serve.api_key_file is not None:
        path = os.path.expanduser(serve.api_key_file)
        source = f"serve.api_key_file={serve.api_key_file}"
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read(64 * 1024)
            mode = os.stat(path).st_mode
        except (OSError, UnicodeDecodeError) as e:
            why = e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
            raise ValueError(f"{source}: cannot read the API key file ({why}); give a readable file holding the key "
                             f"(chmod 600), or serve.api_key_file=null") from None
        found.append((_check_key(text, source), source))
        if mode & 0o077:
            log.warning("%s can be read by other users (mode %o); chmod 600 it", source, mode & 0o777)
    if len(found) == 2 and found[0][0] != found[1][0]:
        raise ValueError(f"{found[0][1]} and {found[1][1]} hold different API keys; give one of them (or the same key)")
    return ApiKey(found[-1][0], " and ".join(s for _, s in found)) if found else None


def is_local(host: str) -> bool:
    """Whether ``host`` is a loopback address (only this machine can connect)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, api_key: ApiKey | None, allow_unauthenticated: bool = False,
                   api_key_env: str | None = DEFAULT_KEY_ENV) -> None:
    """A server on ``host`` without ``api_key`` lets anyone who reaches the port drive the policy (and the
    robot behind it): allowed on a loopback address, or when ``allow_unauthenticated`` says so; otherwise a
    ValueError naming the ways out."""
    if api_key is not None or allow_unauthenticated or is_local(host):
        return
    env = f"export {api_key_env}=<key>" if api_key_env else "serve.api_key_env=<VARIABLE> holding it"
    raise ValueError(f"serve.host={host or '(every interface)'} listens beyond this machine without an API key, so "
                     f"anyone who can reach the port could drive the robot; either keep it to this machine "
                     f"(serve.host=127.0.0.1, --host 127.0.0.1) or give a key ({env}, or serve.api_key_file=<file "
                     f"holding it, chmod 600>; clients send 'Authorization: Api-Key <key>', openpi's "
                     f"WebsocketClientPolicy(host, port, api_key=...)); serve.allow_unauthenticated=true serves "
                     f"without one")
