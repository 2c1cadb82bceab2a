"""Which Host headers a server answers (:mod:`banaserve.api.host_names`; DNS rebinding)."""

from __future__ import annotations

import pytest

from banaserve.api.host_names import allowed_host_names, check_host, host_name
from banaserve.api.request_limits import RequestRejected


@pytest.mark.parametrize(
    ("header", "name"),
    [("localhost:30000", "localhost"), ("127.0.0.1", "127.0.0.1"), ("[::1]:8000", "::1"),
     ("Evil.Example:80", "evil.example"), ("::1", "::1")],
)  # fmt: skip
def test_the_name_of_a_host_header(header: str, name: str) -> None:
    assert host_name(header) == name


def test_a_loopback_server_answers_to_loopback_names_only() -> None:
    allowed = allowed_host_names("127.0.0.1")
    for header in ("127.0.0.1:30000", "localhost:30000", "[::1]:30000", None):
        check_host(header, allowed)
    with pytest.raises(RequestRejected, match="'evil.example'") as refused:
        check_host("evil.example:30000", allowed)
    assert refused.value.status == 400 and "--allowed-hosts" in refused.value.message


def test_a_server_on_other_addresses_answers_any_name_unless_told() -> None:
    assert allowed_host_names("0.0.0.0") is None
    check_host("anything.example", allowed_host_names("0.0.0.0"))
    listed = allowed_host_names("0.0.0.0", ["llm.example.com", " "])
    check_host("LLM.example.com:443", listed)
    check_host("localhost:30000", listed)
    with pytest.raises(RequestRejected):
        check_host("other.example.com", listed)
    # Listed names add to a loopback server's too (a proxy that keeps the client's Host).
    check_host("llm.example.com", allowed_host_names("127.0.0.1", ["llm.example.com"]))
