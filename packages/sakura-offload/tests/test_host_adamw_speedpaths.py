"""The host kernel's fast paths against its portable ones: the AVX-512 loops against a build
without AVX-512 (bit for bit), the batched call against one call per tensor, the batched
optimizer step against per-tensor (eager) updates, and the huge-page state allocation."""

from __future__ import annotations

import copy
import ctypes
from pathlib import Path

import pytest
import torch
from _host_adamw_hyper import adamw_hyper
from _offload_models import batches, loss_of, mlp

from sakura_offload import OffloadAdamW
from sakura_offload.host_optimizer import kernel as _kernel
from sakura_offload.host_optimizer import moments as fmt
from sakura_offload.host_optimizer import optimizer as optimizer_module
from sakura_offload.host_optimizer.backends import Hyper, KernelBackend, Update, run_each
from sakura_offload.host_optimizer.state_layout import new_state

FORMATS = ("float32", "bfloat16", "int8")


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns (NaN-aware equality)."""
    if t.dtype == torch.float32:
        return t.view(torch.int32)
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(_bits(a[key]), _bits(b[key])), key


def _grads(n: int, seed: int, *, extreme: bool) -> torch.Tensor:
    """Gradients over 10 decades; ``extreme``: blocks around 1e9 (absmaxes past the
    one-multiplication scales), around 1e-30 (subnormal codes and bf16 moments), and an
    Inf, a -Inf and a NaN."""
    g = torch.Generator().manual_seed(seed)
    grad = torch.randn(n, generator=g) * torch.logspace(-8, 2, n)[torch.randperm(n, generator=g)]
    if extreme:
        grad[256:512] *= 1e9
        grad[768:1024] *= 1e-30
        grad[[5, 600, n - 3]] = torch.tensor([float("inf"), float("-inf"), float("nan")])
    return grad


def _state(n: int, moment_dtype: str, seed: int) -> dict[str, torch.Tensor]:
    """Weights and moments of a few steps' size (not zero, so the decode matters)."""
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=g)
    m = torch.randn(n, generator=g) * 1e-2
    v = (torch.randn(n, generator=g) * 1e-2) ** 2
    if moment_dtype == "float32":
        return {"p": p, "m": m, "v": v}
    if moment_dtype == "bfloat16":
        return {"p": p, "m": m.bfloat16(), "v": v.bfloat16()}
    codes, absmax = fmt.quantize_blocks(m, signed=True)
    bits = fmt.pair_bits(7, absmax.numel())
    s_codes, s_absmax = fmt.quantize_blocks(v.sqrt(), signed=False, bits=bits)
    return {"p": p, "m": codes, "v": s_codes, "m_absmax": absmax, "v_absmax": s_absmax}


def _update(state: dict[str, torch.Tensor], grad: torch.Tensor, h: Hyper) -> Update:
    return Update(
        state["p"], grad, state["m"], state["v"], h, state.get("m_absmax"), state.get("v_absmax")
    )


@pytest.mark.parametrize("moment_dtype", FORMATS)
@pytest.mark.parametrize("extreme", [False, True])
@pytest.mark.parametrize("grad_scale", [1.0, 0.37])
def test_avx512_loops_equal_the_portable_build_bit_for_bit(
    vector: _kernel.Kernel,
    portable: _kernel.Kernel,
    moment_dtype: str,
    extreme: bool,
    grad_scale: float,
) -> None:
    if vector.vector_width == 1:
        pytest.skip("this CPU has no AVX-512: the default build is the portable one")
    assert portable.vector_width == 1
    n = 40_000 + 77  # several work items, a vector tail, a partial int8 block
    states = [_state(n, moment_dtype, 1) for _ in range(2)]
    for step in range(1, 4):
        grad = _grads(n, step, extreme=extreme)
        for kernel, state in zip((vector, portable), states, strict=True):
            KernelBackend(kernel).batch(
                moment_dtype, [_update(state, grad, adamw_hyper(step, 3, grad_scale))]
            )
        _assert_same(states[0], states[1])
    assert states[0]["p"].isfinite().sum() >= n - 3  # the update ran, non-finite stayed local


