"""policy_store.py: admin-loaded policies kept on disk (``[admin] persist_dir``)."""

from __future__ import annotations

import json
import logging

import msgspec
import pytest

from epick.policy_store import PolicyStore, SavedPolicy, StoreError

WASM = b"\x00asm\x01\x00\x00\x00"


def test_a_saved_policy_loads_back_as_it_was_saved(tmp_path):
    store = PolicyStore(tmp_path / "saved")  # the folder is made on the first save
    saved = SavedPolicy(params={"queue_weight": 0.5, "nested": {"a": [1, 2]}}, weight=2.5,
                        shadow=True)
    store.save("load", WASM, saved)
    assert store.load_all() == [("load", WASM, saved)]


def test_the_files_are_the_module_and_a_small_json_without_an_unset_weight(tmp_path):
    PolicyStore(tmp_path).save("p", WASM, SavedPolicy(params={"k": 1}))
    assert (tmp_path / "p.wasm").read_bytes() == WASM
    assert json.loads((tmp_path / "p.json").read_text()) == {
        "version": 1, "params": {"k": 1}, "shadow": False}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.json", "p.wasm"]  # no temp left


def test_saving_again_replaces_both_files(tmp_path):
    store = PolicyStore(tmp_path)
    store.save("p", WASM, SavedPolicy(weight=1.0))
    store.save("p", WASM + b"\x01", SavedPolicy(params={"x": 2}))
    assert store.load_all() == [("p", WASM + b"\x01", SavedPolicy(params={"x": 2}))]


def test_several_policies_load_in_name_order(tmp_path):
    store = PolicyStore(tmp_path)
    for name in ("zeta", "alpha", "mid"):
        store.save(name, name.encode(), SavedPolicy())
    assert [n for n, _, _ in store.load_all()] == ["alpha", "mid", "zeta"]


def test_set_weight_rewrites_the_table_and_keeps_the_rest(tmp_path):
    store = PolicyStore(tmp_path)
    store.save("p", WASM, SavedPolicy(params={"k": 1}, shadow=True))
    assert store.set_weight("p", 3.0) is True
    assert store.load_all() == [("p", WASM, SavedPolicy(params={"k": 1}, weight=3.0,
                                                         shadow=True))]


def test_set_weight_of_a_policy_not_saved_here_says_so_and_writes_nothing(tmp_path):
    store = PolicyStore(tmp_path)
    assert store.set_weight("ghost", 1.0) is False
    assert list(tmp_path.iterdir()) == []


def test_remove_deletes_both_files_and_removing_twice_is_harmless(tmp_path):
    store = PolicyStore(tmp_path)
    store.save("p", WASM, SavedPolicy())
    store.save("q", WASM, SavedPolicy())
    store.remove("p")
    store.remove("p")
    assert [n for n, _, _ in store.load_all()] == ["q"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q.json", "q.wasm"]


def test_a_module_without_its_table_loads_with_the_defaults(tmp_path):
    (tmp_path / "bare.wasm").write_bytes(WASM)
    assert PolicyStore(tmp_path).load_all() == [("bare", WASM, SavedPolicy())]


def test_no_folder_means_nothing_saved(tmp_path):
    assert PolicyStore(tmp_path / "absent").load_all() == []


@pytest.mark.parametrize("table, why", [
    (b"{not json", "malformed"),
    (b'{"version": 1, "params": {}, "colour": "red"}', "unknown field"),
    (b'{"weight": "heavy"}', "Expected `float | null`"),
])
def test_a_bad_table_is_logged_naming_its_file_and_skipped_leaving_both_files(
        tmp_path, caplog, table, why):
    store = PolicyStore(tmp_path)
    store.save("good", WASM, SavedPolicy())
    (tmp_path / "bad.wasm").write_bytes(WASM)
    (tmp_path / "bad.json").write_bytes(table)
    with caplog.at_level(logging.ERROR, logger="epick.policies"):
        assert [n for n, _, _ in store.load_all()] == ["good"]
    [record] = caplog.records
    assert "saved policy 'bad' not loaded (left on disk)" in record.getMessage()
    assert str(tmp_path / "bad.json") in record.getMessage()
    assert why.lower() in record.getMessage().lower()
    assert (tmp_path / "bad.json").read_bytes() == table and (tmp_path / "bad.wasm").exists()


def test_an_unreadable_module_is_logged_and_skipped(tmp_path, caplog):
    (tmp_path / "dir.wasm").mkdir()
    with caplog.at_level(logging.ERROR, logger="epick.policies"):
        assert PolicyStore(tmp_path).load_all() == []
    assert "saved policy 'dir' not loaded" in caplog.text


def test_set_weight_on_a_bad_table_refuses_naming_the_file(tmp_path):
    store = PolicyStore(tmp_path)
    store.save("p", WASM, SavedPolicy())
    (tmp_path / "p.json").write_bytes(b"[]")
    with pytest.raises(StoreError, match=r"p\.json"):
        store.set_weight("p", 1.0)


def test_a_save_that_cannot_land_is_a_store_error_naming_the_file_and_leaves_no_temp(tmp_path):
    (tmp_path / "p.wasm").mkdir()  # something in the way that a rename cannot replace
    with pytest.raises(StoreError, match=r"p\.wasm: cannot save"):
        PolicyStore(tmp_path).save("p", WASM, SavedPolicy())
    assert [p.name for p in tmp_path.iterdir()] == ["p.wasm"]


def test_a_remove_that_cannot_delete_is_a_store_error_naming_the_file(tmp_path):
    (tmp_path / "p.wasm").mkdir()
    with pytest.raises(StoreError, match=r"p\.wasm: cannot delete"):
        PolicyStore(tmp_path).remove("p")


def test_the_table_refuses_unknown_fields_when_decoded():
    with pytest.raises(msgspec.ValidationError, match="colour"):
        msgspec.json.decode(b'{"colour": 1}', type=SavedPolicy)
