"""The verl-layout fixtures of `task=jsonl` and a tiny model whose tokenizer carries a chat template (the chat
tests and the `task=jsonl` smoke run)."""

from __future__ import annotations

from pathlib import Path

from prmppo.models.loading import load_tokenizer
from prmppo.models.tiny import TinyModelSource
from prmppo.tasks import JsonlTask

FIXTURES = Path(__file__).resolve().parent / "tasks" / "fixtures"
TRAIN, TEST = FIXTURES / "verl_train.jsonl", FIXTURES / "verl_test.parquet"
# writes the BOS token itself (as Llama's and Mistral's templates do); the tokenizer also adds BOS on its own
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def make_chat_model(out_dir: Path, template: str | None = TEMPLATE) -> Path:
    """A tiny Mistral with a byte-level BPE tokenizer trained on the fixtures' SFT texts, its tokenizer given
    `template` (None: no template), saved as an HF-layout directory."""
    source = TinyModelSource(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=512, tokenizer="bpe", bpe_vocab_size=400)
    source.materialize(JsonlTask(train_path=str(TRAIN), test_path=str(TEST)), out_dir)
    tokenizer = load_tokenizer(out_dir)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(out_dir)
    return out_dir
