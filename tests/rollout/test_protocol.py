"""Tests of the spool protocol: atomic writes, unusable files, request validation."""

from __future__ import annotations

import json
import os

import pytest

from prmppo.rollout.protocol import (
    SCHEMA_VERSION,
    ErrorResult,
    RolloutRequest,
    RolloutResult,
    ShutdownRequest,
    SpoolFileError,
    SpoolPaths,
    WeightsSpec,
    read_json,
    read_request,
    read_result,
    write_json_atomic,
)


def make_request(**overrides) -> RolloutRequest:
    fields = dict(
        request_id="it0-rollout",
        weights=WeightsSpec(kind="adapter", path="/ckpt/adapter", version=3),
        prompt_token_ids=[[1, 2, 3], [4, 5]],
        n_samples_per_prompt=2,
        max_new_tokens=8,
        temperature=1.0,
        top_p=1.0,
        seed=0,
        eos_token_id=2,
        pad_token_id=0,
    )
    fields.update(overrides)
    return RolloutRequest(**fields)


def test_write_json_atomic_round_trip_leaves_no_temp_files(tmp_path):
    path = tmp_path / "x.json"
    write_json_atomic(path, {"a": 1})
    write_json_atomic(path, {"a": 2})  # replacing an existing file
    assert read_json(path, "test file") == {"schema_version": SCHEMA_VERSION, "a": 2}
    assert sorted(os.listdir(tmp_path)) == ["x.json"]


def test_write_json_atomic_keeps_old_file_when_serialisation_fails(tmp_path):
    path = tmp_path / "x.json"
    write_json_atomic(path, {"a": 1})
    with pytest.raises(TypeError):
        write_json_atomic(path, {"a": object()})  # not JSON-serialisable
    assert read_json(path, "test file")["a"] == 1
    assert sorted(os.listdir(tmp_path)) == ["x.json"]


@pytest.mark.parametrize(
    "content, fragment",
    [
        (None, "does not exist"),
        ('{"schema_version": 1, "request_id": "a", "token_', "not valid JSON"),
        ("", "not valid JSON"),
        ("[1, 2]", "expected an object"),
        ('{"schema_version": 2, "request_id": "a"}', "schema_version=2"),
        ('{"request_id": "a"}', "schema_version=None"),
        ('{"schema_version": 1}', "lacks field(s) ['request_id']"),
    ],
)
def test_read_json_errors_name_the_file(tmp_path, content, fragment):
    path = tmp_path / "r.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SpoolFileError) as info:
        read_json(path, "rollout result", required=("request_id",))
    assert str(path) in str(info.value)
    assert fragment in str(info.value)


def test_request_round_trip_through_spool(tmp_path):
    spool = SpoolPaths(tmp_path)
    spool.make_dirs()
    request = make_request()
    write_json_atomic(spool.request(request.request_id), request.to_dict())
    assert read_request(spool.request(request.request_id)) == request
    assert request.n_rows == 4
    write_json_atomic(spool.request("stop"), ShutdownRequest("stop").to_dict())
    assert read_request(spool.request("stop")) == ShutdownRequest("stop")
    assert [p.name for p in spool.pending_requests()] == ["it0-rollout.json", "stop.json"]


def make_result() -> RolloutResult:
    return RolloutResult(
        "r1", WeightsSpec("base", None, 0), [[5, 2], [7]], [[-0.5, -1.0], [-2.0]], ["stop", "length"], 0.1, 0.0
    )


def test_result_round_trip_and_error_result(tmp_path):
    result = make_result()
    write_json_atomic(tmp_path / "r1.json", result.to_dict())
    assert read_result(tmp_path / "r1.json") == result
    write_json_atomic(tmp_path / "e.json", ErrorResult("r2", "Traceback: boom").to_dict())
    assert read_result(tmp_path / "e.json") == ErrorResult("r2", "Traceback: boom")


@pytest.mark.parametrize(
    "mutate, fragment",
    [
        (lambda obj: obj.pop("logprobs"), "lacks field(s) ['logprobs']"),
        (lambda obj: obj["logprobs"][0].pop(), "row 0 has 2 tokens but 1 logprobs"),
        (lambda obj: obj.update(finish_reasons=["eos", "length"]), "finish reasons ['eos']"),
        (lambda obj: obj.update(weights={"kind": "lora", "path": "x", "version": 1}), "weights.kind='lora'"),
    ],
)
def test_read_result_rejects_inconsistent_results(tmp_path, mutate, fragment):
    obj = make_result().to_dict()
    mutate(obj)
    (tmp_path / "r1.json").write_text(json.dumps(obj))
    with pytest.raises(SpoolFileError) as info:
        read_result(tmp_path / "r1.json")
    assert str(tmp_path / "r1.json") in str(info.value) and fragment in str(info.value)


def test_read_request_rejects_invalid_field_naming_it(tmp_path):
    obj = make_request().to_dict()
    obj["temperature"] = 0.0
    (tmp_path / "q.json").write_text(json.dumps(obj))
    with pytest.raises(SpoolFileError, match=r"q\.json is invalid: temperature=0\.0 must be"):
        read_request(tmp_path / "q.json")


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (dict(temperature=0.0), "temperature=0.0"),
        (dict(temperature=-1.0), "temperature=-1.0"),
        (dict(top_p=0.0), "top_p=0.0"),
        (dict(top_p=1.5), "top_p=1.5"),
        (dict(n_samples_per_prompt=0), "n_samples_per_prompt=0"),
        (dict(max_new_tokens=0), "max_new_tokens=0"),
        (dict(seed=-1), "seed=-1"),
        (dict(eos_token_id=None), "eos_token_id=None"),
        (dict(prompt_token_ids=[]), "prompt_token_ids must be a non-empty list"),
        (dict(prompt_token_ids=[[1], []]), "prompt_token_ids[1]"),
        (dict(prompt_token_ids=[[1, -4]]), "prompt_token_ids[0] must hold ints >= 0"),
        (dict(request_id="../escape"), "request_id='../escape'"),
        (dict(request_id=".hidden"), "request_id='.hidden'"),
        (dict(weights=WeightsSpec("base", None, 0).__dict__), "weights must be a WeightsSpec"),
    ],
)
def test_request_validation_names_the_field(overrides, fragment):
    with pytest.raises(ValueError) as info:
        make_request(**overrides)
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    "kind, path, version, fragment",
    [
        ("lora", "/x", 1, "weights.kind='lora'"),
        ("base", "/x", 1, "weights.path must be null"),
        ("adapter", None, 1, "weights.path must be a directory"),
        ("checkpoint", "/x", -1, "weights.version=-1"),
    ],
)
def test_weights_spec_validation(kind, path, version, fragment):
    with pytest.raises(ValueError) as info:
        WeightsSpec(kind, path, version)
    assert fragment in str(info.value)
