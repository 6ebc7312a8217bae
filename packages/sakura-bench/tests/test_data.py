"""The readers of real dataset files, on small files written here in each format, and the
workloads reading them with --data."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import pytest
import torch

from sakura_bench.data.cifar import load_cifar10, read_cifar_batch
from sakura_bench.data.mnist import MNIST_MEAN, MNIST_STD, load_mnist, read_idx
from sakura_bench.data.text import GLUE_TASKS, read_glue_task, read_lm_corpus
from sakura_bench.data.tokenizer import CLS, PAD, SEP, WordTokenizer
from sakura_bench.errors import BenchError
from sakura_bench.trial import TrialConfig, run_trial


def write_idx(path: Path, type_code: int, shape: tuple[int, ...], payload: bytes) -> None:
    """An IDX file as LeCun's format defines it (big-endian header)."""
    header = bytes([0, 0, type_code, len(shape)]) + struct.pack(f">{len(shape)}i", *shape)
    data = header + payload
    if path.suffix == ".gz":
        data = gzip.compress(data)
    path.write_bytes(data)


def mnist_files(root: Path, n_train: int = 40, n_test: int = 12, gz: bool = False) -> None:
    root.mkdir(parents=True, exist_ok=True)
    ext = ".gz" if gz else ""
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        pixels = bytes((i * 7 + j) % 256 for i in range(n) for j in range(28 * 28))
        write_idx(root / f"{prefix}-images-idx3-ubyte{ext}", 0x08, (n, 28, 28), pixels)
        write_idx(
            root / f"{prefix}-labels-idx1-ubyte{ext}", 0x08, (n,), bytes(i % 10 for i in range(n))
        )


def test_read_idx_ubyte_and_big_endian_int32(tmp_path: Path) -> None:
    write_idx(tmp_path / "a.idx", 0x08, (2, 3), bytes([0, 1, 2, 253, 254, 255]))
    assert read_idx(tmp_path / "a.idx").tolist() == [[0, 1, 2], [253, 254, 255]]
    write_idx(tmp_path / "b.idx", 0x0C, (3,), struct.pack(">3i", 1, -2, 70000))
    assert read_idx(tmp_path / "b.idx").tolist() == [1, -2, 70000]
    write_idx(tmp_path / "c.idx", 0x0D, (2,), struct.pack(">2f", 1.5, -0.25))
    assert read_idx(tmp_path / "c.idx").tolist() == [1.5, -0.25]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"\x01\x00\x08\x01\x00\x00\x00\x01\x05", "not an IDX file"),
        (b"\x00\x00\x07\x01\x00\x00\x00\x01\x05", "unknown IDX type code 0x07"),
        (
            b"\x00\x00\x08\x01\x00\x00\x00\x03\x05",
            r"shape \(3,\) \(3 bytes of data\) but the file holds 1",
        ),
    ],
)
def test_read_idx_rejects_bad_files(tmp_path: Path, data: bytes, message: str) -> None:
    (tmp_path / "bad").write_bytes(data)
    with pytest.raises(BenchError, match=message):
        read_idx(tmp_path / "bad")


@pytest.mark.parametrize("gz", [False, True])
def test_load_mnist(tmp_path: Path, gz: bool) -> None:
    mnist_files(tmp_path / "MNIST" / "raw", gz=gz)  # torchvision's layout is found too
    (train_x, train_y), (test_x, _) = load_mnist(tmp_path)
    assert train_x.shape == (40, 1, 28, 28) and test_x.shape == (12, 1, 28, 28)
    assert train_y.tolist() == [i % 10 for i in range(40)]
    raw = (3 * 7 + 5) % 256  # sample 3, pixel (0, 5)
    assert train_x[3, 0, 0, 5].item() == pytest.approx(
        (raw / 255 - MNIST_MEAN) / MNIST_STD, rel=1e-6
    )


def test_missing_mnist_file_names_what_was_looked_for(tmp_path: Path) -> None:
    with pytest.raises(BenchError, match="none of train-images-idx3-ubyte"):
        load_mnist(tmp_path)


def cifar_file(path: Path, labels: list[int]) -> None:
    records = b""
    for i, label in enumerate(labels):
        records += bytes([label]) + bytes(
            (i + c * 3 + p) % 256 for c in range(3) for p in range(1024)
        )
    path.write_bytes(records)


