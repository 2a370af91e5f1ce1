"""Mutual HMAC authentication of a pool connection, before anything is unpickled.

The pool and its workers share a random key (handed to each worker on its stdin, never on
the command line, where ``ps`` shows it). Each side proves it holds the key by answering the
other's random challenge with ``HMAC-SHA256(key, challenge)``; messages are length-bounded raw
bytes, so a stranger on the port can neither make a side unpickle anything nor hold it up
for longer than ``timeout``.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from multiprocessing.connection import Connection

__all__ = ["challenge", "respond"]

_SIZE = 32


def _proof(key: bytes, nonce: bytes) -> bytes:
    return hmac.new(key, nonce, hashlib.sha256).digest()


def _receive(conn: Connection, timeout: float) -> bytes | None:
    if not conn.poll(timeout):
        return None
    try:
        return conn.recv_bytes(_SIZE * 2)
    except (OSError, EOFError):
        return None


def challenge(conn: Connection, key: bytes, timeout: float = 10.0) -> bool:
    """The accepting side: check the peer's proof, then prove ourselves. ``False``: a
    stranger (close the connection)."""
    nonce = os.urandom(_SIZE)
    conn.send_bytes(nonce)
    reply = _receive(conn, timeout)
    if reply is None or not hmac.compare_digest(reply, _proof(key, nonce)):
        return False
    theirs = _receive(conn, timeout)
    if theirs is None:
        return False
    conn.send_bytes(_proof(key, theirs))
    return True


def respond(conn: Connection, key: bytes, timeout: float = 60.0) -> bool:
    """The connecting side: prove we hold the key, then check the other side does."""
    nonce = _receive(conn, timeout)
    if nonce is None:
        return False
    conn.send_bytes(_proof(key, nonce))
    mine = os.urandom(_SIZE)
    conn.send_bytes(mine)
    reply = _receive(conn, timeout)
    return reply is not None and hmac.compare_digest(reply, _proof(key, mine))