@pytest.mark.parametrize("moment_dtype", FORMATS)
@pytest.mark.parametrize("threads", [1, 2])
def test_one_batched_call_equals_one_call_per_tensor(
    vector: _kernel.Kernel, moment_dtype: str, threads: int
) -> None:
    sizes = (1, 300, 16_384, 16_385, 50_000)  # smaller and larger than a work item
    batched = [_state(n, moment_dtype, i) for i, n in enumerate(sizes)]
    single = copy.deepcopy(batched)
    backend = KernelBackend(vector)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for step in range(1, 3):
            grads = [_grads(n, 10 * step + i, extreme=False) for i, n in enumerate(sizes)]
            hypers = [adamw_hyper(step, i, 1.0 if i % 2 else 0.5) for i in range(len(sizes))]
            args = zip(batched, grads, hypers, strict=True)
            backend.batch(moment_dtype, [_update(s, g, h) for s, g, h in args])
            args = zip(single, grads, hypers, strict=True)
            run_each(backend, moment_dtype, [_update(s, g, h) for s, g, h in args])
    finally:
        torch.set_num_threads(previous)
    for a, b in zip(batched, single, strict=True):
        _assert_same(a, b)
    assert not torch.equal(batched[-1]["p"], _state(sizes[-1], moment_dtype, 4)["p"])


@pytest.mark.parametrize("moment_dtype", FORMATS)
def test_batched_results_do_not_depend_on_the_thread_count(
    vector: _kernel.Kernel, moment_dtype: str
) -> None:
    sizes = (5_000, 70_000, 33_000)  # work items split unevenly between two threads
    results = []
    previous = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            states = [_state(n, moment_dtype, i) for i, n in enumerate(sizes)]
            grads = [_grads(n, 20 + i, extreme=True) for i, n in enumerate(sizes)]
            updates = [
                _update(s, g, adamw_hyper(1, i, 0.8))
                for i, (s, g) in enumerate(zip(states, grads, strict=True))
            ]
            KernelBackend(vector).batch(moment_dtype, updates)
            results.append(states)
    finally:
        torch.set_num_threads(previous)
    for a, b in zip(*results, strict=True):
        _assert_same(a, b)


@pytest.mark.parametrize("moment_dtype", ["float32", "bf16", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_batched_step_equals_the_per_tensor_eager_updates(
    moment_dtype: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    # eager=True updates each tensor by itself during backward (one kernel call each);
    # eager=False gathers them in step() and makes batched calls: bf16 parameters (fp32
    # masters, gradient copies) with a cap that splits each step into several batches.
    monkeypatch.setattr(optimizer_module, "BATCH_COPY_BYTES", 2000)
    models = [mlp(dtype), mlp(dtype)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [
        OffloadAdamW(m.parameters(), lr=1e-2, moment_dtype=moment_dtype, eager=eager)
        for m, eager in zip(models, (True, False), strict=True)
    ]
    assert opts[0].backend.name == "cpp"
    calls: list[int] = []
    batch = opts[1].backend.batch
    monkeypatch.setattr(
        opts[1].backend,
        "batch",
        lambda fmt_, updates: (calls.append(len(updates)), batch(fmt_, updates)),
    )
    for data in batches(5):
        for model, opt in zip(models, opts, strict=True):
            opt.zero_grad()
            loss_of(model, data).backward()
            opt.step()
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(a, b)
    tensors = len(list(models[1].parameters()))
    assert sum(calls) == 5 * tensors
    # bf16: copies of 38400, 1200 + 12000 and 40 bytes, so three calls per step
    assert len(calls) == (5 if dtype == torch.float32 else 5 * 3)
    assert opts[1].stats()["kernel_seconds"] > 0


def test_state_on_huge_pages_is_zero_and_the_master_a_copy(vector: _kernel.Kernel) -> None:
    backend = KernelBackend(vector)
    p = torch.nn.Parameter(torch.randn(3, 1_000_000).bfloat16())  # 12 MB of fp32 master
    for moment_dtype in FORMATS:
        state = new_state(p, moment_dtype, master=True, zeros=backend.zeros)
        plain = new_state(p, moment_dtype, master=True)
        assert state.keys() == plain.keys()
        for key, value in state.items():
            assert value.dtype == plain[key].dtype and value.shape == plain[key].shape, key
            assert torch.equal(value, plain[key]), key
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.exists() and "[never]" not in thp.read_text():
        tensor = torch.empty(4 << 20)  # 16 MiB: at least 6 whole 2 MiB pages inside
        assert vector.advise_huge(tensor) >= 6 << 21


def test_the_job_structure_matches_the_kernel() -> None:
    assert ctypes.sizeof(_kernel.Job) == 96  # static_assert(sizeof(Job) == 96) in the source
    assert _kernel.LIBRARY.abi_version == 5
    assert "-ffp-contract=off" in _kernel.LIBRARY.cflags
