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
