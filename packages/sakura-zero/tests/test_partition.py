"""The size-balanced partition (pure Python, no process group)."""

from __future__ import annotations

import pytest

from sakura_zero import Partition, balanced_partition, contiguous_partition


def test_largest_first_to_least_loaded_rank() -> None:
    part = balanced_partition([10, 40, 30, 20], 2)
    # 40 -> r0, 30 -> r1, 20 -> r1 (30 < 40), 10 -> r0 (40 < 50)
    assert part.owners == (0, 0, 1, 1)
    assert part.loads == (50, 50)
    assert part.imbalance == 0.0
    assert part.owned(0) == [i for i, o in enumerate(part.owners) if o == 0]


def test_deterministic_and_tie_broken_by_index() -> None:
    sizes = [8] * 6
    a = balanced_partition(sizes, 3)
    assert a == balanced_partition(list(sizes), 3)
    assert a.owners == (0, 1, 2, 0, 1, 2)


def test_imbalance_reports_the_excess_of_the_largest_rank() -> None:
    part = balanced_partition([100, 1, 1], 2)
    assert part.loads == (100, 2)
    assert part.imbalance == pytest.approx(100 / 51 - 1)
    assert balanced_partition([], 4).imbalance == 0.0
    assert balanced_partition([0, 0], 2).imbalance == 0.0


def test_world_of_one_owns_everything() -> None:
    part = balanced_partition([3, 5, 7], 1)
    assert part.owners == (0, 0, 0) and part.loads == (15,) and part.world_size == 1


def test_extended_keeps_existing_owners() -> None:
    part = balanced_partition([40, 10], 2)
    more = part.extended([30, 5])
    assert more.owners[:2] == part.owners
    assert more.owners == (0, 1, 1, 0) and more.loads == (45, 40)
    assert isinstance(more, Partition) and more.total == 85


@pytest.mark.parametrize(
    ("sizes", "world", "message"),
    [
        ([1], 0, "world_size must be an int >= 1, got 0"),
        ([1], True, "world_size must be an int >= 1, got True"),
        ([1, -2], 2, r"sizes\[1\] must be an int >= 0 \(bytes\), got -2"),
        ([1.5], 2, r"sizes\[0\] must be an int >= 0 \(bytes\), got 1.5"),
    ],
)
def test_bad_input(sizes: list, world: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        balanced_partition(sizes, world)


def test_contiguous_runs_in_order() -> None:
    assert contiguous_partition([10, 40, 30, 20], 2) == Partition((0, 0, 1, 1), (50, 50))
    assert contiguous_partition([8] * 6, 3).owners == (0, 0, 1, 1, 2, 2)
    part = contiguous_partition([5] * 7, 2)
    assert part.owners == (0, 0, 0, 0, 1, 1, 1) and part.imbalance == pytest.approx(40 / 35 - 1)
    # one tensor larger than a share: a rank may own nothing, never a slice
    assert contiguous_partition([100, 1, 1], 3).owners == (1, 2, 2)
    assert contiguous_partition([], 3).loads == (0, 0, 0)
    with pytest.raises(ValueError, match="world_size must be an int >= 1"):
        contiguous_partition([1], 0)
