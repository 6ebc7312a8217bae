"""``fit``'s decisions as pure functions of injected sizes and budgets: every rung of the
ladder, the moment formats, the disk tier's split, fit options only when nothing fits
without them (cheapest first), and the smallest budgets named when nothing fits."""

from __future__ import annotations

import pytest

from sakura_offload.fit.choices import FitOption
from sakura_offload.fit.decide import Budgets, FitError, ModelSizes, candidates, decide

MB = 2**20
SIZES = ModelSizes(
    trainable_bytes=4 * MB,
    trainable_numel=MB,
    master_bytes=0,
    optimizer_bytes=8 * MB,
    host_optimizer=True,
    outside_frozen_bytes=10 * MB,
    block_names=("layers.0", "layers.1", "layers.2", "layers.3"),
    block_frozen=(20 * MB, 20 * MB, 20 * MB, 20 * MB),
)
HALF = FitOption("halve", "x2", 1.0, {f"layers.{i}.mlp": 10 * MB for i in range(4)}, 50 * MB)
QUARTER = FitOption("quarter", "x4", 2.0, {f"layers.{i}.mlp": 15 * MB for i in range(4)}, 30 * MB)


def test_the_ladder_costs_what_it_says() -> None:
    plans = candidates(SIZES, Budgets(device=None, host=10**12, disk=10**12))
    got = [(p.optimizer, p.weights, p.device_bytes // MB) for p in plans]
    # trainable + grads = 8; optimizer 8; frozen 90 resident, else 10 outside + 2 blocks
    assert got == [
        ("device", "resident", 8 + 8 + 90),
        ("host", "resident", 8 + 90),
        ("device", "host", 8 + 8 + 10 + 40),
        ("host", "host", 8 + 10 + 40),
        ("device", "disk", 8 + 8 + 10 + 40),
        ("host", "disk", 8 + 10 + 40),
    ]
    assert plans[2].host_bytes == 80 * MB  # every block, no optimizer state
    assert plans[3].host_bytes == 8 * MB + 80 * MB  # fp32 moments + every block


@pytest.mark.parametrize(
    ("device", "expected"),
    [
        (106, ("device", "resident")),
        (105, ("host", "resident")),
        (97, ("device", "host")),
        (66, ("device", "host")),
        (65, ("host", "host")),
    ],
)
def test_cheapest_rung_that_fits(device: int, expected: tuple[str, str]) -> None:
    plan = decide(SIZES, Budgets(device=device * MB, host=10**12))
    assert (plan.optimizer, plan.weights, plan.option) == (*expected, None)


@pytest.mark.parametrize(
    ("host", "dtype"), [(8 * MB, "float32"), (8 * MB - 1, "bfloat16"), (4 * MB - 1, "int8")]
)
def test_moments_shrink_as_host_ram_requires(host: int, dtype: str) -> None:
    plan = decide(SIZES, Budgets(device=98 * MB, host=host))
    assert (plan.optimizer, plan.weights, plan.moment_dtype) == ("host", "resident", dtype)


def test_disk_takes_the_blocks_host_ram_cannot_hold() -> None:
    budgets = Budgets(device=58 * MB, host=8 * MB + 45 * MB, disk=10**12)
    plan = decide(SIZES, budgets)
    assert (plan.weights, plan.block_tiers) == ("disk", ("host", "host", "disk", "disk"))
    assert (plan.host_bytes, plan.disk_bytes) == (48 * MB, 40 * MB)
    assert plan.host_weight_bytes == 40 * MB
    with pytest.raises(FitError, match="or give disk_offload=DIR"):
        decide(SIZES, Budgets(device=58 * MB, host=8 * MB + 45 * MB))


def test_fit_options_only_when_nothing_fits_and_cheapest_first() -> None:
    options = [QUARTER, HALF]  # given in any order: ranked by cost
    assert decide(SIZES, Budgets(device=58 * MB, host=10**12), options).option is None
    plan = decide(SIZES, Budgets(device=57 * MB, host=10**12), options)
    # halved blocks of 10 MB: resident needs 8 + 8 + 50 = 66 (58 with the optimizer on the
    # host), streamed 8 + 10 + 2 * 10 = 38, plus 8 when the optimizer stays on the device
    got = (plan.option, plan.optimizer, plan.weights, plan.device_bytes)
    assert got == (HALF, "device", "host", 46 * MB)
    plan = decide(SIZES, Budgets(device=45 * MB, host=10**12), options)
    got = (plan.option, plan.optimizer, plan.weights, plan.device_bytes)
    assert got == (HALF, "host", "host", 38 * MB)
    # quartered blocks of 5 MB: streamed 8 + 10 + 2 * 5 = 28, 36 with the optimizer
    plan = decide(SIZES, Budgets(device=37 * MB, host=10**12), options)
    got = (plan.option, plan.optimizer, plan.weights, plan.device_bytes)
    assert got == (QUARTER, "device", "host", 36 * MB)
    plan = decide(SIZES, Budgets(device=35 * MB, host=10**12), options)
    got = (plan.option, plan.optimizer, plan.weights, plan.device_bytes)
    assert got == (QUARTER, "host", "host", 28 * MB)
    assert plan.activation_budget == 7 * MB
    assert any(r.startswith("not ") for r in plan.reasons)


def test_smallest_budgets_are_named() -> None:
    with pytest.raises(FitError, match=r"device_budget >= .*\(29360128 bytes\)") as info:
        decide(SIZES, Budgets(device=28 * MB - 1, host=10**12), [HALF, QUARTER])
    assert info.value.minimum == 28 * MB and info.value.host_minimum is None
    with pytest.raises(FitError, match="host_budget >=") as info:
        decide(SIZES, Budgets(device=58 * MB, host=MB))
    # streamed from host, int8 moments (the smallest; they do not fit either)
    assert info.value.host_minimum == int(MB * (2 + 8 / 256)) + 80 * MB


def test_an_option_saving_more_than_there_is_is_an_error() -> None:
    greedy = FitOption("greedy", "all", 1.0, {"layers.0": 21 * MB}, 0)
    with pytest.raises(ValueError, match="greedy:all claims to save more"):
        SIZES.shrunk(greedy)


def test_host_reserve_is_counted_in_every_plan_and_given_to_no_part() -> None:
    """The reserve is part of every plan's host bytes and is left to no part: the blocks
    host RAM keeps and the moments' format see the budget less the reserve."""
    exact = Budgets(device=66 * MB, host=8 * MB + 40 * MB, disk=10**12)
    plan = decide(SIZES, exact)
    assert (plan.optimizer, plan.weights, plan.block_tiers.count("host")) == ("device", "disk", 2)
    reserved = Budgets(device=66 * MB, host=8 * MB + 40 * MB, disk=10**12, host_reserve=8 * MB)
    plan = decide(SIZES, reserved)
    assert plan.host_bytes <= reserved.host and plan.host_bytes >= 8 * MB
    assert plan.block_tiers.count("host") == 2  # 40 MiB of blocks still fit beside 8 reserved
    moments = Budgets(device=None, host=8 * MB, host_reserve=1)
    host_plan = next(p for p in candidates(SIZES, moments) if p.optimizer == "host")
    assert host_plan.moment_dtype == "bfloat16"  # 8 MiB of fp32 moments no longer fit
    tight = Budgets(device=66 * MB, host=40 * MB, disk=10**12, host_reserve=8 * MB)
    plan = decide(SIZES, tight)
    assert plan.block_tiers.count("host") == 1 and plan.host_bytes == 8 * MB + 20 * MB


def test_auto_host_reserve_is_an_eighth_of_an_explicit_budget_at_most_a_gib() -> None:
    from sakura_offload.fit.wrap import fit_options

    assert fit_options(host_budget=48 * MB)["host_reserve"] == 6 * MB
    assert fit_options(host_budget=64 * 2**30)["host_reserve"] == 2**30
    assert fit_options()["host_reserve"] == 0  # the default budget keeps the RAM floor free
    assert fit_options(host_budget=48 * MB, host_reserve="1MiB")["host_reserve"] == MB


@pytest.mark.parametrize("parts", [8 * MB, 40 * MB + 3, 7 * 2**30, 9 * 2**30])
def test_the_smallest_host_budget_named_leaves_the_parts_room_beside_its_own_reserve(
    parts: int,
) -> None:
    """With ``host_reserve="auto"`` a larger budget reserves more: the named minimum is the
    smallest budget whose reserve still leaves the parts' bytes (naming the plan's bytes
    would fall short by the reserve's growth)."""
    from sakura_offload.fit.decide import auto_host_reserve, smallest_host_budget

    given = 4 * MB
    budgets = Budgets(device=None, host=given, host_reserve=auto_host_reserve(given),
                      host_reserve_auto=True)  # fmt: skip
    named = smallest_host_budget(parts + budgets.host_reserve, budgets)
    assert named - auto_host_reserve(named) >= parts
    assert (named - 1) - auto_host_reserve(named - 1) < parts
    fixed = Budgets(device=None, host=given, host_reserve=MB)
    assert smallest_host_budget(parts + MB, fixed) == parts + MB


def test_a_fit_error_names_a_host_budget_that_then_fits() -> None:
    from sakura_offload.fit.decide import auto_host_reserve

    def budgets(host: int) -> Budgets:
        return Budgets(device=66 * MB, host=host, disk=None,
                       host_reserve=auto_host_reserve(host), host_reserve_auto=True)  # fmt: skip

    with pytest.raises(FitError) as info:
        decide(SIZES, budgets(40 * MB))
    named = info.value.host_minimum
    assert named is not None and named > 40 * MB
    plan = decide(SIZES, budgets(named))
    assert plan.host_bytes <= named
    with pytest.raises(FitError):
        decide(SIZES, budgets(named - 1))
