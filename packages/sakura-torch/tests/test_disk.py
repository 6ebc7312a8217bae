"""TensorFileStore: tensors round-trip through real memory-mapped files (values, dtypes,
strides), files are checked before mapping, the folder goes away on close / exception /
exit, and a real write failure (RLIMIT_FSIZE) or an unwritable folder is a clear error."""

from __future__ import annotations

import errno
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sakura.options import OptionError
from sakura_torch.disk import TensorFileError, TensorFileStore


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 10, generator=g)
    return {
        "fp32": w,
        "transposed": w.t(),  # a view with strides (1, 10): the layout must survive
        "bf16": torch.randn(3, 4, 5, generator=g).to(torch.bfloat16),
        "codes": torch.randint(0, 256, (33,), dtype=torch.uint8, generator=g),
        "int8": torch.randint(-128, 127, (4, 8), dtype=torch.int8, generator=g),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.empty(0, 7),
        "slice": w[1:4, ::2],  # not dense: stored compactly, same values
    }


def test_tensors_round_trip_mapped_with_values_dtypes_and_strides(tmp_path: Path) -> None:
    with TensorFileStore(tmp_path) as store:
        for key, t in tensors().items():
            mapped = store.put(key, t)
            assert mapped.dtype == t.dtype and mapped.shape == t.shape, key
            assert torch.equal(mapped, t), key
            if key != "slice":
                assert mapped.stride() == t.stride(), key
        assert store.get("transposed").stride() == (1, 10)
        assert len(store) == 9 and store.keys()[0] == "fp32"
        expected = sum(t.numel() * t.element_size() for t in tensors().values())
        assert store.nbytes == expected
        files = sorted(p.name for p in store.root.iterdir())
        assert len(files) == 9 and all(name.endswith(".bin") for name in files)
        assert store.root.parent == tmp_path
        if Path("/proc/self/maps").exists():  # zero-copy: the file itself is mapped
            mapped = store.get("fp32")
            assert str(store.root) in Path("/proc/self/maps").read_text()
            del mapped


def test_a_mapped_tensor_is_private_and_a_key_can_be_replaced(tmp_path: Path) -> None:
    store = TensorFileStore(tmp_path)
    original = torch.arange(12.0).reshape(3, 4)
    mapped = store.put("w", original)
    mapped.mul_(-1)  # copy-on-write: the file is untouched
    assert torch.equal(store.get("w"), original)
    store.put("w", torch.ones(2))
    assert torch.equal(store.get("w"), torch.ones(2))
    assert len(list(store.root.iterdir())) == 1  # the replaced file is gone
    store.remove("w")
    assert "w" not in store and list(store.root.iterdir()) == []
    store.close()


def test_a_file_that_changed_is_refused_before_mapping(tmp_path: Path) -> None:
    store = TensorFileStore(tmp_path, option="disk_offload", owner="WeightPaging")
    store.put("a", torch.randn(64))
    store.put("b", torch.randn(8))
    path_a = store.root / "1.bin"
    path_a.write_bytes(path_a.read_bytes()[:100])  # truncated: 100 of 256 bytes
    with pytest.raises(TensorFileError, match=r"'a'.*100 bytes, 256 bytes expected"):
        store.get("a")
    path_b = store.root / "2.bin"
    path_b.unlink()
    path_b.mkdir()
    with pytest.raises(TensorFileError, match="not a regular file"):
        store.get("b")
    with pytest.raises(KeyError, match="'c'"):
        store.get("c")
    store.close()


def test_the_folder_goes_at_close_on_an_exception_and_when_collected(tmp_path: Path) -> None:
    nested = tmp_path / "made" / "here"
    store = TensorFileStore(nested)
    store.put("w", torch.randn(4))
    root = store.root
    assert root.is_dir()
    store.close()
    assert not root.exists() and not (tmp_path / "made").exists()  # created, so removed
    assert store.closed and "closed" in repr(store)
    with pytest.raises(RuntimeError, match="closed"):
        store.put("w", torch.randn(4))

    with pytest.raises(ZeroDivisionError), TensorFileStore(tmp_path) as store:
        store.put("w", torch.randn(4))
        root = store.root
        raise ZeroDivisionError
    assert not root.exists()

    store = TensorFileStore(tmp_path)
    root = store.root
    del store
    gc.collect()
    assert not root.exists()
    assert list(tmp_path.iterdir()) == []  # a directory that existed stays


EXIT_WITHOUT_CLOSE = """
import sys, torch
from sakura_torch.disk import TensorFileStore
store = TensorFileStore(sys.argv[1])
store.put("w", torch.randn(1000))
print(store.root, flush=True)
sys.exit(0)  # no close(): the store is still referenced at exit
"""


def test_the_folder_goes_at_interpreter_exit(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", EXIT_WITHOUT_CLOSE, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    root = Path(done.stdout.strip().splitlines()[-1])
    assert root.parent == tmp_path and not root.exists()


def test_bad_directories_name_the_option_and_what_is_accepted(tmp_path: Path) -> None:
    with pytest.raises(OptionError, match=r"WeightPaging: disk_offload=123 .*accepted: a path"):
        TensorFileStore(123, option="disk_offload", owner="WeightPaging")  # type: ignore[arg-type]
    with pytest.raises(OptionError, match="disk_offload=''"):
        TensorFileStore("", option="disk_offload")
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(OptionError, match=r"directory=.*file.*not a directory"):
        TensorFileStore(a_file)
    with pytest.raises(TypeError, match="dense"):
        TensorFileStore(tmp_path).put("s", torch.eye(3).to_sparse())


def test_a_read_only_folder_is_an_option_error(tmp_path: Path) -> None:
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        try:  # root (and some file systems) write anyway: then there is nothing to refuse
            (folder / "probe").write_bytes(b"")
        except PermissionError:
            pass
        else:
            pytest.skip("this user can write into a 0o555 folder (root)")
        with pytest.raises(OptionError, match=r"disk_offload=.*ro'.*Permission denied"):
            TensorFileStore(folder, option="disk_offload", owner="WeightPaging")
    finally:
        folder.chmod(0o755)


FILE_SIZE_LIMITED = """
import json, os, resource, signal, sys, torch
from sakura_torch.disk import TensorFileError, TensorFileStore
store = TensorFileStore(sys.argv[1], option="disk_offload", owner="WeightPaging")
small = torch.arange(1000.0)
store.put("small", small)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
try:
    store.put("big", torch.randn(1 << 16))  # 256 KiB: more than a file may grow
except TensorFileError as exc:
    print(json.dumps({
        "errno": exc.errno, "message": str(exc), "files": sorted(os.listdir(store.root)),
        "keys": store.keys(), "small": torch.equal(store.get("small"), small),
    }))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="RLIMIT_FSIZE and SIGXFSZ are POSIX")
def test_a_real_failed_write_names_option_and_folder_and_keeps_nothing(tmp_path: Path) -> None:
    """The kernel refuses to grow the file past RLIMIT_FSIZE (EFBIG, the path ENOSPC takes),
    in a subprocess so the limit binds nothing else."""
    done = subprocess.run(
        [sys.executable, "-c", FILE_SIZE_LIMITED, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    failure = json.loads(done.stdout.strip().splitlines()[-1])
    assert failure["errno"] == errno.EFBIG
    assert f"WeightPaging: disk_offload={str(tmp_path)!r}: " in failure["message"]
    assert "writing 'big' (262144 bytes)" in failure["message"]
    assert "File too large" in failure["message"]
    assert failure["files"] == ["1.bin"]  # no temporary file of the failed write is left
    assert failure["keys"] == ["small"] and failure["small"] is True
