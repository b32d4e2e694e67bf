"""One loopback rule (core/serve/limits.py ``is_loopback``) for what ``tierchat serve
--host`` may bind without ``--allow-remote`` and for the ``Host`` / ``Origin`` headers a
keyless server accepts (docs/DESIGN.md §15)."""

from __future__ import annotations

import socket

import pytest
from tierchat.cli.common import CLIError
from tierchat.cli.serve import binds_loopback, check_bind
from tierchat.core.serve.limits import ServeLimits, check_host, check_origin, is_loopback
from tierchat.core.serve.prompts import APIError

LOOPBACK = [
    "127.0.0.1",
    "127.0.0.2",  # all of 127.0.0.0/8 is loopback
    "127.255.255.254",
    "::1",
    "[::1]",
    "0:0:0:0:0:0:0:1",
    "::ffff:127.0.0.1",  # IPv4 loopback mapped into IPv6
    "[::ffff:127.0.0.1]",
    "localhost",
    "LocalHost",
    "localhost.",  # the absolute name
    " localhost ",
    "app.localhost",  # RFC 6761 §6.3: names under .localhost are loopback
    "a.b.LOCALHOST",
]
NOT_LOOPBACK = [
    "0.0.0.0",  # the wildcards bind every interface
    "::",
    "[::]",
    "",
    "192.168.1.5",
    "10.0.0.1",
    "::ffff:192.168.1.5",
    "fe80::1",
    "128.0.0.1",
    "example.com",
    "localhost.example.com",  # a real domain that only starts with the word
    "evil-localhost",
    "notlocalhost",
    "127.0.0.1.example.com",
    "127.1",  # not an address ipaddress reads: a name, resolved by DNS
    "[::1",
    "localhost:8000",  # a Host header's port is cut before the check (host_name)
]


@pytest.mark.parametrize("host", LOOPBACK)
def test_loopback_names_and_addresses(host):
    assert is_loopback(host)


@pytest.mark.parametrize("host", NOT_LOOPBACK)
def test_wildcards_other_addresses_and_other_names_are_not_loopback(host):
    assert not is_loopback(host)


@pytest.mark.parametrize(
    "header", ["localhost:8000", "127.0.0.2:80", "[::1]:8000", "[::1]", "app.localhost:3000"]
)
def test_a_keyless_server_takes_a_loopback_host_header(header):
    check_host(header, "127.0.0.1", ServeLimits())


@pytest.mark.parametrize(
    "header", ["example.com", "rebound.example.com:8000", "0.0.0.0:8000", "[::]:8000"]
)
def test_a_keyless_server_refuses_another_host_header(header):
    with pytest.raises(APIError) as info:
        check_host(header, "127.0.0.1", ServeLimits())
    assert info.value.status == 403 and info.value.code == "host_not_allowed"


def test_origin_follows_the_same_rule():
    for origin in ("http://localhost:3000", "http://[::1]:8000", "https://app.localhost"):
        check_origin(origin, ServeLimits())
    for origin in ("http://example.com", "http://0.0.0.0:8000", "null"):
        with pytest.raises(APIError):
            check_origin(origin, ServeLimits())


# ---------------------------------------------------------------- --host


def _resolving(monkeypatch, table: dict[str, list[str]]) -> None:
    """getaddrinfo answers names from ``table`` (addresses as the kernel writes them)."""
    real = socket.getaddrinfo

    def fake(host, port, *args, **kwargs):
        if host in table:
            fam = {True: socket.AF_INET6, False: socket.AF_INET}
            return [(fam[":" in a], socket.SOCK_STREAM, 6, "", (a, 0)) for a in table[host]]
        if any(c.isalpha() for c in str(host).replace(":", "")):  # no real DNS in a unit test
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", fake)


def test_binding_beyond_loopback_needs_a_flag_and_a_key():
    check_bind("127.0.0.1", False, None)
    check_bind("127.0.0.2", False, None)
    check_bind("::1", False, None)
    for host in ("0.0.0.0", "::", "192.168.1.5"):
        with pytest.raises(CLIError, match="--allow-remote"):
            check_bind(host, False, "key")
        with pytest.raises(CLIError, match="API key"):
            check_bind(host, True, None)
        check_bind(host, True, "key")


def test_a_loopback_name_binds_open_when_it_resolves_to_loopback_only(monkeypatch):
    _resolving(monkeypatch, {"localhost": ["127.0.0.1", "::1"], "app.localhost": ["127.0.0.1"]})
    assert binds_loopback("localhost") and binds_loopback("app.localhost")
    check_bind("localhost", False, None)


def test_a_loopback_name_that_resolves_elsewhere_is_not_loopback(monkeypatch):
    """uvicorn binds every address a name resolves to: a hosts file that points
    ``localhost`` at a LAN address must not open the server without a key."""
    _resolving(monkeypatch, {"localhost": ["127.0.0.1", "192.168.1.5"]})
    assert not binds_loopback("localhost")
    with pytest.raises(CLIError, match="--allow-remote"):
        check_bind("localhost", False, None)
    check_bind("localhost", True, "key")


def test_a_loopback_name_that_does_not_resolve_is_a_usage_error(monkeypatch):
    _resolving(monkeypatch, {})
    with pytest.raises(CLIError, match="does not resolve") as info:
        check_bind("app.localhost", False, None)
    assert info.value.code == 2
    with pytest.raises(CLIError, match="without brackets"):
        check_bind("[::1]", False, None)  # uvicorn takes no brackets either
