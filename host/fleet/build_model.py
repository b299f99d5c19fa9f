"""Build the tiny local model the real-vLLM fleet serves: weights, tokenizer, LoRA adapters.

Runs inside ``.venv-vllm`` (it needs torch, transformers, tokenizers, peft), offline: no
weights can be downloaded here, so everything is made from seeds in a few seconds.

    .venv-vllm/bin/python host/fleet/build_model.py OUT_DIR

Writes ``OUT_DIR/model`` (a random Llama: hidden 256, 2 layers, 4 heads / 2 KV heads,
head_dim 64, vocab 4096, with a ByteLevel-BPE tokenizer trained on Python's own stdlib
sources and a chat template) and ``OUT_DIR/adapters/<name>`` for every adapter in
:data:`ADAPTERS` (r 8 on q_proj/v_proj, ``init_lora_weights=False`` so each one really
changes the outputs). ``OUT_DIR/BUILT`` is written last: its presence means complete.
The same seeds give the same weights, so two builds serve identical models.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

#: Adapter names the fleet serves (keep in step with host/fleet/fleet.py's ADAPTERS).
ADAPTERS = ("sql-lora", "chat-lora", "code-lora", "math-lora")
VOCAB = 4096
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _corpus() -> list[str]:
    """Local text to train the tokenizer on: a fixed, sorted set of stdlib sources."""
    root = pathlib.Path(os.__file__).parent
    files = sorted(root.glob("*.py"))[:200]
    return [f.read_text(errors="replace") for f in files]


def build_tokenizer(out: pathlib.Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    # Prepend BOS the way Llama tokenizers do, so vLLM's token ids start with it.
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


def build_model(out: pathlib.Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)


def build_adapters(model_dir: pathlib.Path, out: pathlib.Path) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    for i, name in enumerate(ADAPTERS):
        torch.manual_seed(100 + i)
        base = LlamaForCausalLM.from_pretrained(model_dir)
        lora = LoraConfig(
            r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False
        )
        get_peft_model(base, lora).save_pretrained(out / name)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: build_model.py OUT_DIR", file=sys.stderr)
        return 2
    root = pathlib.Path(argv[0])
    model_dir, adapters_dir = root / "model", root / "adapters"
    model_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer(model_dir)
    build_model(model_dir)
    build_adapters(model_dir, adapters_dir)
    (root / "BUILT").write_text(json.dumps({"adapters": list(ADAPTERS)}) + "\n")
    print(f"built {model_dir} and {len(ADAPTERS)} adapters in {adapters_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
