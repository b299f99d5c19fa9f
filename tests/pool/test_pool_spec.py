"""EndpointSpec: the address is validated, the metrics URL defaults from it."""

from __future__ import annotations

import msgspec
import pytest

from epick.pool import EndpointSpec


def test_metrics_url_defaults_to_the_address():
    assert EndpointSpec(address="10.0.0.7:8000").url == "http://10.0.0.7:8000/metrics"


def test_explicit_metrics_url_wins():
    spec = EndpointSpec(address="10.0.0.7:8000", metrics_url="http://10.0.0.7:9090/m")
    assert spec.url == "http://10.0.0.7:9090/m"


def test_ipv6_address_is_accepted():
    assert EndpointSpec(address="[::1]:8000").url == "http://[::1]:8000/metrics"


@pytest.mark.parametrize(
    ("address", "problem"),
    [
        ("10.0.0.7", "has no port"),
        ("10.0.0.7:", "has no port"),
        (":8000", "has no host"),
        ("pod:http", "has an invalid port"),
        ("pod:70000", "has an invalid port"),
        ("pod:0", "has an invalid port"),
        ("http://pod:80", "is not host:port"),
    ],
)
def test_bad_address_is_refused_with_the_value_and_an_example(address, problem):
    with pytest.raises(ValueError) as info:
        EndpointSpec(address=address)
    assert str(info.value) == (
        f"endpoint address {address!r} {problem}: expected 'host:port', "
        "e.g. '10.0.0.7:8000' or '[::1]:8000'"
    )


def test_bad_metrics_url_names_the_endpoint():
    with pytest.raises(ValueError) as info:
        EndpointSpec(address="pod:80", metrics_url="pod:80/metrics")
    assert str(info.value) == (
        "metrics_url 'pod:80/metrics' of endpoint 'pod:80' is not an http(s) URL "
        "(e.g. 'http://10.0.0.7:8000/metrics')"
    )


def test_decoding_a_config_reports_the_path_of_a_bad_spec():
    with pytest.raises(msgspec.ValidationError) as info:
        msgspec.convert({"endpoints": [{"address": "a:1"}, {"address": "b"}]},
                        dict[str, list[EndpointSpec]])
    assert str(info.value) == (
        "endpoint address 'b' has no port: expected 'host:port', "
        "e.g. '10.0.0.7:8000' or '[::1]:8000' - at `$[...][1]`"
    )


def test_unknown_fields_and_engines_are_refused_when_decoding():
    with pytest.raises(msgspec.ValidationError, match="Object contains unknown field `adress`"):
        msgspec.convert({"address": "a:1", "adress": "x"}, EndpointSpec)
    with pytest.raises(msgspec.ValidationError, match=r"Invalid enum value 'tgi' - at `\$.engine`"):
        msgspec.convert({"address": "a:1", "engine": "tgi"}, EndpointSpec)


def test_engine_is_checked_on_direct_construction_too():
    with pytest.raises(ValueError, match="engine 'tgi' of endpoint 'a:1' is not one of vllm, sglang, trtllm"):
        EndpointSpec(address="a:1", engine="tgi")  # type: ignore[arg-type]
