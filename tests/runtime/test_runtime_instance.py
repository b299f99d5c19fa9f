"""PolicyInstance: the raw ABI calls, their results, and how guest mistakes are reported."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from wat_modules import score_input, snapshot, wasm

from epick import abi
from epick.runtime import (
    PolicyCallError,
    PolicyError,
    PolicyLoadError,
    PolicyOutputError,
    Runtime,
)


def state(count: int, snapshots: int = 0) -> bytes:
    return struct.pack("<ii", count, snapshots)


def test_score_returns_one_float64_per_candidate(load):
    inst = load("counter").instantiate()
    scores = inst.score(score_input(5), 5)
    assert scores.dtype == np.float64
    assert scores.tolist() == [0.0] * 5


def test_hooks_change_state_that_later_scores_see(load):
    inst = load("counter").instantiate()
    inst.pre_request(b"\x93\x90\xa0\x00")
    inst.pre_request(b"\x93\x90\xa0\x00")
    assert inst.score(score_input(3), 3).tolist() == [0.002] * 3


def test_score_returns_a_copy_not_a_view_of_guest_memory(load):
    inst = load("counter").instantiate()
    first = inst.score(score_input(2), 2)
    inst.pre_request(b"x")
    inst.score(score_input(2), 2)
    assert first.tolist() == [0.0, 0.0]


def test_inputs_larger_than_the_first_buffer_grow_it(load):
    inst = load("counter").instantiate()
    big = score_input(1000)  # ~30 KiB inline snapshot, over the initial 16 KiB
    assert len(big) > 16 << 10
    assert inst.score(big, 1000).shape == (1000,)
    assert inst.score(score_input(3), 3).tolist() == [0.0] * 3


def test_scores_are_returned_raw_nan_included(load):
    inst = load("constant", value="nan", extra=0).instantiate()
    assert np.isnan(inst.score(score_input(3), 3)).all()


@pytest.mark.parametrize("value", ["inf", "-inf", "1.5", "-0.25"])
def test_out_of_range_scores_are_returned_raw(load, value):
    inst = load("constant", value=value, extra=0).instantiate()
    assert inst.score(score_input(2), 2).tolist() == [float(value)] * 2


def test_too_few_scores_is_an_output_error(load):
    inst = load("constant", value="0.5", extra=-2).instantiate()
    with pytest.raises(PolicyOutputError) as err:
        inst.score(score_input(5), 5)
    assert str(err.value) == "policy 'constant': score wrote 3 of 5 scores (first missing: candidate 3)"
    assert err.value.export == "score"


def test_too_many_scores_is_an_output_error(load):
    inst = load("constant", value="0.5", extra=1).instantiate()
    with pytest.raises(PolicyOutputError) as err:
        inst.score(score_input(5), 5)
    assert str(err.value) == "policy 'constant': score wrote more than the 5 scores asked for"


def test_filter_returns_a_bool_keep_mask(load):
    inst = load("keep_even").instantiate()
    mask = inst.filter(score_input(5), 5)
    assert mask.dtype == np.bool_
    assert mask.tolist() == [True, False, True, False, True]


def test_a_scorer_has_no_filter(load):
    inst = load("counter").instantiate()
    assert inst.has("score") and not inst.has("filter")
    with pytest.raises(PolicyError) as err:
        inst.filter(score_input(1), 1)
    assert str(err.value) == "policy 'counter': does not export 'filter'"


def test_a_non_zero_return_carries_the_guests_message(load):
    inst = load("flaky").instantiate()
    with pytest.raises(PolicyCallError) as err:
        inst.score(score_input(3), 3)
    assert str(err.value) == "policy 'flaky': score returned 3: odd candidate count"
    assert (err.value.status, err.value.message, err.value.export) == (3, "odd candidate count", "score")
    assert inst.score(score_input(2), 2).tolist() == [0.25, 0.25]


def test_an_invalid_utf8_error_message_is_replaced_and_control_bytes_escaped(load):
    inst = load("bad_error", ptr=16, len=17).instantiate()
    with pytest.raises(PolicyCallError) as err:
        inst.score(score_input(1), 1)
    assert err.value.message == "\ufffd\ufffdbad\\x1b[31mred\\x00end"


def test_an_error_message_outside_memory_is_reported_as_unreadable(load):
    inst = load("bad_error", ptr=1 << 20, len=10).instantiate()
    with pytest.raises(PolicyCallError) as err:
        inst.score(score_input(1), 1)
    assert err.value.message == "(unreadable error message: 10 bytes at 1048576, outside memory)"


def test_a_huge_error_message_is_cut(load):
    inst = load("bad_error", ptr=16, len=-1).instantiate()  # error_len() = 0xFFFFFFFF
    with pytest.raises(PolicyCallError) as err:
        inst.score(score_input(1), 1)
    assert err.value.message.endswith("… (4294967295 bytes, cut)")
    assert len(err.value.message) < 2000


def test_an_empty_error_message_says_so(load):
    inst = load("bad_error", ptr=16, len=0).instantiate()
    with pytest.raises(PolicyCallError) as err:
        inst.score(score_input(1), 1)
    assert str(err.value) == "policy 'bad_error': score returned 7: (no error message)"


def test_init_refusing_its_params_is_a_load_error_with_the_guests_message(load):
    mod = load("init_error")
    with pytest.raises(PolicyLoadError) as err:
        mod.instantiate({"foo": 1})
    assert str(err.value) == "policy 'init_error': init refused its params: unknown param 'foo'"
    assert err.value.message == "unknown param 'foo'"
    assert err.value.export == "init"


def test_params_must_be_a_str_keyed_dict(load):
    mod = load("counter")
    with pytest.raises(PolicyLoadError) as err:
        mod.instantiate({1: "x"})  # type: ignore[dict-item]
    assert str(err.value) == "policy 'counter': params must be a dict with str keys, got {1: 'x'}"


def test_params_that_msgpack_cannot_encode_are_a_load_error(load):
    with pytest.raises(PolicyLoadError, match=r"^policy 'counter': params cannot be encoded as msgpack: "):
        load("counter").instantiate({"when": object()})


def test_re_init_resets_state(load):
    inst = load("counter").instantiate()
    inst.pre_request(b"x")
    inst.init({})
    assert inst.export_state() == state(0)


def test_describe_decodes_the_guests_map(load):
    assert load("counter").instantiate().describe() == abi.Describe(name="counter")


def test_describe_defaults_to_the_module_name_when_not_exported(load):
    assert load("flaky").instantiate().describe() == abi.Describe(name="flaky", kind="custom")


def test_state_round_trips_into_a_new_instance(load):
    mod = load("counter")
    old = mod.instantiate()
    old.pre_request(b"x")
    old.set_snapshot(abi.encoder.encode(snapshot(2)))
    new = mod.instantiate()
    new.import_state(old.export_state())
    assert new.export_state() == state(1, 1)


def test_an_import_the_guest_refuses_is_a_call_error(load):
    inst = load("counter").instantiate()
    with pytest.raises(PolicyCallError) as err:
        inst.import_state(b"short")
    assert str(err.value) == "policy 'counter': import_state returned 1: bad state length"


def test_export_state_without_the_export_says_so(load):
    with pytest.raises(PolicyError) as err:
        load("flaky").instantiate().export_state()
    assert str(err.value) == "policy 'flaky': does not export 'export_state'"


def test_instances_of_one_module_do_not_share_state(load):
    mod = load("counter")
    a, b = mod.instantiate(), mod.instantiate()
    a.pre_request(b"x")
    assert (a.export_state(), b.export_state()) == (state(1), state(0))


def test_an_instance_of_a_closed_runtime_refuses_calls():
    rt = Runtime()
    inst = rt.compile(wasm("counter"), name="counter").instantiate()
    rt.close()
    with pytest.raises(RuntimeError, match=r"^policy 'counter': its Runtime is closed"):
        inst.score(score_input(1), 1)


def test_a_closed_instance_refuses_calls(load):
    inst = load("counter").instantiate()
    inst.close()
    for call in (lambda: inst.score(score_input(1), 1), lambda: inst.describe(), lambda: inst.init({})):
        with pytest.raises(RuntimeError) as err:
            call()
        assert str(err.value) == "policy 'counter': instance is closed"
