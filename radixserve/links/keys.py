"""CurveZMQ keys and the security of one process's ZeroMQ sockets.

A process's ZeroMQ security is one value, and callers never ask which kind they hold:

- ``CurveKeys``: the process's key pair (the server key of the sockets it binds, the client key
  of those it connects) and the client public keys its server sockets accept; its own key is
  always among them, so one key pair shared by a whole fleet needs nothing else.
- ``PLAIN``: unauthenticated, unencrypted sockets, only when asked for by name
  (``--zmq-unauthenticated``).

``server(sock)`` before a bind and ``client(sock, server_key)`` before a connect set a socket
up; ``public_key`` is what a server tells its clients (``None`` for ``PLAIN``).

Where the key pair comes from (``load_security``): a key file (``--zmq-key FILE``), else
``$RADIXSERVE_ZMQ_KEY`` (the secret key itself, Z85), else the user's default key file
``zmq.key_secret`` in ``$XDG_CONFIG_HOME/radixserve`` (``~/.config/radixserve``), created
(mode 0600) on first use: one user's processes on one machine share it with no setup. Key
files are ZeroMQ's certificate format (pyzmq's ``zmq.auth`` and czmq read and write it):
``NAME.key_secret`` holds the pair, ``NAME.key`` the public key alone. Allow-list entries
(``--zmq-allow``, ``$RADIXSERVE_ZMQ_ALLOW`` comma-separated): a public key (40 Z85 characters),
a key file, or a directory (its ``*.key`` files).

A client must know the server's public key. Servers publish theirs beside their endpoints
(``/kv_events``, ``/disagg/info``: ``curve_public_key``), and a KV transfer endpoint may carry
it: ``tcp://HOST:PORT?curve=KEY`` (``split_endpoint``). Without one a client expects its own
public key (the shared fleet key pair).
"""

from __future__ import annotations

import datetime
import errno
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth
from zmq.utils import z85

KEY_ENV = "RADIXSERVE_ZMQ_KEY"
ALLOW_ENV = "RADIXSERVE_ZMQ_ALLOW"
ENDPOINT_KEY = "?curve="  # tcp://HOST:PORT?curve=KEY: an endpoint and its server's public key
Z85_KEY_LENGTH = 40


class LinkKeyError(ValueError):
    """A key, key file or allow-list entry that cannot be used (the message names it)."""


def check_key(key: bytes | str, what: str) -> bytes:
    """``key`` as Z85 bytes if it is a 32-byte key in Z85, else ``LinkKeyError`` naming ``what``."""
    raw = key.encode() if isinstance(key, str) else key
    raw = raw.strip()
    try:
        ok = len(raw) == Z85_KEY_LENGTH and len(z85.decode(raw)) == 32
    except (ValueError, KeyError, IndexError, TypeError):
        ok = False
    if not ok:
        raise LinkKeyError(f"{what}: not a CurveZMQ key (40 characters of Z85)")
    return raw


@dataclass(frozen=True)
class Plain:
    """Unauthenticated, unencrypted ZeroMQ sockets: anyone who reaches them may use them."""

    public_key: None = None

    def server(self, sock: zmq.Socket) -> None:
        pass

    def client(self, sock: zmq.Socket, server_key: bytes | None = None) -> None:
        pass

    def describe(self) -> str:
        return "unauthenticated (plain ZeroMQ)"


PLAIN = Plain()


@dataclass(frozen=True)
class CurveKeys:
    public_key: bytes  # Z85
    secret_key: bytes = field(repr=False)
    allowed: frozenset[bytes] = frozenset()  # client keys accepted besides the own one

    def __post_init__(self) -> None:
        check_key(self.public_key, "the public key")
        check_key(self.secret_key, "the secret key")
        if zmq.curve_public(self.secret_key) != self.public_key:
            raise LinkKeyError("the public key does not belong to the secret key")

    @classmethod
    def generate(cls) -> CurveKeys:
        public, secret = zmq.curve_keypair()
        return cls(public, secret)

    @classmethod
    def from_secret(cls, secret: bytes | str, allowed: Iterable[bytes] = ()) -> CurveKeys:
        secret = check_key(secret, "the secret key")
        return cls(zmq.curve_public(secret), secret, frozenset(allowed))

    def accepts(self, client_key: bytes) -> bool:
        return client_key == self.public_key or client_key in self.allowed

    def server(self, sock: zmq.Socket) -> None:
        sock.curve_secretkey = self.secret_key
        sock.curve_server = True

    def client(self, sock: zmq.Socket, server_key: bytes | None = None) -> None:
        sock.curve_publickey = self.public_key
        sock.curve_secretkey = self.secret_key
        sock.curve_serverkey = server_key or self.public_key

    def describe(self) -> str:
        n = len(self.allowed - {self.public_key})
        more = f" and {n} more client key{'s' * (n != 1)}" if n else ""
        return f"CurveZMQ, public key {self.public_key.decode()}; accepts its own{more}"


ZmqSecurity = CurveKeys | Plain


