"""The vector file format: what a hand-edited TOML file may say, and the errors it gets."""

from __future__ import annotations

import msgspec
import pytest

from epick import abi
from epick.conformance import schema, vectors
from epick.conformance.vectors import VectorError

ONE_ENDPOINT = 'name = "x"\nsnapshot.endpoints = [{ address = "e0" }]\n'


def write(tmp_path, text: str, name: str = "v.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_endpoint_and_request_tables_mirror_the_abi_structs_field_for_field():
    assert schema.Endpoint.__struct_fields__ == abi.EndpointMetrics.__struct_fields__
    assert schema.Request.__struct_fields__ == abi.Request.__struct_fields__


def test_omitted_fields_take_the_abi_defaults(tmp_path):
    vf = vectors.load_file(write(tmp_path, f'kind = "load"\n[[case]]\n{ONE_ENDPOINT}expect.scores = [1.0]\n'))

    case = vf.cases[0]
    assert schema.to_abi_endpoint(case.snapshot.endpoints[0]) == abi.EndpointMetrics(address="e0")
    assert schema.to_abi_request(case.request) == abi.Request()
    assert case.candidate_indices == (0,)
    assert case.expect.tolerance == 1e-9


@pytest.mark.parametrize(
    "body, message",
    [
        pytest.param(
            'name = "x"\nsnapshot.endpoints = [{ address = "e0", waiting = "3" }]\nexpect.scores = [1.0]\n',
            "Expected `int`, got `str` - at `$.case[0].snapshot.endpoints[0].waiting`",
            id="ill-typed-metric",
        ),
        pytest.param(
            'name = "x"\nsnapshot.endpoints = [{ address = "e0", wating = 3 }]\nexpect.scores = [1.0]\n',
            "Object contains unknown field `wating` - at `$.case[0].snapshot.endpoints[0]`",
            id="misspelt-key",
        ),
        pytest.param(
            ONE_ENDPOINT + "expect.scores = [1.0]\nexpect.keep = [true]\n",
            "expect needs exactly one of `scores`, `order`, `keep`; got `scores`, `keep` - at `$.case[0].expect`",
            id="two-expectations",
        ),
        pytest.param(
            ONE_ENDPOINT + "expect.tolerance = 0.1\n",
            "expect needs exactly one of `scores`, `order`, `keep`; got none - at `$.case[0].expect`",
            id="no-expectation",
        ),
        pytest.param(
            ONE_ENDPOINT + "expect.scores = [1.0, 2.0]\n",
            "case 'x': expect.scores has 2 values for 1 candidates - at `$.case[0]`",
            id="score-count",
        ),
        pytest.param(
            ONE_ENDPOINT + "candidates = [3]\nexpect.scores = [1.0]\n",
            "case 'x': candidate 3 is not an endpoint index (the snapshot has 1) - at `$.case[0]`",
            id="candidate-out-of-range",
        ),
        pytest.param(
            'name = "x"\nsnapshot.endpoints = [{ address = "e0" }, { address = "e1" }]\n'
            'expect.scores = [1.0, 1.0]\nexpect.why = ["a"]\n',
            "case 'x': expect.why has 1 entries for 2 candidates (give one per candidate, or a single string) - at `$.case[0]`",
            id="why-count",
        ),
        pytest.param(
            ONE_ENDPOINT + "expect.order = [0, 0]\n",
            "expect.order repeats a position: [0, 0] - at `$.case[0].expect`",
            id="order-repeats",
        ),
        pytest.param(
            ONE_ENDPOINT + 'before = [{ event = "pre_reqest", endpoint = "e0" }]\nexpect.scores = [1.0]\n',
            "Invalid value 'pre_reqest' - at `$.case[0].before[0].event`",
            id="unknown-event",
        ),
        pytest.param(
            ONE_ENDPOINT + "request = { criticality = 3 }\nexpect.scores = [1.0]\n",
            "Expected `int` <= 2 - at `$.case[0].request.criticality`",
            id="criticality-range",
        ),
    ],
)
def test_a_bad_case_is_refused_naming_the_file_and_the_path(tmp_path, body, message):
    path = write(tmp_path, 'kind = "load"\n[[case]]\n' + body)

    with pytest.raises(VectorError) as info:
        vectors.load_file(path)

    assert str(info.value) == f"{path}: {message}"


def test_an_unknown_kind_is_refused(tmp_path):
    path = write(tmp_path, 'kind = "lod"\n')

    with pytest.raises(VectorError, match=r"Invalid enum value 'lod' - at `\$.kind`"):
        vectors.load_file(path)


def test_invalid_toml_is_refused_naming_the_file(tmp_path):
    path = write(tmp_path, 'kind = "load"\n[[case]\n')

    with pytest.raises(VectorError) as info:
        vectors.load_file(path)

    assert str(info.value).startswith(f"{path}: ")


def test_a_missing_file_is_refused_naming_it(tmp_path):
    with pytest.raises(VectorError) as info:
        vectors.load_file(tmp_path / "nope.toml")

    assert str(info.value) == f"{tmp_path / 'nope.toml'}: cannot read vector file: No such file or directory"


def test_events_decode_to_their_tagged_types(tmp_path):
    path = write(
        tmp_path,
        'kind = "lora-affinity"\n[[case]]\n' + ONE_ENDPOINT + """before = [
  { event = "snapshot", timestamp_ms = 5, endpoints = [{ address = "e0" }] },
  { event = "pre_request", request = { adapter = "a" }, endpoint = "e0", timestamp_ms = 6 },
  { event = "post_response", request_id = "r", endpoint = "e0", status = 2 },
]
expect.order = [0]
""",
    )

    before = vectors.load_file(path).cases[0].before

    assert [type(e) for e in before] == [schema.SnapshotEvent, schema.PreRequest, schema.PostResponse]
    assert before[1].request.adapter == "a" and before[1].timestamp_ms == 6
    assert before[2].status == abi.CompletionStatus.CANCELLED


def test_case_params_override_the_files_params_key_by_key(tmp_path):
    path = write(
        tmp_path,
        'kind = "custom"\nparams = { a = 1, b = 2 }\n[[case]]\n' + ONE_ENDPOINT
        + "params = { b = 3 }\nexpect.scores = [1.0]\n",
    )

    (loaded,) = vectors.load("custom", [path])

    assert loaded.params == {"a": 1, "b": 3}
    assert loaded.source == path


def test_a_vector_file_for_another_kind_is_refused(tmp_path):
    path = write(tmp_path, 'kind = "load"\n')

    with pytest.raises(VectorError) as info:
        vectors.load("prefix-cache", [path])

    assert str(info.value) == f"{path}: its kind 'load' does not match the policy's kind 'prefix-cache'"


def test_a_case_name_used_twice_is_refused_naming_both_files(tmp_path):
    path = write(tmp_path, 'kind = "load"\n[[case]]\nname = "load/queue-spread"\n'
                 'snapshot.endpoints = [{ address = "e0" }]\nexpect.scores = [1.0]\n')

    with pytest.raises(VectorError) as info:
        vectors.load("load", [path])

    assert str(info.value) == (
        f"{path}: case name 'load/queue-spread' is already used in {vectors.VECTORS_DIR / 'load.toml'}"
    )


def test_msgspec_errors_are_decode_errors_so_the_loader_catches_them():
    # the loader relies on ValidationError being a DecodeError
    assert issubclass(msgspec.ValidationError, msgspec.DecodeError)


def test_the_readme_example_is_a_valid_vector_file(tmp_path):
    readme = (vectors.VECTORS_DIR.parent / "README.md").read_text()
    example = readme.split("```toml\n", 1)[1].split("```", 1)[0]

    vf = vectors.load_file(write(tmp_path, example))

    (case,) = vf.cases
    assert case.candidate_indices == (1, 0)
    assert [type(e).__name__ for e in case.before] == ["SnapshotEvent", "PreRequest", "PostResponse"]
