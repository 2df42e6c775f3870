"""`model=tiny`: a small Mistral-architecture causal LM and a character tokenizer, built from code.

The embedded default needs a model that learns chained arithmetic on a laptop CPU in minutes
and that nothing has to download. This module builds one with transformers' own Mistral
classes and a one-token-per-character tokenizer over the task's alphabet, then saves both as an
ordinary Hugging Face-layout directory, so every later stage loads it through the same path
as a real checkpoint (`prmppo.models.loading`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from prmppo.models.loading import DTYPES, check_model_dir

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")  # ids 0..3


def build_char_tokenizer(alphabet: str):
    """A fast tokenizer with one token per character of `alphabet`, BOS prepended to inputs.

    A BPE model without merges maps every character of the (single, un-pretokenized) input to
    its own id; `Fuse` decodes by plain concatenation, so spaces and newlines round-trip.
    """
    from tokenizers import Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set(alphabet))
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({ch: len(SPECIAL_TOKENS) + i for i, ch in enumerate(chars)})
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", vocab["<s>"])])
    core.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>")


class TinyModelSource:
    """Builds the tiny model for a task and saves it as an HF-layout directory."""

    def __init__(self, hidden_size: int = 96, intermediate_size: int = 256, num_hidden_layers: int = 4,
                 num_attention_heads: int = 4, num_key_value_heads: int = 2,
                 max_position_embeddings: int = 256, seed: int = 0, dtype: str = "float32"):
        if hidden_size % num_attention_heads or num_attention_heads % num_key_value_heads:
            raise ValueError(
                f"model.hidden_size={hidden_size} must be divisible by model.num_attention_heads="
                f"{num_attention_heads}, which must be divisible by model.num_key_value_heads={num_key_value_heads}")
        self.arch = dict(hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                         num_key_value_heads=num_key_value_heads, max_position_embeddings=max_position_embeddings)
        self.seed = seed
        self.dtype = dtype

    def materialize(self, task, out_dir: Path) -> Path:
        """Write config, tokenizer and freshly initialised weights to `out_dir` (kept if complete)."""
        out_dir = Path(out_dir)
        if (out_dir / "config.json").exists():
            check_model_dir(out_dir)
            return out_dir
        from transformers import MistralConfig, MistralForCausalLM

        tokenizer = build_char_tokenizer(task.alphabet())
        config = MistralConfig(
            vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True, sliding_window=None,
            rope_theta=10000.0, **self.arch)
        with torch.random.fork_rng(devices=[]):  # weight init draws from the global generator
            torch.manual_seed(self.seed)
            model = MistralForCausalLM(config).to(DTYPES[self.dtype])
        tmp = out_dir.with_name(out_dir.name + ".tmp")
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "prmppo_model.json").write_text(json.dumps({"source": "tiny", **self.arch, "seed": self.seed}))
        tmp.rename(out_dir)  # a crash mid-save never leaves a half-written model dir behind
        return out_dir