# ---------------------------------------------------------------------- endpoints
def split_endpoint(endpoint: str) -> tuple[str, bytes | None]:
    """``tcp://HOST:PORT?curve=KEY`` -> (``tcp://HOST:PORT``, KEY); no key: (endpoint, None)."""
    base, sep, key = endpoint.partition(ENDPOINT_KEY)
    if not sep:
        return endpoint, None
    return base, check_key(key, f"the server key in {endpoint!r}")


def join_endpoint(endpoint: str, server_key: bytes | None) -> str:
    """The endpoint carrying its server's public key (as it is, without one)."""
    return f"{endpoint}{ENDPOINT_KEY}{server_key.decode()}" if server_key else endpoint


# ---------------------------------------------------------------------- files
_BANNER = "#   ZeroMQ CURVE {what} Certificate, written by radixserve on {when}\n{note}\n"
_SECRET_NOTE = (
    "#   Keep this file private (mode 0600): it lets its holder into the fleet's sockets.\n"
)


def write_key_files(keys: CurveKeys, base: str | Path) -> tuple[Path, Path]:
    """``BASE.key`` (the public key, to hand out) and ``BASE.key_secret`` (the pair, mode
    0600); refuses to overwrite either."""
    public, secret = Path(f"{base}.key"), Path(f"{base}.key_secret")
    for path in (public, secret):
        if path.exists():
            raise FileExistsError(errno.EEXIST, "exists", str(path))
    when = datetime.datetime.now().isoformat(timespec="seconds")
    pub = keys.public_key.decode()
    body = f'metadata\ncurve\n    public-key = "{pub}"\n'
    _write_new(secret, _BANNER.format(what="Secret", when=when, note=_SECRET_NOTE)
               + body + f'    secret-key = "{keys.secret_key.decode()}"\n', 0o600)  # fmt: skip
    _write_new(public, _BANNER.format(what="Public", when=when, note="") + body, 0o644)
    return public, secret


def _write_new(path: Path, text: str, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def read_key_file(path: str | Path) -> CurveKeys:
    """The key pair in a secret key file (``NAME.key_secret``)."""
    public, secret = _load(path)
    if secret is None:
        raise LinkKeyError(f"{path}: holds a public key only; give the .key_secret file")
    keys = CurveKeys.from_secret(secret)
    if public != keys.public_key:
        raise LinkKeyError(f"{path}: its public key does not belong to its secret key")
    return keys


def _load(path: str | Path) -> tuple[bytes, bytes | None]:
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise LinkKeyError(f"{path}: cannot read a key file ({e})") from e
    check_key(public, f"{path}: the public key")
    return public, secret


def read_allowed(entry: str) -> set[bytes]:
    """The public keys one allow-list entry names: a key, a key file or a directory of them."""
    entry = entry.strip()
    if len(entry) == Z85_KEY_LENGTH and not os.path.exists(entry):
        return {check_key(entry, f"allowed key {entry!r}")}
    if os.path.isdir(entry):
        keys = {_load(p)[0] for p in sorted(Path(entry).glob("*.key"))}
        if not keys:
            raise LinkKeyError(f"{entry}: a directory without public key files (*.key)")
        return keys
    if os.path.isfile(entry):
        return {_load(entry)[0]}
    raise LinkKeyError(f"{entry!r}: neither a public key, a key file nor a directory")


def default_key_path(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    root = env.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(root) / "radixserve" / "zmq.key_secret"


def _default_keys(env: Mapping[str, str]) -> CurveKeys:
    path = default_key_path(env)
    if not path.exists():
        try:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            write_key_files(CurveKeys.generate(), str(path).removesuffix(".key_secret"))
        except FileExistsError:
            pass  # another process of this user made it first: use that one
        except OSError as e:
            raise LinkKeyError(
                f"cannot make the default key file {path} ({e.strerror}): give --zmq-key or "
                f"${KEY_ENV}"
            ) from e
    return read_key_file(path)


def load_security(
    key_file: str | None = None,
    allow: Iterable[str] = (),
    unauthenticated: bool = False,
    env: Mapping[str, str] | None = None,
) -> ZmqSecurity:
    """The security of this process's ZeroMQ sockets from its options (module docstring);
    ``LinkKeyError`` naming the bad file, key or entry."""
    env = os.environ if env is None else env
    allow = list(allow) + [a for a in env.get(ALLOW_ENV, "").split(",") if a.strip()]
    if unauthenticated:
        if key_file or allow:
            raise LinkKeyError("--zmq-unauthenticated takes no --zmq-key or --zmq-allow")
        return PLAIN
    if key_file:
        keys = read_key_file(key_file)
    elif env.get(KEY_ENV):
        keys = CurveKeys.from_secret(check_key(env[KEY_ENV], f"${KEY_ENV}"))
    else:
        keys = _default_keys(env)
    allowed: set[bytes] = set()
    for entry in allow:
        allowed |= read_allowed(entry)
    return CurveKeys(keys.public_key, keys.secret_key, frozenset(allowed))
