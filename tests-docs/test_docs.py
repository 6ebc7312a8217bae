"""Every page of the user documentation runs as written.

The one place that executes documentation (packages do not keep copies of this test). Pages:
``README.md``, ``CONTRIBUTING.md``, ``docs/*.md`` and every ``packages/*/README.md``,
found on disk, so a new page is covered the day it is written.

For each page:

* a fenced block whose info string starts with ``python`` is ``python`` (runnable),
  ``python torchrun`` (a whole script for ``torchrun --nproc-per-node 2``, run so, on gloo)
  or ``python norun`` (a fragment of a larger program; it must still compile);
* the runnable blocks are executed in order, in one namespace, in one fresh interpreter,
  in an empty directory, without ``SAKURA_*`` variables, offline, on one thread. A page
  checks its own claims with ``assert`` and ``print`` inside its blocks; the few checks
  that need to look at the directory afterwards are in ``AFTER`` below;
* blocks preceded by ``<!-- file: PATH -->`` are real files of the repository, checked
  verbatim by ``tests-integration/test_docs.py``, and are not run here.

Run one page: ``nox -s tests -- tests-docs -k quant``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FENCE = re.compile(
    r"(?:^<!-- (?P<marker>file: \S+) -->\n(?:\n)?)?"
    r"^```(?P<info>[^\n`]*)\n(?P<body>.*?)^```[ ]*$",
    re.MULTILINE | re.DOTALL,
)
RUNNABLE, TORCHRUN, FRAGMENT = "python", "python torchrun", "python norun"
INFOS = (RUNNABLE, TORCHRUN, FRAGMENT)
TIMEOUT_S = 300


@dataclass(frozen=True)
class Block:
    info: str
    body: str
    line: int  # of the opening fence, 1-based
    is_file: bool  # shown as a real file of the repository (<!-- file: PATH -->)


def pages() -> list[str]:
    found = [REPO / "README.md", REPO / "CONTRIBUTING.md"]
    found += sorted((REPO / "docs").glob("*.md"))
    found += sorted((REPO / "packages").glob("*/README.md"))
    return [str(p.relative_to(REPO)) for p in found if p.is_file()]


def blocks(text: str) -> list[Block]:
    out = []
    for m in FENCE.finditer(text):
        fence_at = m.start("info") - 3
        out.append(
            Block(
                info=m["info"].strip(),
                body=m["body"],
                line=text.count("\n", 0, fence_at) + 1,
                is_file=m["marker"] is not None,
            )
        )
    return out


def _as_script(selected: list[Block]) -> str:
    """Blocks as one script in which each keeps its line numbers, so a traceback points at
    the page's own line."""
    lines: list[str] = []
    for block in selected:
        lines += [""] * (block.line - len(lines))  # block.line + 1 is the body's first line
        lines += block.body.splitlines()
    return "\n".join(lines) + "\n"


def script_of(page: str, text: str) -> str:
    """The ``python`` blocks of a page, in order, as one script."""
    return _as_script([b for b in blocks(text) if b.info == RUNNABLE and not b.is_file])


def torchrun_scripts(text: str) -> list[str]:
    """Each ``python torchrun`` block of a page as a script of its own."""
    return [_as_script([b]) for b in blocks(text) if b.info == TORCHRUN and not b.is_file]