def test_read_cifar_batch(tmp_path: Path) -> None:
    cifar_file(tmp_path / "b.bin", [3, 9])
    images, labels = read_cifar_batch(tmp_path / "b.bin")
    assert labels.tolist() == [3, 9]
    assert images.shape == (2, 3, 32, 32) and images.dtype == torch.uint8
    # record 1, channel 2 (blue), row 4, column 7 -> byte 2 * 1024 + 4 * 32 + 7 of the image
    assert images[1, 2, 4, 7].item() == (1 + 2 * 3 + 4 * 32 + 7) % 256
    (tmp_path / "short.bin").write_bytes(b"\x01" * 100)
    with pytest.raises(BenchError, match="not a whole number of 3073-byte"):
        read_cifar_batch(tmp_path / "short.bin")


def test_load_cifar10_joins_the_training_batches(tmp_path: Path) -> None:
    root = tmp_path / "cifar-10-batches-bin"
    root.mkdir()
    cifar_file(root / "data_batch_1.bin", [0, 1, 2])
    cifar_file(root / "data_batch_2.bin", [3, 4])
    cifar_file(root / "test_batch.bin", [5, 6, 7, 8])
    (train_x, train_y), (_, test_y) = load_cifar10(tmp_path)
    assert train_y.tolist() == [0, 1, 2, 3, 4] and test_y.tolist() == [5, 6, 7, 8]
    assert train_x.shape == (5, 3, 32, 32) and train_x.dtype == torch.float32


