"""Whether a host name means this machine: the one answer every part of ftkit uses (a plan deciding to start a
node without ssh, a hostfile refusing this machine twice, teardown and the owner check deciding whether a pid can
be checked here)."""

from __future__ import annotations

import functools
import ipaddress
import os
import socket

LOCAL_HOSTS = ("localhost", "127.0.0.1")  # how plans name this machine


def is_local(name: str) -> bool:
    """``localhost`` (or ``localhost.localdomain``), a loopback address, this machine's hostname or its FQDN, in any
    case and with or without a trailing dot."""
    n = name.lower().rstrip(".")
    if n in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(n).is_loopback
    except ValueError:
        pass
    if n in (socket.gethostname().lower(), os.uname().nodename.lower()):
        return True
    return n == _fqdn()


@functools.lru_cache(maxsize=1)
def _fqdn() -> str:
    # getfqdn may ask a resolver: only for names that are not obviously local, and once.
    return socket.getfqdn().lower().rstrip(".")


def is_local_address(addr: str) -> bool:
    """Whether this machine can listen on ``addr`` (one of its own interfaces' addresses)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((addr, 0))
        return True
    except OSError:
        return False
