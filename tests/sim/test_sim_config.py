import pytest

from epick.sim.config import DEFAULT_CONFIG, load_config


def test_a_json_config_overrides_only_what_it_names():
    cfg = load_config(b'{"max_loras": 3, "num_gpu_blocks": 1000}')
    assert (cfg.max_loras, cfg.num_gpu_blocks) == (3, 1000)
    assert cfg.prefill_tokens_per_s == DEFAULT_CONFIG.prefill_tokens_per_s


@pytest.mark.parametrize(("data", "message"), [
    (b'{"max_lora": 3}', "sim.json: Object contains unknown field `max_lora`"),
    (b'{"prefill_tokens_per_s": 0}', "sim.json: Expected `float` > 0.0 - at `$.prefill_tokens_per_s`"),
    (b'{"block_size": 32, "max_num_batched_tokens": 16}',
     "sim.json: max_num_batched_tokens (16) must be at least block_size (32)"),
    (b'{"max_loras": ', "sim.json: Input data was truncated"),
], ids=["unknown-key", "non-positive-rate", "budget-below-block", "truncated"])
def test_bad_configs_name_the_file_and_the_path(data, message):
    with pytest.raises(ValueError) as err:
        load_config(data, source="sim.json")
    assert str(err.value) == message


def test_host_memory_holds_at_least_the_gpu_slots():
    assert DEFAULT_CONFIG.cpu_lora_capacity == DEFAULT_CONFIG.max_loras
    assert load_config(b'{"max_loras": 2, "max_cpu_loras": 8}').cpu_lora_capacity == 8
