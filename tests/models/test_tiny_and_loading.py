"""The tiny model round-trips through the HF layout; broken model dirs are refused by file."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from prmppo.models.loading import (MODEL_REFERENCE, HFDirSource, ModelDirError, check_model_dir, load_model,
                                   load_tokenizer, resolve_model_dir, write_model_reference)
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


def _given_copy(tiny_dir, tmp_path):
    """A model directory of the test's own, free to change (`tiny_dir` is shared by the module)."""
    return shutil.copytree(tiny_dir, tmp_path / "given")


def test_a_reference_loads_the_directory_it_stands_for_and_holds_none_of_its_files(tiny_dir, tmp_path):
    given, ref = _given_copy(tiny_dir, tmp_path), tmp_path / "ref"
    ref.mkdir()
    assert write_model_reference(given, ref) == given.resolve()
    assert [p.name for p in ref.iterdir()] == [MODEL_REFERENCE]  # no weights, no config, no tokenizer copied
    assert resolve_model_dir(ref) == check_model_dir(ref).path == given.resolve()
    assert resolve_model_dir(given) == given  # a plain model directory stands for itself
    ids = torch.tensor([load_tokenizer(ref)("3+4-1\n")["input_ids"]])
    assert load_tokenizer(ref).get_vocab() == load_tokenizer(given).get_vocab()
    assert torch.equal(load_model(ref)(ids).logits, load_model(given)(ids).logits)
    source = HFDirSource(str(ref))  # model=hf model.path=<a reference>: the launch gates read the source's config
    assert source.architecture()[0]["model_type"] == "mistral" and source.materialize(None, tmp_path) == given.resolve()
    again = tmp_path / "ref2"  # a reference to a reference names the directory with the weights
    again.mkdir()
    assert write_model_reference(ref, again) == given.resolve()
    assert json.loads((again / MODEL_REFERENCE).read_text())["path"] == str(given.resolve())


@pytest.mark.parametrize("change,fragment", [
    ("resave", "config.json was rewritten"),
    ("grow", "model.safetensors was"),
    ("add", "extra.safetensors is new"),
    ("remove", "tokenizer.json is gone"),
    ("delete", "no longer exists"),
])
def test_a_reference_to_a_directory_changed_since_is_refused_naming_the_change(tiny_dir, tmp_path, change,
                                                                              fragment):
    given, ref = _given_copy(tiny_dir, tmp_path), tmp_path / "ref"
    ref.mkdir()
    write_model_reference(given, ref)
    if change == "resave":  # the same bytes written again: only the modification time says so
        config = given / "config.json"
        text = config.read_text()
        stat = config.stat()
        config.write_text(text)
        os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    elif change == "grow":
        with open(given / "model.safetensors", "ab") as handle:
            handle.write(b"\0")
    elif change == "add":
        shutil.copy(given / "model.safetensors", given / "extra.safetensors")
    elif change == "remove":
        (given / "tokenizer.json").unlink()
    else:
        shutil.rmtree(given)
    for read in (resolve_model_dir, check_model_dir, load_tokenizer):
        with pytest.raises(ModelDirError, match=fragment) as raised:
            read(ref)
        assert str(ref) in str(raised.value) and "stage=sft" in str(raised.value)
