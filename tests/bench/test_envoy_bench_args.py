"""``epick bench envoy --frontend``: its values checked before anything starts."""

from __future__ import annotations

import pytest

from epick.bench import envoy


def test_an_unknown_front_end_is_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        envoy.main(["load", "--frontend", "python,rust"])
    assert exc.value.code == 2
    assert "--frontend: unknown rust (python, native, native-fixed)" in capsys.readouterr().err


def test_native_without_its_binary_says_how_to_build_it(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("EPICK_EXTPROC_BINARY", str(tmp_path / "epick-extproc"))
    with pytest.raises(SystemExit) as exc:
        envoy.main(["load", "--frontend", "native"])
    assert exc.value.code == 2
    assert "make native" in capsys.readouterr().err


def test_a_native_build_at_a_path_is_split_from_its_front_end_name():
    assert envoy.split_frontend("native@/tmp/base/epick-extproc") == (
        "native", envoy.Path("/tmp/base/epick-extproc"))
    assert envoy.split_frontend("native-fixed@/x") == ("native-fixed", envoy.Path("/x"))
    assert envoy.split_frontend("native") == ("native", None)


def test_a_native_build_path_that_is_no_file_is_refused(capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        envoy.main(["load", "--frontend", f"native@{tmp_path / 'nowhere'}"])
    assert exc.value.code == 2
    assert f"no native worker binary at {tmp_path / 'nowhere'}" in capsys.readouterr().err


def test_a_build_path_on_python_or_an_unknown_name_is_refused(capsys, tmp_path):
    binary = tmp_path / "epick-extproc"
    binary.write_bytes(b"")
    for value, said in ((f"python@{binary}", "@PATH names a native worker binary"),
                        (f"rust@{binary}", "--frontend: unknown rust")):
        with pytest.raises(SystemExit) as exc:
            envoy.main(["load", "--frontend", value])
        assert exc.value.code == 2
        assert said in capsys.readouterr().err


def test_the_epick_started_for_a_native_build_path_runs_that_binary(monkeypatch, tmp_path):
    """start_epick passes the path as EPICK_EXTPROC_BINARY and writes frontend = "native"
    (the fixed one keeps EPICK_EXTPROC_FIXED too)."""
    seen = []

    class _Proc:
        def __init__(self, argv, env=None, **_kw):
            seen.append((argv, env))

    monkeypatch.setattr(envoy.subprocess, "Popen", _Proc)
    monkeypatch.setattr(envoy, "wait_port", lambda *_a, **_kw: None)
    envoy.start_epick("127.0.0.1:1", tmp_path, frontend="native-fixed@/opt/base/epick-extproc")
    envoy.start_epick("127.0.0.1:1", tmp_path, frontend="native")
    (fixed_argv, fixed_env), (_, plain_env) = seen
    assert fixed_env["EPICK_EXTPROC_BINARY"] == "/opt/base/epick-extproc"
    assert fixed_env["EPICK_EXTPROC_FIXED"] == "1"
    assert plain_env is None
    confs = sorted(p.read_text() for p in tmp_path.glob("epick-*.toml"))
    assert len(confs) == 2 and all('frontend = "native"' in c for c in confs)
