"""Train a small BPE tokenizer offline and save it where transformers can load it.

    .venv-inference-perf/bin/python scripts/inference_perf/make_tokenizer.py OUT_DIR

inference-perf counts prompt and output tokens with a Hugging Face tokenizer, normally
downloaded by model name; nothing may be downloaded here. So this trains one with the
`tokenizers` library on the text inference-perf itself ships (its `assets/shakespeare.txt`,
also its default prompt corpus) and writes `tokenizer.json` + `tokenizer_config.json` for
`AutoTokenizer.from_pretrained(OUT_DIR)`. Same input, same vocabulary: the result is
deterministic. Token counts therefore differ from a real Llama tokenizer; the simulated
replicas count tokens their own way (4 bytes = 1 token) regardless.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import inference_perf
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB = 4096
SPECIAL = ["<unk>", "<s>", "</s>"]


def main(out: Path) -> None:
    corpus = Path(inference_perf.__file__).parent / "assets" / "shakespeare.txt"
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train([str(corpus)], trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=SPECIAL, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>",
        "bos_token": "<s>", "eos_token": "</s>", "model_max_length": 1 << 20}, indent=2))
    print(f"tokenizer: {tok.get_vocab_size()} tokens, trained on {corpus.name} -> {out}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: make_tokenizer.py OUT_DIR")
    main(Path(sys.argv[1]))