def sst2_files(folder: Path, n: int = 24) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    words = ["a great movie", "terrible , boring plot", "quite good", "awful acting"]
    rows = ["sentence\tlabel"] + [f"{words[i % 4]} {i}\t{1 - (i % 4) % 2}" for i in range(n)]
    (folder / "train.tsv").write_text("\n".join(rows) + "\n")
    (folder / "dev.tsv").write_text("\n".join(rows[: n // 2 + 1]) + "\n")


def glue_files(root: Path) -> None:
    sst2_files(root / "SST-2")
    cola = root / "CoLA"
    cola.mkdir()
    lines = [f"gj04\t{i % 2}\t\tthe cat sat {i} ." for i in range(20)]
    (cola / "train.tsv").write_text("\n".join(lines) + "\n")
    (cola / "dev.tsv").write_text("\n".join(lines[:8]) + "\n")
    rte = root / "RTE"
    rte.mkdir()
    labels = ("entailment", "not_entailment")
    lines = ["index\tsentence1\tsentence2\tlabel"] + [
        f"{i}\tit rains {i}\tthe street is wet\t{labels[i % 2]}" for i in range(20)
    ]
    (rte / "train.tsv").write_text("\n".join(lines) + "\n")
    (rte / "dev.tsv").write_text("\n".join(lines[:9]) + "\n")


def test_read_glue_tasks(tmp_path: Path) -> None:
    glue_files(tmp_path)
    train, dev = read_glue_task(tmp_path, GLUE_TASKS["sst2"])
    assert train.first[:2] == ["a great movie 0", "terrible , boring plot 1"]
    assert train.second is None and train.labels[:4].tolist() == [1, 0, 1, 0]
    assert len(dev.first) == 12
    train, _ = read_glue_task(tmp_path, GLUE_TASKS["cola"])  # no header, sentence in column 3
    assert train.first[1] == "the cat sat 1 ." and train.labels[:3].tolist() == [0, 1, 0]
    train, dev = read_glue_task(tmp_path, GLUE_TASKS["rte"])
    assert train.second is not None and train.second[0] == "the street is wet"
    assert train.labels[:2].tolist() == [0, 1] and len(dev.first) == 8
    # --data pointing at the task folder itself works too
    train, _ = read_glue_task(tmp_path / "SST-2", GLUE_TASKS["sst2"])
    assert len(train.first) == 24


def test_glue_errors(tmp_path: Path) -> None:
    sst2_files(tmp_path)
    (tmp_path / "train.tsv").write_text("sentence\tlabel\nfine movie\t7\n")
    with pytest.raises(BenchError, match=r"train.tsv:2: label '7' is not one of 0, 1"):
        read_glue_task(tmp_path, GLUE_TASKS["sst2"])
    (tmp_path / "train.tsv").write_text("text\tlabel\nfine movie\t1\n")
    with pytest.raises(BenchError, match="no column 'sentence' in the header"):
        read_glue_task(tmp_path, GLUE_TASKS["sst2"])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(BenchError, match=r"no MRPC/train\.tsv"):
        read_glue_task(empty, GLUE_TASKS["mrpc"])


def test_tokenizer_is_deterministic_with_frequency_ranks_and_hash_buckets() -> None:
    texts = ["the cat", "the dog", "The cat !"]
    tok = WordTokenizer.build(texts, vocab_size=4 + 3 + 8, hash_buckets=8)
    assert tok.words == ["the", "cat", "!"]  # the ×3, cat ×2, then ties alphabetically: ! < dog
    assert tok.token_id("the") == 4 and tok.token_id("!") == 6
    unknown = tok.token_id("dog")
    assert 7 <= unknown < 15 and unknown == WordTokenizer.build(texts, 15, 8).token_id("dog")
    ids, mask = tok.encode_pairs(["The cat"], ["the dog walks far away"], max_length=7)
    assert ids[0, 0] == CLS and ids[0, 3] == SEP and ids[0, -1] == SEP
    assert mask.tolist() == [[1] * 7]  # truncated: the longer second part lost words
    ids, mask = tok.encode_pairs(["cat"], None, max_length=6)
    assert ids.tolist() == [[CLS, 5, SEP, PAD, PAD, PAD]] and mask.sum() == 3


def test_lm_corpus(tmp_path: Path) -> None:
    (tmp_path / "train.txt").write_text("one two three four five six seven eight\n" * 10)
    (tmp_path / "valid.txt").write_text("one two three four\n" * 5)
    train, valid = read_lm_corpus(tmp_path)
    assert train.startswith("one two") and len(valid.split()) == 20


@pytest.mark.parametrize(
    ("workload", "make", "framework"),
    [
        ("mnist-mlp", lambda d: mnist_files(d), "pytorch-ddp"),
        ("mnist-mlp-multi", lambda d: mnist_files(d, n_train=300, n_test=20), "pytorch-ddp"),
        ("distilbert-sst2-hf", lambda d: sst2_files(d / "SST-2", n=48), "hf-trainer"),
        ("distilbert-glue", glue_files, "lightning"),
        ("llama3-1b-finetune", None, "pytorch-ddp"),
    ],
)
def test_workloads_train_on_real_format_files(
    tmp_path: Path, workload: str, make, framework: str
) -> None:  # type: ignore[no-untyped-def]
    if make is None:
        (tmp_path / "train.txt").write_text(" ".join(f"w{i % 50}" for i in range(2000)))
        (tmp_path / "valid.txt").write_text(" ".join(f"w{i % 40}" for i in range(400)))
    else:
        make(tmp_path)
    result = run_trial(
        TrialConfig(workload, "baseline", framework, scale="tiny", epochs=1, data_dir=str(tmp_path))
    )
    assert result["workload"]["data"] == str(tmp_path)
    assert result["errors"] == [] and result["final_metrics"]
    expected = {
        "mnist-mlp": 40,
        "mnist-mlp-multi": 256,
        "distilbert-sst2-hf": 32,
        "llama3-1b-finetune": 16,
    }
    if workload in expected:
        assert result["samples_per_epoch"] == expected[workload]
    if workload == "distilbert-glue":  # the three task folders written, 16 examples each
        assert result["samples_per_epoch"] == 48
        assert {"val_acc_sst2", "val_acc_cola", "val_acc_rte"} <= set(result["final_metrics"])
        assert "val_acc_mnli" not in result["final_metrics"]


def test_cifar_workload_reads_binary_batches(tmp_path: Path) -> None:
    root = tmp_path / "cifar-10-batches-bin"
    root.mkdir()
    cifar_file(root / "data_batch_1.bin", [i % 10 for i in range(20)])
    cifar_file(root / "test_batch.bin", [i % 10 for i in range(16)])
    result = run_trial(
        TrialConfig(
            "cifar10-resnet50",
            "baseline",
            "pytorch-ddp",
            scale="tiny",
            epochs=1,
            data_dir=str(tmp_path),
        )
    )
    assert result["samples_per_epoch"] == 16 and result["final_metrics"]["val_acc"] >= 0
