"""The tiny model round-trips through the HF layout; broken model dirs are refused by file."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from prmppo.models.loading import ModelDirError, check_model_dir, load_model, load_tokenizer
from prmppo.models.tiny import TinyModelSource, build_char_tokenizer
from prmppo.tasks import ArithTask

SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    task = ArithTask(sft_size=10, train_size=10, test_size=4)
    return TinyModelSource(**SMALL).materialize(task, tmp_path_factory.mktemp("m") / "tiny")


def test_char_tokenizer_round_trips_text_and_prepends_bos():
    tok = build_char_tokenizer("0123456789+-=\nAnswer: ")
    text = "17+5=22\n22-3=19\nAnswer: 19"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)  # one token per character
    assert tok.decode(ids) == text
    assert tok("1")["input_ids"][0] == tok.bos_token_id


def test_save_load_round_trip_gives_identical_logits(tiny_dir):
    model = load_model(tiny_dir)
    tok = load_tokenizer(tiny_dir)
    again = load_model(tiny_dir)
    ids = torch.tensor([tok("3+4-1\n")["input_ids"]])
    assert torch.equal(model(ids).logits, again(ids).logits)
    assert model.config.model_type == "mistral"
    assert model.config.vocab_size == len(tok)
    assert model.config.eos_token_id == tok.eos_token_id


def test_materialize_is_deterministic_for_a_seed(tmp_path):
    task = ArithTask(sft_size=10, train_size=10, test_size=4)
    a = load_model(TinyModelSource(**SMALL, seed=1).materialize(task, tmp_path / "a"))
    b = load_model(TinyModelSource(**SMALL, seed=1).materialize(task, tmp_path / "b"))
    c = load_model(TinyModelSource(**SMALL, seed=2).materialize(task, tmp_path / "c"))
    pa, pb, pc = (next(m.parameters()) for m in (a, b, c))
    assert torch.equal(pa, pb) and not torch.equal(pa, pc)


def test_missing_dir_is_refused(tmp_path):
    with pytest.raises(ModelDirError, match="does not exist"):
        check_model_dir(tmp_path / "nope")


@pytest.mark.parametrize("remove,fragment", [
    ("config.json", "config.json is missing"),
    ("model.safetensors", "no \\*.safetensors weights"),
    ("tokenizer.json", "no tokenizer file"),
])
def test_incomplete_dir_names_the_missing_file(tiny_dir, tmp_path, remove, fragment):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_dir, broken)
    (broken / remove).unlink()
    with pytest.raises(ModelDirError, match=fragment):
        check_model_dir(broken)


def test_vocab_larger_than_embedding_is_refused(tiny_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_dir, broken)
    config = json.loads((broken / "config.json").read_text())
    config["vocab_size"] = 5
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelDirError, match="tokenizer.json has 27 tokens .* vocab_size=5"):
        check_model_dir(broken)


def test_corrupt_config_json_names_the_file(tiny_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_dir, broken)
    (broken / "config.json").write_text('{"model_type": "mistral",')
    with pytest.raises(ModelDirError, match="config.json is not valid JSON"):
        check_model_dir(broken)
