"""``kvferry router --epp-port``: what a gateway cannot do is refused at start-up, naming the flag."""

from __future__ import annotations

import pytest

from services.cli import build_parser
from services.router.cli import run, settings_from_args
from services.router.epp.addresses import endpoint_address


def router_args(*flags: str):  # noqa: ANN201 - argparse.Namespace
    argv = ["router", "--tokenizer", "/nonexistent/model", *flags]
    return build_parser(argv).parse_args(argv)


def test_epp_settings_reach_the_router_settings() -> None:
    args = router_args("--engine", "http://10.0.0.5:8000", "--epp-port", "9002", "--epp-fallbacks", "2")
    epp = settings_from_args(args).epp
    assert epp is not None
    assert (epp.host, epp.port, epp.fallbacks) == ("127.0.0.1", 9002, 2)
    assert settings_from_args(router_args("--engine", "http://10.0.0.5:8000")).epp is None


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ("--prefill", "http://10.0.0.1:8000", "--decode", "http://10.0.0.2:8000", "--epp-port", "9002"),
            "aggregated pools only",
        ),
        (("--engine", "http://engine-0.pool.svc:8000", "--epp-port", "9002"), "http://IP:PORT"),
        (
            ("--engine", "http://10.0.0.5:8000", "--api-key", "k", "--salt-from-api-key", "--epp-port", "9"),
            "--salt-from-api-key cannot work through --epp-port",
        ),
        (("--engine", "http://10.0.0.5:8000", "--epp-fallbacks", "1"), "--epp-fallbacks needs --epp-port"),
        (("--engine", "http://10.0.0.5:8000", "--port", "9002", "--epp-port", "9002"), "its own port"),
        (("--engine", "http://10.0.0.5:8000", "--epp-port", "9002", "--epp-fallbacks", "9"), "fallbacks"),
    ],
)
def test_what_a_gateway_cannot_do_is_refused_by_name(flags: tuple[str, ...], message: str, capsys) -> None:  # noqa: ANN001
    assert run(router_args(*flags)) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("url", "address"),
    [
        ("http://10.1.2.3:8000", "10.1.2.3:8000"),
        ("http://10.1.2.3:8000/", "10.1.2.3:8000"),
        ("http://[fd00::7]:8000", "[fd00::7]:8000"),
        ("http://engine:8000", None),  # a name: ORIGINAL_DST needs an IP
        ("http://10.1.2.3", None),  # no port
        ("https://10.1.2.3:8000", None),
        ("http://10.1.2.3:8000/v1", None),
    ],
)
def test_endpoint_addresses_are_ip_port(url: str, address: str | None) -> None:
    assert endpoint_address(url) == address
