"""sakura_torch.host_memory: one reading of host RAM."""

from __future__ import annotations

import builtins
import io
import os
import subprocess
import sys
from typing import Any

import pytest

from sakura_torch.host_memory import HostRam, host_ram


def test_reads_meminfo_as_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    text = "MemTotal:       16384000 kB\nMemFree:  100 kB\nMemAvailable:    8192000 kB\n"
    real_open = builtins.open

    def fake_open(path: Any, *args: Any, **kwargs: Any) -> Any:
        if path == "/proc/meminfo":
            return io.StringIO(text)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", fake_open)
    assert host_ram() == HostRam(available=8192000 * 1024, total=16384000 * 1024)


def test_falls_back_to_sysconf_without_proc(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_proc(path: Any, *args: Any, **kwargs: Any) -> Any:
        raise FileNotFoundError(path)

    monkeypatch.setattr(builtins, "open", no_proc)
    page = os.sysconf("SC_PAGE_SIZE")
    ram = host_ram()
    assert ram.total == os.sysconf("SC_PHYS_PAGES") * page
    assert 0 <= ram.available <= ram.total


def test_the_real_machine_is_plausible_and_torch_is_not_imported() -> None:
    ram = host_ram()
    assert 0 < ram.available <= ram.total
    code = (
        "import sys, sakura_torch.host_memory as m; m.host_ram(); assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
