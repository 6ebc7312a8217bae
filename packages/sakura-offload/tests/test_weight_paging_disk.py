"""WeightPaging's disk tier (``disk_offload=``): frozen tensors that the host budget cannot
hold live in memory-mapped files, training stays bit-identical, the folder goes away on
remove / an exception / exit, a real failed write (RLIMIT_FSIZE) is a clear error that
leaves the model as it was, and bad options name themselves."""

from __future__ import annotations

import copy
import errno
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from sakura import marks
from sakura.options import OptionError
from sakura_offload.paging.weights import WeightPaging

WIDTH = 32


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.up = torch.nn.Linear(WIDTH, 2 * WIDTH)
        self.down = torch.nn.Parameter(torch.randn(WIDTH, 2 * WIDTH) * 0.2)
        self.register_buffer("codes", torch.randint(-8, 8, (2 * WIDTH,), dtype=torch.int8))
        self.adapter = torch.nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.up(self.norm(x))) * self.codes.float()
        return x + h @ self.down.t() + self.adapter(x)  # down.t(): a view autograd saves


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(4))
        self.head = torch.nn.Linear(WIDTH, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.head(x)
        return out


def net() -> Net:
    torch.manual_seed(0)
    model = Net()
    for block in model.blocks:
        block.norm.requires_grad_(False)
        block.up.requires_grad_(False)
        block.down.requires_grad_(False)
    return model


# up.weight, up.bias, down, norm.weight, norm.bias (fp32) and codes (int8)
BLOCK_BYTES = (2 * WIDTH * WIDTH + 2 * WIDTH + 2 * WIDTH * WIDTH + 2 * WIDTH) * 4 + 2 * WIDTH


def train(model: torch.nn.Module, steps: int = 3) -> list[torch.Tensor]:
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    record: list[torch.Tensor] = []
    for step in range(steps):
        x = torch.randn(4, 5, WIDTH, generator=torch.Generator().manual_seed(step))
        out = model(x)
        optimizer.zero_grad()
        out.pow(2).mean().backward()
        record += [out.detach(), *(p.grad.clone() for p in model.parameters() if p.requires_grad)]
        optimizer.step()
    return record


def mapped_files() -> str:
    return Path("/proc/self/maps").read_text() if Path("/proc/self/maps").exists() else ""


@pytest.mark.parametrize(("host_budget", "on_disk"), [(0, 4), (BLOCK_BYTES, 3), ("1MiB", 0)])
def test_blocks_past_the_host_budget_stream_from_mapped_files(
    host_budget: Any, on_disk: int, tmp_path: Path
) -> None:
    want = train(net())
    model = net()
    paging = WeightPaging(model, disk_offload=tmp_path / "offload", host_budget=host_budget)
    root = paging.disk_root
    assert root is not None and root.parent == tmp_path / "offload"
    tiers = ["host"] * (4 - on_disk) + ["disk"] * on_disk
    assert list(paging.tiers.values()) == tiers
    assert paging.stats.paged_bytes == 4 * BLOCK_BYTES
    assert paging.stats.disk_bytes == on_disk * BLOCK_BYTES
    assert paging.stats.disk_blocks == on_disk
    assert paging.host_budget == (1 << 20 if host_budget == "1MiB" else host_budget)
    assert len(list(root.iterdir())) == 6 * on_disk  # a file per tensor, written whole
    assert all(marks.has_mark(b, marks.WEIGHTS_STREAMED) for b in model.blocks)
    last = model.blocks[3]
    if on_disk:  # between passes the frozen tensors are the mapped files themselves
        assert last.down.data_ptr() == paging._blocks[3].host["down"].data_ptr()
        assert not last.down.is_pinned()
        if mapped_files():
            assert str(root) in mapped_files()
    assert f"{paging.stats.disk_bytes} on disk" in repr(paging)

    got = train(model)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    assert paging.stats.max_live_blocks == 2 and paging.stats.live_blocks == 0

    paging.remove()
    assert not root.exists() and not (tmp_path / "offload").exists()
    assert torch.equal(last.down, net().blocks[3].down) and torch.equal(
        last.codes, net().blocks[3].codes
    )
    if mapped_files():
        del got
        assert str(root) not in mapped_files()  # the weights were copied out of the files
    assert not any(marks.has_mark(b, marks.WEIGHTS_STREAMED) for b in model.blocks)


def test_a_with_block_removes_the_files_and_puts_weights_back_after_an_exception(
    tmp_path: Path,
) -> None:
    model = net()
    expected = copy.deepcopy(model)
    with (
        pytest.raises(ZeroDivisionError),
        WeightPaging(model, disk_offload=tmp_path, host_budget=0) as paging,
    ):
        root = paging.disk_root
        model(torch.randn(2, 3, WIDTH)).sum().backward()
        raise ZeroDivisionError
    assert root is not None and not root.exists() and list(tmp_path.iterdir()) == []
    x = torch.randn(2, 3, WIDTH)
    assert torch.equal(model(x), expected(x))
    assert all(not b.is_pinned() for b in model.buffers())


def test_bad_options_name_the_option_the_value_and_what_is_accepted(tmp_path: Path) -> None:
    with pytest.raises(OptionError, match=r"WeightPaging: disk_offload=3 .*accepted: a path"):
        WeightPaging(net(), disk_offload=3)  # type: ignore[arg-type]
    a_file = tmp_path / "file"
    a_file.write_text("")
    with pytest.raises(OptionError, match=r"disk_offload=.*file'.*not a directory"):
        WeightPaging(net(), disk_offload=a_file)
    with pytest.raises(OptionError, match=r"host_budget=0 .*None unless disk_offload= is given"):
        WeightPaging(net(), host_budget=0)
    for bad in ("lots", -1, True, 1.5):
        with pytest.raises(OptionError, match=r"host_budget=.*accepted: None or a number of bytes"):
            WeightPaging(net(), disk_offload=tmp_path, host_budget=bad)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == [a_file]  # no folder left by a refused option
    model = net()
    with pytest.raises(OptionError, match="prefetch=-1"):  # checked before any file is made
        WeightPaging(model, disk_offload=tmp_path, prefetch=-1)
    assert list(tmp_path.iterdir()) == [a_file]


FILE_SIZE_LIMITED = """
import json, os, resource, signal, sys
import torch
sys.path.insert(0, sys.argv[2])
from test_weight_paging_disk import net
from sakura_offload.paging.weights import WeightPaging
from sakura_torch.disk import TensorFileError

model = net()
x = torch.randn(2, 3, 32)
expected = model(x)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
try:
    WeightPaging(model, disk_offload=sys.argv[1], host_budget=0)
except TensorFileError as exc:
    failure = {"errno": exc.errno, "message": str(exc), "left": os.listdir(sys.argv[1]),
               "same": torch.equal(model(x), expected)}
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)
paging = WeightPaging(model, disk_offload=sys.argv[1], host_budget=0)
failure["root"] = str(paging.disk_root)
print(json.dumps(failure), flush=True)
sys.exit(0)  # no remove(): the folder goes at exit
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="RLIMIT_FSIZE and SIGXFSZ are POSIX")
def test_a_real_failed_write_is_a_clear_error_and_the_model_is_left_whole(
    tmp_path: Path,
) -> None:
    """The kernel refuses to grow a file past RLIMIT_FSIZE (EFBIG, the path ENOSPC takes):
    the error names the option and the folder, no file is left, the model computes what it
    did; then a paging made without the limit leaves no folder after the process exits."""
    done = subprocess.run(
        [sys.executable, "-c", FILE_SIZE_LIMITED, str(tmp_path), str(Path(__file__).parent)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    failure = json.loads(done.stdout.strip().splitlines()[-1])
    assert failure["errno"] == errno.EFBIG
    assert (
        f"WeightPaging: disk_offload={str(tmp_path)!r}: writing 'blocks.0." in (failure["message"])
    )
    assert "File too large" in failure["message"]
    assert failure["left"] == [] and failure["same"] is True
    assert not Path(failure["root"]).exists() and list(tmp_path.iterdir()) == []


class Counting(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(WIDTH, WIDTH).requires_grad_(False)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1  # written in place by every forward
        out: torch.Tensor = self.proj(x)
        return out


def test_a_tensor_a_forward_writes_leaves_the_disk_tier_with_its_value(tmp_path: Path) -> None:
    model = torch.nn.Sequential(Counting(), Counting())
    paging = WeightPaging(model, disk_offload=tmp_path, host_budget=0)
    root = paging.disk_root
    assert root is not None and len(list(root.iterdir())) == 6
    with pytest.warns(RuntimeWarning, match=r"forward wrote calls in place") as caught:
        model(torch.randn(3, WIDTH))
    assert sorted(str(w.message)[:27] for w in caught) == [
        "WeightPaging: block 0's for",
        "WeightPaging: block 1's for",
    ]
    model(torch.randn(3, WIDTH))
    assert [int(m.calls) for m in model] == [2, 2]
    assert paging.stats.written == 2 and paging.stats.paged_buffers == 0
    assert paging.stats.live_bytes == 0 and paging.stats.live_blocks == 0
    assert paging.stats.disk_bytes == paging.stats.paged_bytes == 2 * (WIDTH + 1) * WIDTH * 4
    assert len(list(root.iterdir())) == 4  # the counters' files are gone
    paging.remove()
    assert [int(m.calls) for m in model] == [2, 2] and not root.exists()
