"""Nothing loaded while serving is lost: a config reload keeps admin-loaded policies
(and admin weights), says so, and `[admin] persist_dir` carries them across a restart."""

from __future__ import annotations

import logging
import time

from epick_service import TOKEN, config_text, running
from fakes import vllm_page

from epick import config as cfg
from epick.api.gen.epick.v1 import admin_pb2 as apb
from epick.config import resolve_module

AUTH = (("authorization", f"Bearer {TOKEN}"),)
LORA = resolve_module("lora-affinity").read_bytes()
LOAD = resolve_module("load").read_bytes()


def wait_for(predicate, timeout=60.0):  # generous: a reload vets modules on a busy machine
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def admin_config(addresses, tmp, *, policies=("load",), extra=""):
    text = config_text(addresses, policies=policies, tmp=tmp).replace(
        '[admin]\nlisten = ""', f'[admin]\nlisten = "127.0.0.1:0"\ntoken = "{TOKEN}"\n{extra}')
    assert 'listen = "127.0.0.1:0"\ntoken' in text
    return text


def listed(svc):
    return {p.name: p for p in svc.admin.ListPolicies(apb.ListPoliciesRequest(),
                                                      metadata=AUTH).policies}


def reload_and_wait(svc, path, text, caplog, count):
    caplog.set_level(logging.INFO)
    path.write_text(text)
    assert wait_for(lambda: caplog.text.count("config reloaded from") >= count)


def test_a_config_reload_keeps_an_admin_loaded_policy_and_says_so(fake_vllm, tmp_path, caplog):
    a, b = fake_vllm(vllm_page()), fake_vllm(vllm_page())
    path = tmp_path / "epick.toml"
    path.write_text(admin_config([a.address], tmp_path))
    with running(cfg.load(path), config_path=path) as svc:
        svc.admin.LoadPolicy(apb.LoadPolicyRequest(name="affinity", wasm=LORA, weight=2),
                             metadata=AUTH)
        reload_and_wait(svc, path, admin_config([a.address, b.address], tmp_path), caplog, 1)
        policies = listed(svc)
        assert list(policies) == ["load", "affinity"]
        assert policies["affinity"].origin == "admin" and policies["affinity"].weight == 2
        assert policies["load"].origin == "config"
        assert "1 policies; kept 1 loaded while serving: affinity" in caplog.text


def test_an_admin_replacement_and_an_admin_weight_stay_until_their_config_entry_changes(
        fake_vllm, tmp_path, caplog):
    a = fake_vllm(vllm_page())
    path = tmp_path / "epick.toml"
    path.write_text(admin_config([a.address], tmp_path, policies=("load", "prefix-cache")))
    with running(cfg.load(path), config_path=path) as svc:
        config_sha = listed(svc)["load"].sha256
        # "load" replaced by another module through the admin API; prefix-cache reweighed.
        svc.admin.LoadPolicy(apb.LoadPolicyRequest(name="load", wasm=LORA), metadata=AUTH)
        svc.admin.SetWeight(apb.SetWeightRequest(name="prefix-cache", weight=4), metadata=AUTH)
        admin_sha = listed(svc)["load"].sha256
        assert admin_sha != config_sha
        # An edit elsewhere (the scrape interval) leaves both alone.
        reload_and_wait(svc, path, admin_config([a.address], tmp_path,
                                                policies=("load", "prefix-cache"))
                        .replace("scrape_interval_ms = 20", "scrape_interval_ms = 25"),
                        caplog, 1)
        p = listed(svc)
        assert p["load"].sha256 == admin_sha and p["load"].origin == "admin"
        assert p["prefix-cache"].weight == 4
        # Editing their own entries hands them back to the config, with a warning.
        text = (admin_config([a.address], tmp_path, policies=("load", "prefix-cache"))
                .replace('module = "load"', 'module = "load"\nweight = 2')
                .replace('module = "prefix-cache"', 'module = "prefix-cache"\nweight = 0.5'))
        reload_and_wait(svc, path, text, caplog, 2)
        p = listed(svc)
        assert p["load"].sha256 == config_sha and p["load"].origin == "config"
        assert p["load"].weight == 2 and p["prefix-cache"].weight == 0.5
        assert ("policy 'load': its config entry changed, so the config's module replaces "
                "the one loaded at run time (admin)") in caplog.text


def test_persist_dir_brings_admin_loads_and_weights_back_after_a_restart(fake_vllm, tmp_path):
    a = fake_vllm(vllm_page())
    path = tmp_path / "epick.toml"
    path.write_text(admin_config([a.address], tmp_path, extra='persist_dir = "saved"'))
    with running(cfg.load(path), config_path=path) as svc:
        svc.admin.LoadPolicy(apb.LoadPolicyRequest(name="affinity", wasm=LORA, shadow=True,
                                                   params_json='{"score_room": 0.5}'),
                             metadata=AUTH)
        svc.admin.SetWeight(apb.SetWeightRequest(name="affinity", weight=3), metadata=AUTH)
        sha = listed(svc)["affinity"].sha256
    assert sorted(p.name for p in (tmp_path / "saved").iterdir()) == ["affinity.json",
                                                                      "affinity.wasm"]
    with running(cfg.load(path), config_path=path) as svc:
        p = listed(svc)
        assert list(p) == ["load", "affinity"]
        assert p["affinity"].origin == "saved" and p["affinity"].sha256 == sha
        assert p["affinity"].weight == 3 and p["affinity"].shadow
        assert svc.call(lambda: svc.service.manager.active["affinity"].params) == {
            "score_room": 0.5}
        svc.admin.RemovePolicy(apb.RemovePolicyRequest(name="affinity"), metadata=AUTH)
    assert list((tmp_path / "saved").iterdir()) == []
    with running(cfg.load(path), config_path=path) as svc:
        assert list(listed(svc)) == ["load"]


def test_a_saved_policy_that_no_longer_loads_is_logged_and_kept_on_disk(fake_vllm, tmp_path,
                                                                        caplog):
    a = fake_vllm(vllm_page())
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "broken.wasm").write_bytes(b"\0asm not really")
    path = tmp_path / "epick.toml"
    path.write_text(admin_config([a.address], tmp_path, extra='persist_dir = "saved"'))
    with running(cfg.load(path), config_path=path) as svc:
        assert list(listed(svc)) == ["load"]
    assert "saved policy 'broken' not loaded (left in" in caplog.text
    assert (saved / "broken.wasm").is_file()


def test_persist_dir_and_policy_dir_must_differ():
    text = ('version = 1\n[admin]\npersist_dir = "p"\n[runtime]\npolicy_dir = "p"\n')
    try:
        cfg.loads(text, source="x.toml")
    except cfg.ConfigError as exc:
        assert "admin.persist_dir and runtime.policy_dir are the same folder ('p')" in str(exc)
    else:
        raise AssertionError("accepted")
