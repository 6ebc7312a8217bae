"""Forged checkpoints: a state file whose checksums match its (equally forged) manifest but
whose content is hostile or malformed.  Decoding never resolves a name, never returns
anything but containers, plain values, dtypes and the file's tensors, and a checkpoint that
does not decode is skipped with a warning like a corrupt one: the previous one loads."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import pickle
import random
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
import zstandard
from safetensors.torch import save as st_save

from sakura_async import load_latest
from sakura_async.checkpoint import find_checkpoints, load_best, write_checkpoint
from sakura_async.checkpoint.encoding import decode_tree, tree_from_json, tree_to_json
from sakura_async.checkpoint.store import manifest_digest
from sakura_async.errors import CheckpointError


def forge(ckpt_dir: str, content: bytes, **manifest_changes: Any) -> None:
    """Replace the state file of ``ckpt_dir`` with ``content`` and make the manifest match
    (what an attacker who can write the checkpoint directory does)."""
    path = Path(ckpt_dir) / "manifest.json"
    manifest = json.loads(path.read_text())
    Path(ckpt_dir, manifest["main"]).write_bytes(content)
    manifest["files"][manifest["main"]] = {
        "sha256": hashlib.sha256(content).hexdigest(),
        "bytes": len(content),
    }
    manifest.update(manifest_changes)
    manifest["manifest_sha256"] = manifest_digest(manifest)
    path.write_text(json.dumps(manifest))


def safetensors_with_tree(tree_text: str | None, tensors: dict[str, torch.Tensor]) -> bytes:
    metadata = {"format": "pt"} if tree_text is None else {"sakura.tree": tree_text}
    return st_save(tensors, metadata=metadata)


class Boom:
    def __reduce__(self) -> Any:
        return (os.system, ("echo pwned > /dev/null",))


DEEP = "[" * 200 + "]" * 200  # valid JSON, deeper than the tree allows
VERY_DEEP = "[" * 100_000 + "]" * 100_000  # deeper than the JSON parser's stack

FORGED_TREES = {
    "a name that is not a dtype": json.dumps({"__dtype__": "load"}),
    "a torch class": json.dumps({"__dict__": [["x", {"__dtype__": "Tensor"}]]}),
    "nesting deeper than allowed": DEEP,
    "nesting deeper than the parser": VERY_DEEP,
    "an unhashable key": json.dumps({"__dict__": [[[1, 2], 3]]}),
    "a missing tensor": json.dumps({"__dict__": [["w", {"__tensor__": 7}]]}),
    "a tensor index of the wrong type": json.dumps({"__tensor__": "0"}),
    "a tuple of the wrong type": json.dumps({"__tuple__": 3}),
    "a dict that is not pairs": json.dumps({"__dict__": [["a", 1, 2]]}),
    "two markers in one object": json.dumps({"__tensor__": 0, "__dtype__": "float32"}),
    "a finite __float__": json.dumps({"__float__": "1e5"}),
    "an unknown marker": json.dumps({"__module__": "os"}),
    "not JSON": "{not json",
    "a tree that is not text": None,
}


@pytest.mark.parametrize("case", sorted(FORGED_TREES))
def test_a_forged_safetensors_tree_is_skipped_and_the_previous_checkpoint_loads(
    tmp_path: Path, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    write_checkpoint(str(tmp_path), {"w": torch.ones(3)}, format="safetensors", step=1)
    forged = write_checkpoint(str(tmp_path), {"w": torch.zeros(3)}, format="safetensors", step=2)
    forge(forged, safetensors_with_tree(FORGED_TREES[case], {"t0": torch.zeros(3)}))
    assert len(find_checkpoints(tmp_path, verify=True)) == 2  # the checksums match
    with caplog.at_level(logging.WARNING, logger="sakura.async"):
        latest = load_latest(tmp_path)
    assert latest is not None and latest.step == 1
    assert torch.equal(latest.state["w"], torch.ones(3))
    assert any(
        forged in r.getMessage() and "does not decode" in r.getMessage() for r in caplog.records
    )


def _pickled(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


FORGED_FILES = {
    "a pickle that runs os.system": ("torch", None, pickle.dumps(Boom())),
    "a torch file holding os.system": ("torch", None, _pickled({"w": Boom()})),
    "truncated torch bytes": ("torch", None, _pickled({"w": torch.ones(3)})[:200]),
    "garbage as torch": ("torch", None, b"\x80\x04garbage" * 10),
    "garbage as a lightning file": ("lightning", None, b"PK\x03\x04" + b"\0" * 60),
    "garbage as safetensors": ("safetensors", None, b"\xff" * 64),
    "garbage as zstd": ("torch", 3, b"\x28\xb5\x2f\xfd" + b"\xff" * 60),
    "zstd of a garbage pickle": ("torch", 3, zstandard.compress(b"\x80\x04junk" * 9)),
    "zstd of a forged tree": (
        "safetensors",
        3,
        zstandard.compress(safetensors_with_tree('{"__dtype__": "save"}', {})),
    ),
}


@pytest.mark.parametrize("case", sorted(FORGED_FILES))
def test_a_state_file_that_does_not_decode_is_skipped_like_a_corrupt_one(
    tmp_path: Path, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    fmt, compress, content = FORGED_FILES[case]
    stored = "torch" if fmt == "lightning" else fmt
    write_checkpoint(str(tmp_path), {"w": torch.ones(3)}, format=stored, step=1, compress=compress)
    forged = write_checkpoint(
        str(tmp_path), {"w": torch.zeros(3)}, format=stored, step=2, compress=compress
    )
    forge(forged, content, format=fmt, metric={"name": "loss", "value": 0.0, "mode": "min"})
    with caplog.at_level(logging.WARNING, logger="sakura.async"):
        latest = load_latest(tmp_path)
        best = load_best(tmp_path)  # only the forged one records a metric
    assert latest is not None and latest.step == 1
    assert torch.equal(latest.state["w"], torch.ones(3))
    assert best is None
    assert any(
        forged in r.getMessage() and "does not decode" in r.getMessage() for r in caplog.records
    )


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"metric": [1, 2]}, "metric [1, 2] is not an object"),
        ({"created_unix": "yesterday"}, "created_unix 'yesterday' is not a number"),
        ({"step": True}, "does not match the manifest's step True"),
    ],
)
def test_a_manifest_field_of_the_wrong_type_is_an_incomplete_checkpoint(
    tmp_path: Path, changes: dict[str, Any], problem: str, caplog: pytest.LogCaptureFixture
) -> None:
    write_checkpoint(str(tmp_path), {"w": torch.ones(3)}, step=1)
    forged = write_checkpoint(str(tmp_path), {"w": torch.zeros(3)}, step=2)
    forge(forged, Path(forged, "state.pt").read_bytes(), **changes)
    with caplog.at_level(logging.WARNING, logger="sakura.async"):
        latest = load_latest(tmp_path)
        assert load_best(tmp_path) is None
    assert latest is not None and latest.step == 1
    assert any(problem in r.getMessage() for r in caplog.records)


# --- a seeded fuzz test of the tree decoder --------------------------------------------------

TENSORS = [torch.arange(4.0), torch.ones(2, 2, dtype=torch.bfloat16), torch.tensor(7)]
TREE = {
    "model": {"w": TENSORS[0], "b": TENSORS[1]},
    "optimizer": {
        "state": {0: {"step": TENSORS[2]}},
        "param_groups": [
            {"lr": 0.1, "betas": (0.9, 0.999), "eps": float("inf"), "dtype": torch.bfloat16}
        ],
    },
    "ordered": OrderedDict([(None, True), (1.5, "x"), (2, [1, None])]),
}
TORCH_NAMES = ["load", "save", "Tensor", "nn", "float32", "bfloat16", "int4", "os", "__builtins__"]
MARKERS = ["__tensor__", "__dict__", "__odict__", "__tuple__", "__float__", "__dtype__"]
PLAIN = (str, int, float, bool, type(None))


def random_value(rng: random.Random, depth: int = 0) -> Any:
    choice = rng.randrange(12)
    if choice == 0:
        return rng.choice([None, True, False, 0, -1, 2**70, 1.5, float("nan"), "", "t0"])
    if choice == 1:
        return {"__dtype__": rng.choice([*TORCH_NAMES, 3, None, ["float32"]])}
    if choice == 2:
        return {"__tensor__": rng.choice([0, 1, 2, 3, -1, "0", True, 1.0, None, [0]])}
    if choice == 3:
        return {"__float__": rng.choice(["nan", "inf", "-inf", "1", 5, None, "infinity"])}
    if choice == 4:
        key = rng.choice(["a", 1, 2.5, None, True, [1], {"k": 1}])
        return {rng.choice(["__dict__", "__odict__"]): [[key, random_value(rng, depth + 1)]]}
    if choice == 5:
        return {"__tuple__": rng.choice([[], [random_value(rng, depth + 1)], 3, "ab", None])}
    if choice == 6:
        return {rng.choice(MARKERS): random_value(rng, depth + 1), "extra": 1}
    if choice == 7:
        nested: Any = 0
        for _ in range(rng.choice([50, 99, 100, 101, 150])):
            nested = [nested]
        return nested
    if choice == 8:
        return {rng.choice([*MARKERS, "__module__", ""]): rng.choice([[], {}, "x", 0])}
    if choice == 9:
        return {}
    if choice == 10 and depth < 3:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(3))]
    return rng.choice([[], [[]], {"__dict__": []}, {"__dict__": [[]]}, {"__dict__": [["k"]]}])


def mutate(node: Any, rng: random.Random) -> Any:
    """``node`` with one random spot replaced, removed or re-keyed."""
    if rng.random() < 0.25:
        return random_value(rng)
    if isinstance(node, list) and node:
        i = rng.randrange(len(node))
        out = list(node)
        if rng.random() < 0.15:
            del out[i]
        else:
            out[i] = mutate(node[i], rng)
        return out
    if isinstance(node, dict) and node:
        key = rng.choice(list(node))
        out = dict(node)
        roll = rng.random()
        if roll < 0.1:
            out[rng.choice([*MARKERS, "__module__"])] = random_value(rng)
        elif roll < 0.2:
            out[rng.choice(MARKERS)] = out.pop(key)
        else:
            out[key] = mutate(node[key], rng)
        return out
    return random_value(rng)


def allowed(value: Any, tensors: list[torch.Tensor]) -> bool:
    if isinstance(value, torch.Tensor):
        return any(value is t for t in tensors)
    if type(value) in (dict, OrderedDict):
        return all(isinstance(k, PLAIN) and allowed(v, tensors) for k, v in value.items())
    if type(value) in (list, tuple):
        return all(allowed(v, tensors) for v in value)
    return type(value) in PLAIN or isinstance(value, torch.dtype)


def test_the_tree_decoder_survives_a_seeded_fuzz_of_mutated_metadata() -> None:
    tensors: list[torch.Tensor] = []
    skeleton = tree_to_json(TREE, tensors)
    by_name = {f"t{i}": t for i, t in enumerate(tensors)}
    assert allowed(tree_from_json(skeleton, by_name), tensors)  # the intact tree decodes
    rng = random.Random(20240519)
    text = json.dumps(skeleton)
    decoded = rejected = 0
    for case in range(3000):
        data = skeleton
        for _ in range(rng.randrange(1, 4)):
            data = mutate(data, rng)
        try:
            if case % 3 == 0:  # mutate the JSON text too (flip, drop or repeat a few bytes)
                chars = list(json.dumps(data) if rng.random() < 0.5 else text)
                for _ in range(rng.randrange(1, 4)):
                    i = rng.randrange(len(chars) or 1)
                    chars[i : i + 1] = rng.choice(
                        [[], chars[i : i + 1] * 2, [rng.choice('[]{}",:0a\\')]]
                    )
                result = decode_tree("".join(chars), by_name)
            else:
                result = tree_from_json(data, by_name)
        except CheckpointError:
            rejected += 1
            continue
        assert allowed(result, tensors), (case, result)
        decoded += 1
    assert decoded > 300 and rejected > 1000, (decoded, rejected)  # both sides exercised


def test_a_tree_too_deep_to_read_back_is_refused_when_written(tmp_path: Path) -> None:
    deep: Any = torch.ones(1)
    for _ in range(150):
        deep = [deep]
    with pytest.raises(TypeError, match=r"nested at most 100 levels deep.*use format='torch'"):
        write_checkpoint(str(tmp_path), {"x": deep}, format="safetensors")
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(TypeError, match="or the tree contains itself"):
        write_checkpoint(str(tmp_path), {"x": loop}, format="safetensors")
    assert os.listdir(tmp_path) == []
    shallow: Any = torch.ones(1)
    for _ in range(90):
        shallow = [shallow]
    write_checkpoint(str(tmp_path), {"x": shallow, "d": torch.float8_e4m3fn}, format="safetensors")
    state = load_latest(tmp_path).state  # type: ignore[union-attr]
    assert state["d"] is torch.float8_e4m3fn
    for _ in range(90):
        state["x"] = state["x"][0]
    assert torch.equal(state["x"], torch.ones(1))