def _env(workdir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SAKURA_", "MYPLUGIN_"))}
    env.update(
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TORCHINDUCTOR_CACHE_DIR=str(workdir.parent / "inductor-cache"),
    )
    return env


def run_page(script: str, filename: str, workdir: Path) -> subprocess.CompletedProcess[str]:
    """Run ``script`` in a fresh interpreter in ``workdir``; tracebacks name ``filename``."""
    workdir.mkdir(parents=True, exist_ok=True)
    runner = f"import sys\nexec(compile(sys.stdin.read(), {filename!r}, 'exec'))\n"
    return subprocess.run(
        [sys.executable, "-c", runner],
        input=script,
        cwd=workdir,
        env=_env(workdir),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


def run_torchrun(script: str, path: Path, workdir: Path) -> subprocess.CompletedProcess[str]:
    """Run ``script`` (written to ``path``, outside ``workdir``) as 2 local ranks."""
    workdir.mkdir(parents=True, exist_ok=True)
    path.write_text(script, encoding="utf-8")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return subprocess.run(
        [*launcher, "--nproc-per-node", "2", str(path)],
        cwd=workdir,
        env=_env(workdir),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


# --- What some pages leave behind, checked after they ran ---------------------------------

# Appended to docs/hooks.md: every service class the page defines passes install-time
# validation (a misspelt hook name fails the page), and the names are printed.
VALIDATE_SERVICES = """
import inspect as _inspect
import json as _json
from sakura.service import validate_service as _validate

_checked = []
for _name, _obj in list(globals().items()):
    if _inspect.isclass(_obj) and _obj.__module__ == "__main__" and hasattr(_obj, "name"):
        _validate(_obj.__new__(_obj))
        _checked.append(_name)
print(_json.dumps(sorted(_checked)))
"""
APPEND = {"docs/hooks.md": VALIDATE_SERVICES}


def _hooks(out: str, cwd: Path) -> None:
    checked = set(json.loads(out.strip().splitlines()[-1]))
    assert checked >= {
        "PrintEpochs",
        "JsonlLog",
        "StaticLossScale",
        "GradNormMonitor",
        "MetricsTap",
        "CountParams",
        "RecordGitRevision",
        "ReportErrors",
    }
    assert list(cwd.iterdir()) == []  # the examples write nothing when only defined


def _helpers(out: str, cwd: Path) -> None:
    assert (cwd / "state.json").read_text() == '{"step": 12}'
    assert sorted(p.name for p in cwd.iterdir()) == ["checkpoint-12", "state.json", "weights.bin"]


def _async(out: str, cwd: Path) -> None:
    from sakura_async.checkpoint import find_checkpoints

    epoch, rest = out.strip().splitlines()[-1].split(" ", 1)
    assert int(epoch) >= 0 and "'name': 'val_loss'" in rest and "['model', 'optimizer']" in rest
    assert 1 <= len(find_checkpoints(cwd / "ckpt", verify=True)) <= 2  # every="best", keep=2
    assert sorted(p.name for p in cwd.iterdir()) == ["ckpt"]  # nothing else written


def _adapters(out: str, cwd: Path) -> None:
    # Telemetry wrote one line per event of each run; the strict resume named the new service.
    assert '"OnOptimizerStep"' in (cwd / "events.jsonl").read_text()
    assert '"OnOptimizerStep"' in (cwd / "hf-events.jsonl").read_text()
    assert "no state for installed service(s) ['step_count']" in out
    assert (cwd / "hf-out" / "checkpoint-4").is_dir()


def _zero(out: str, cwd: Path) -> None:
    import torch

    assert {line.split(":")[0] for line in out.splitlines() if "AdamW state" in line} == {
        "rank 0",
        "rank 1",
    }
    checkpoint = torch.load(cwd / "checkpoint.pt", weights_only=True)
    assert "model" in checkpoint


AFTER_TORCHRUN: dict[str, Callable[[str, Path], None]] = {
    "packages/sakura-zero/README.md": _zero,
}

AFTER: dict[str, Callable[[str, Path], None]] = {
    "docs/hooks.md": _hooks,
    "docs/helpers.md": _helpers,
    "docs/async.md": _async,
    "packages/sakura-adapters/README.md": _adapters,
}


# --- Tests -----------------------------------------------------------------------------


def _text(page: str) -> str:
    return (REPO / page).read_text(encoding="utf-8")


def _runnable_pages() -> list[str]:
    return [
        p
        for p in pages()
        if any(b.info in (RUNNABLE, TORCHRUN) and not b.is_file for b in blocks(_text(p)))
    ]


@pytest.mark.parametrize("page", pages())
def test_python_blocks_are_marked_and_compile(page: str) -> None:
    for block in blocks(_text(page)):
        if not block.info.startswith("python"):
            continue
        where = f"{page}:{block.line}"
        assert block.info in INFOS, f"{where}: unknown fence info {block.info!r}"
        compile(block.body, where, "exec")


@pytest.mark.parametrize("page", _runnable_pages())
def test_page_runs_as_written(page: str, tmp_path: Path) -> None:
    text, cwd = _text(page), tmp_path / "cwd"
    script = script_of(page, text)
    if script.strip():
        result = run_page(script + APPEND.get(page, ""), page, cwd)
        assert result.returncode == 0, f"{page} failed:\n{result.stderr[-4000:]}"
        if page in AFTER:
            AFTER[page](result.stdout, cwd)
    for i, ranks_script in enumerate(torchrun_scripts(text)):
        path = tmp_path / f"{Path(page).stem}-torchrun-{i}.py"
        result = run_torchrun(ranks_script, path, tmp_path / f"ranks-{i}")
        assert result.returncode == 0, f"{page} (torchrun) failed:\n{result.stderr[-4000:]}"
        if page in AFTER_TORCHRUN:
            AFTER_TORCHRUN[page](result.stdout, tmp_path / f"ranks-{i}")


def test_the_pages_that_promise_examples_have_them() -> None:
    runnable = set(_runnable_pages())
    promised = {
        "docs/hooks.md",
        "docs/helpers.md",
        "docs/async.md",
        "docs/precision.md",
        "docs/quant.md",
        "docs/offload.md",
        "docs/configuration.md",
        "packages/sakura-adapters/README.md",
        "packages/sakura-async/README.md",
        "packages/sakura-offload/README.md",
        "packages/sakura-precision/README.md",
        "packages/sakura-quant/README.md",
        "packages/sakura-zero/README.md",
    }
    assert promised <= runnable, sorted(promised - runnable)
    assert set(AFTER) <= runnable and set(APPEND) <= runnable
    helpers = script_of("docs/helpers.md", _text("docs/helpers.md"))
    for module in ("sakura.options", "sakura.fileio", "sakura.env", "sakura.registry"):
        assert f"from {module} import" in helpers, module


# --- The checks themselves fail on drift (deliberate drift) ----------------------------

DRIFTED = """# A page

```python
x = 1
```

Some prose.

```python
assert x == 2, "the page's claim no longer holds"
```

```pyhton
typo
```
"""


def test_a_drifted_page_fails_with_its_own_line(tmp_path: Path) -> None:
    result = run_page(script_of("drifted.md", DRIFTED), "drifted.md", tmp_path / "cwd")
    assert result.returncode != 0
    assert 'File "drifted.md", line 10' in result.stderr
    assert "the page's claim no longer holds" in result.stderr
    infos = [b.info for b in blocks(DRIFTED)]
    assert infos == ["python", "python", "pyhton"]
    assert not all(i in INFOS for i in infos if i.startswith("py"))


def test_a_misspelt_hook_in_a_page_fails(tmp_path: Path) -> None:
    page = "```python\nclass Late:\n    name = 'late'\n\n    def on_train_start(self, event):\n        pass\n```\n"
    result = run_page(script_of("late.md", page) + VALIDATE_SERVICES, "late.md", tmp_path)
    assert result.returncode != 0
    assert "'on_train_start', which is not a sakura hook" in result.stderr


def test_blocks_shown_as_files_are_not_run() -> None:
    text = "<!-- file: x.py -->\n\n```python\nraise SystemExit(1)\n```\n"
    (block,) = blocks(text)
    assert block.is_file and script_of("x.md", text).strip() == ""
