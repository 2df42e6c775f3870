"""`model=tiny` with a byte-level BPE tokenizer (`model.tokenizer=bpe|auto`): trained offline and
deterministically on the task's SFT texts, exact round trips, the same special ids as the character
tokenizer, and `auto` picking characters only when every SFT example fits the context."""

from __future__ import annotations

import json

import pytest

from prmppo.models.loading import load_model, load_tokenizer
from prmppo.models.tiny import (SPECIAL_TOKENS, TinyModelSource, build_bpe_tokenizer, build_char_tokenizer,
                                pick_tokenizer, sft_texts)
from prmppo.rewards.steps import StepBoundaries
from prmppo.tasks import ArithTask

SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)


@pytest.fixture(scope="module")
def task():
    return ArithTask(sft_size=300, train_size=10, test_size=4)


def test_bpe_is_deterministic_and_round_trips_any_text(task):
    texts = sft_texts(task)
    first, second = build_bpe_tokenizer(texts, 300), build_bpe_tokenizer(texts, 300)
    assert first.backend_tokenizer.to_str() == second.backend_tokenizer.to_str()  # same texts, same merges
    assert len(first) == 300  # 4 special tokens + 256 bytes + 40 merges
    merges = json.loads(first.backend_tokenizer.to_str())["model"]["merges"]
    assert len(merges) == 300 - len(SPECIAL_TOKENS) - 256
    # the special tokens sit where the character tokenizer puts them: a checkpoint's ids mean the same
    char = build_char_tokenizer(task.alphabet())
    assert [first.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3]
    assert (first.pad_token_id, first.bos_token_id, first.eos_token_id) == (char.pad_token_id, char.bos_token_id,
                                                                             char.eos_token_id)
    for text in [texts[0], "17+5=22\n22-3=19\nAnswer: 19", "  two  spaces, a tab\t and 5 \u20ac \u00e9l\u00e8ve\n"]:
        ids = first(text)["input_ids"]
        assert ids[0] == first.bos_token_id and first.unk_token_id not in ids  # bytes: nothing is unknown
        assert first.decode(ids, skip_special_tokens=True) == text
    # merges learned from the texts make them shorter than one token per character
    assert sum(len(first(t, add_special_tokens=False)["input_ids"]) for t in texts) < 0.8 * sum(map(len, texts))


def test_bpe_step_boundaries_find_the_newline(task):
    tokenizer = build_bpe_tokenizer(sft_texts(task), 300)
    boundaries = StepBoundaries.from_tokenizer(tokenizer, "\n")
    newline = tokenizer("\n", add_special_tokens=False)["input_ids"]
    assert len(newline) == 1 and newline[0] in boundaries.delimiter_ids


def test_bpe_vocab_without_room_for_merges_is_refused(task):
    with pytest.raises(ValueError, match=r"model.bpe_vocab_size=260 leaves no room for merges: it must be > 260"):
        build_bpe_tokenizer(sft_texts(task), 260)


def test_unknown_tokenizer_is_refused_by_name():
    with pytest.raises(ValueError, match=r"model.tokenizer='wordpiece' is not one of char, bpe, auto"):
        TinyModelSource(**SMALL, tokenizer="wordpiece")


def test_auto_picks_characters_only_when_every_sft_example_fits(task):
    longest = max(map(len, sft_texts(task))) + 2  # + BOS and EOS
    assert pick_tokenizer("auto", task, longest) == "char"
    assert pick_tokenizer("auto", task, longest - 1) == "bpe"
    assert pick_tokenizer("char", task, 1) == "char" and pick_tokenizer("bpe", task, 10_000) == "bpe"


def test_materialize_with_bpe_saves_a_loadable_model_dir(task, tmp_path):
    out = TinyModelSource(**SMALL, tokenizer="bpe", bpe_vocab_size=300).materialize(task, tmp_path / "tiny")
    tokenizer, model = load_tokenizer(out), load_model(out)
    assert json.loads((out / "prmppo_model.json").read_text())["tokenizer"] == "bpe"
    assert model.config.vocab_size == len(tokenizer) == 300
    assert model.config.eos_token_id == tokenizer.eos_token_id == 2
    problem = task.problems("sft")[0]
    text = task.format_prompt(problem) + problem.solution
    assert tokenizer.decode(tokenizer(text)["input_ids"], skip_special_tokens=True) == text
    # the default stays the character tokenizer
    plain = TinyModelSource(**SMALL).materialize(task, tmp_path / "plain")
    assert json.loads((plain / "prmppo_model.json").read_text())["tokenizer"] == "char"
    assert len(load_tokenizer(plain)) == len(SPECIAL_TOKENS) + len(task.alphabet())
