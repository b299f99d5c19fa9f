"""to_request remembers model and adapter names that passed their checks (a name's checks
depend on the name alone); a bad name is refused every time, whichever field it is in."""

from __future__ import annotations

import pytest

from epick.api import validate
from epick.api.gen.epick.v1 import picker_pb2 as pb
from epick.api.validate import InvalidArgument, to_request


@pytest.fixture(autouse=True)
def fresh_names(monkeypatch):
    monkeypatch.setattr(validate, "_GOOD_NAMES", set())


@pytest.mark.parametrize("bad", ["a,b", " m", "m\x00", "x" * 300])
def test_a_bad_name_is_refused_on_every_request_in_either_field(bad):
    for _ in range(3):
        with pytest.raises(InvalidArgument, match="PickRequest.model"):
            to_request(pb.PickRequest(model=bad))
        with pytest.raises(InvalidArgument, match="PickRequest.adapter"):
            to_request(pb.PickRequest(model="m", adapter=bad))
    assert bad not in validate._GOOD_NAMES


def test_a_good_name_is_checked_once_then_found():
    calls = []
    real = validate._check_name

    def counting(field, value, **kw):
        calls.append(value)
        return real(field, value, **kw)

    validate._check_name = counting
    try:
        for _ in range(5):
            r = to_request(pb.PickRequest(model="llama", adapter="sql"))
            assert (r.model, r.adapter) == ("llama", "sql")
        to_request(pb.PickRequest(model="sql", adapter="llama"))  # same names, other fields
    finally:
        validate._check_name = real
    assert sorted(calls) == ["llama", "sql"]


def test_an_empty_model_is_required_every_time():
    for _ in range(2):
        with pytest.raises(InvalidArgument, match="PickRequest.model is required"):
            to_request(pb.PickRequest(model=""))


def test_the_remembered_names_are_bounded(monkeypatch):
    monkeypatch.setattr(validate, "_MAX_GOOD_NAMES", 10)
    for k in range(50):
        to_request(pb.PickRequest(model=f"m{k}"))
    assert len(validate._GOOD_NAMES) == 10
    with pytest.raises(InvalidArgument):  # past the bound names are still checked
        to_request(pb.PickRequest(model="m,51"))


def test_slos_and_the_token_estimate_are_what_they_were():
    r = to_request(pb.PickRequest(model="m", prompt="x" * 9))
    assert (r.slo_ttft_ms, r.slo_tpot_ms, r.prompt_tokens) == (0, 0, 3)
    r = to_request(pb.PickRequest(model="m", prompt="abc", slo_ttft_ms=200, slo_tpot_ms=0,
                                  prompt_tokens=7))
    assert (r.slo_ttft_ms, r.slo_tpot_ms, r.prompt_tokens) == (200, 0, 7)
    r = to_request(pb.PickRequest(model="m", headers={"x-slo-tpot-ms": "12.4",
                                                      "x-llm-d-slo-ttft-ms": "90"}))
    assert (r.slo_ttft_ms, r.slo_tpot_ms) == (90, 12)
    with pytest.raises(InvalidArgument, match="x-slo-ttft-ms"):
        to_request(pb.PickRequest(model="m", headers={"x-slo-ttft-ms": "soon"}))


def test_an_optional_field_set_to_zero_is_set_and_an_unset_one_is_not(monkeypatch):
    """HasField is asked only of a zero: a zero that was sent still wins."""
    monkeypatch.setattr(validate, "random_seed", lambda: 99)
    r = to_request(pb.PickRequest(model="m", prompt="x" * 9, seed=0, prompt_tokens=0))
    assert (r.seed, r.prompt_tokens) == (0, 0)
    r = to_request(pb.PickRequest(model="m", prompt="x" * 9))
    assert (r.seed, r.prompt_tokens) == (99, 3)
    r = to_request(pb.PickRequest(model="m", seed=5, prompt_tokens=2))
    assert (r.seed, r.prompt_tokens) == (5, 2)
    # A field set to 0 beats a header; an unset one lets the header speak.
    headers = {"x-slo-ttft-ms": "40", "x-slo-tpot-ms": "8"}
    r = to_request(pb.PickRequest(model="m", headers=headers, slo_ttft_ms=0))
    assert (r.slo_ttft_ms, r.slo_tpot_ms) == (0, 8)


@pytest.mark.parametrize("field", ["slo_ttft_ms", "slo_tpot_ms"])
@pytest.mark.parametrize("headers", [{}, {"x-other": "1"}])
def test_an_slo_over_a_day_is_refused_the_same_with_or_without_headers(field, headers):
    with pytest.raises(InvalidArgument) as got:
        to_request(pb.PickRequest(model="m", headers=headers, **{field: 86_400_001}))
    assert str(got.value) == f"PickRequest.{field} is 86400001; the limit is 86400000"
    r = to_request(pb.PickRequest(model="m", headers=headers, **{field: 86_400_000}))
    assert getattr(r, field) == 86_400_000
