"""`model=tiny`: a small Mistral-architecture causal LM and a tokenizer for the task, built from code.

The embedded default needs a model that learns chained arithmetic on a laptop CPU in minutes
and that nothing has to download. This module builds one with transformers' own Mistral
classes and a tokenizer made for the task, then saves both as an ordinary Hugging Face-layout
directory, so every later stage loads it through the same path as a real checkpoint
(`prmppo.models.loading`).

The tokenizer (`model.tokenizer`):
  char  one token per character of the task's alphabet (arith: 23 characters, <= 57 an example);
  bpe   a byte-level BPE of `model.bpe_vocab_size` tokens trained on the task's SFT texts (prompt +
        solution), offline and deterministic (same texts, same merges). For long natural-language
        texts: a GSM8K example has up to ~1700 characters but ~650 tokens of a 1024-token BPE;
  auto  `char` when every SFT example fits `model.max_position_embeddings` one token per
        character, else `bpe` (what `debug=smoke` uses, so it runs on arith and on GSM8K).
Both put the same special tokens at ids 0..3 and prepend BOS to every input.

    python -m prmppo debug=smoke task=gsm8k prm_train.label_source=monte_carlo   # picks bpe
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import MistralConfig, MistralForCausalLM, PreTrainedTokenizerFast

from prmppo.config.schema import TinyModelConfig
from prmppo.models.loading import DTYPES, check_model_dir

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")  # ids 0..3
TOKENIZERS = ("char", "bpe", "auto")
BYTE_ALPHABET = 256  # a byte-level BPE starts from one token per byte


def build_char_tokenizer(alphabet: str):
    """A fast tokenizer with one token per character of `alphabet`, BOS prepended to inputs.

    A BPE model without merges maps every character of the (single, un-pretokenized) input to
    its own id; `Fuse` decodes by plain concatenation, so spaces and newlines round-trip.
    """
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


def build_bpe_tokenizer(texts, vocab_size: int):
    """A byte-level BPE tokenizer of at most `vocab_size` tokens (specials included) trained on `texts`.

    Every byte has a token (so any text encodes, none is unknown); merges are learned from the
    texts in their order, so the same texts give the same tokenizer. Special tokens and BOS as in
    `build_char_tokenizer`; decoding is exact (no clean-up of spaces before punctuation).
    """
    smallest = len(SPECIAL_TOKENS) + BYTE_ALPHABET
    if vocab_size <= smallest:
        raise ValueError(f"model.bpe_vocab_size={vocab_size} leaves no room for merges: it must be > {smallest} "
                         f"({len(SPECIAL_TOKENS)} special tokens + {BYTE_ALPHABET} bytes), e.g. 1024")
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(texts, trainer)
    bos = core.token_to_id("<s>")
    core.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", bos)])
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
        clean_up_tokenization_spaces=False)


def sft_texts(task) -> list[str]:
    """What the policy reads and writes in SFT: each `sft` problem's prompt followed by its solution."""
    return [task.format_prompt(p) + p.solution for p in task.problems("sft")]


def pick_tokenizer(kind: str, task, max_position_embeddings: int) -> str:
    """`kind` (one of `TOKENIZERS`), with `auto` resolved: `char` when every SFT example (+ BOS and
    EOS) fits `max_position_embeddings` one token per character, else `bpe`."""
    if kind != "auto":
        return kind
    longest = max(map(len, sft_texts(task))) + 2
    return "char" if longest <= max_position_embeddings else "bpe"


class TinyModelSource:
    """Builds the tiny model for a task and saves it as an HF-layout directory."""

    # its directory lies in the run dir, which may be deleted: an SFT artifact copies its (small) weights
    lasting_weights = False

    def __init__(
        self,
        hidden_size: int = TinyModelConfig.hidden_size,
        intermediate_size: int = TinyModelConfig.intermediate_size,
        num_hidden_layers: int = TinyModelConfig.num_hidden_layers,
        num_attention_heads: int = TinyModelConfig.num_attention_heads,
        num_key_value_heads: int = TinyModelConfig.num_key_value_heads,
        max_position_embeddings: int = TinyModelConfig.max_position_embeddings,
        seed: int = TinyModelConfig.seed,
        dtype: str = TinyModelConfig.dtype,
        tokenizer: str = TinyModelConfig.tokenizer,
        bpe_vocab_size: int = TinyModelConfig.bpe_vocab_size,
    ):
        if hidden_size % num_attention_heads or num_attention_heads % num_key_value_heads:
            raise ValueError(
                f"model.hidden_size={hidden_size} must be divisible by model.num_attention_heads="
                f"{num_attention_heads}, which must be divisible by model.num_key_value_heads={num_key_value_heads}")
        self.arch = dict(hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                         num_key_value_heads=num_key_value_heads, max_position_embeddings=max_position_embeddings)
        if tokenizer not in TOKENIZERS:
            raise ValueError(f"model.tokenizer={tokenizer!r} is not one of {', '.join(TOKENIZERS)}")
        self.seed = seed
        self.dtype = dtype
        self.tokenizer = tokenizer
        self.bpe_vocab_size = bpe_vocab_size

    def architecture(self) -> tuple[dict, str]:
        """The transformers config dict of the model this builds (before its tokenizer fixes the
        vocabulary size), and where it comes from; launch gates read it before any weights exist."""
        arch = self.arch
        heads = f"model.hidden_size={arch['hidden_size']} / model.num_attention_heads={arch['num_attention_heads']}"
        return {"model_type": "mistral", "vocab_size": 32, "tie_word_embeddings": True, **self.arch}, heads

    def build_tokenizer(self, task):
        """(the tokenizer for `task`, the kind built: `char` or `bpe`)."""
        kind = pick_tokenizer(self.tokenizer, task, self.arch["max_position_embeddings"])
        if kind == "char":
            return build_char_tokenizer(task.alphabet()), kind
        return build_bpe_tokenizer(sft_texts(task), self.bpe_vocab_size), kind

    def materialize(self, task, out_dir: Path) -> Path:
        """Write config, tokenizer and freshly initialised weights to `out_dir` (kept if complete)."""
        out_dir = Path(out_dir)
        if (out_dir / "config.json").exists():
            check_model_dir(out_dir)
            return out_dir
        tokenizer, kind = self.build_tokenizer(task)
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
        made = {"source": "tiny", **self.arch, "seed": self.seed, "tokenizer": kind}
        if kind == "bpe":
            made["bpe_vocab_size"] = len(tokenizer)
        (tmp / "prmppo_model.json").write_text(json.dumps(made))
        tmp.rename(out_dir)  # a crash mid-save never leaves a half-written model dir behind
        return out_dir
