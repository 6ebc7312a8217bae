"""sakura_bench.measure's statistics and machine notes, on made-up timings (no clock)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sakura_bench import measure
from sakura_bench.measure import (
    Summary,
    cpu_description,
    cpu_flags,
    cpu_model,
    interleaved,
    load_note,
    machine_note,
    ratio_summary,
    ratios,
    rotated,
    stats,
    summary,
    versions,
)

X86_CPUINFO = """\
processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu vme sse4_2 avx avx2 fma f16c avx512f avx512bw avx512_bf16 amx_tile amx_bf16 ht

processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu vme sse4_2 avx avx2 fma f16c avx512f avx512bw avx512_bf16 amx_tile amx_bf16 ht
"""
ARM_CPUINFO = """\
processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp bf16 i8mm sve
"""


# --- summary ----------------------------------------------------------------------------------


def test_summary_median_spread_quartiles_mean() -> None:
    s = summary([0.30, 0.10, 0.50, 0.20, 0.40])
    assert s.median == pytest.approx(0.30)
    assert (s.min, s.max) == (0.10, 0.50)
    assert s.mean == pytest.approx(0.30)
    # statistics.quantiles' exclusive method: positions 1.5 and 4.5 of the sorted five
    assert s.q1 == pytest.approx(0.15)
    assert s.q3 == pytest.approx(0.45)
    assert s.n == 5
    assert s.values == (0.30, 0.10, 0.50, 0.20, 0.40)  # in the order measured


def test_summary_of_an_even_count_and_of_one_value() -> None:
    assert summary([4.0, 1.0, 3.0, 2.0]).median == 2.5
    one = summary([7.0])
    assert (one.median, one.min, one.max, one.q1, one.q3, one.mean, one.n) == (
        7.0,
        7.0,
        7.0,
        7.0,
        7.0,
        7.0,
        1,
    )


def test_summary_of_nothing_is_an_error() -> None:
    with pytest.raises(ValueError, match="at least one value"):
        summary([])


def test_summary_scaled_changes_the_unit() -> None:
    ms = summary([0.0125, 0.0100, 0.0150]).scaled(1e3)
    assert (ms.median, ms.min, ms.max) == pytest.approx((12.5, 10.0, 15.0))


def test_format_median_and_min_max() -> None:
    s = summary([0.0125, 0.0100, 0.0150])
    assert s.format(1, " ms", scale=1e3) == "12.5 ms (10.0-15.0)"
    assert summary([1.52, 1.40, 1.61]).format(2, "x") == "1.52x (1.40-1.61)"
    assert summary([2.0]).format(2, " s") == "2.00 s"  # one value: no spread


def test_format_with_the_interquartile_range() -> None:
    s = summary([1.00, 0.98, 1.02, 1.01, 0.99])
    assert s.format(4, iqr=True) == "1.0000 (IQR 0.9850-1.0150, min-max 0.9800-1.0200)"


def test_as_dict_is_json_ready() -> None:
    d = summary([3.0, 1.0, 2.0]).as_dict()
    assert d == {
        "median": 2.0,
        "min": 1.0,
        "max": 3.0,
        "q1": 1.0,
        "q3": 3.0,
        "mean": 2.0,
        "n": 3,
        "values": [3.0, 1.0, 2.0],
    }


def test_stats_keeps_the_run_reports_shape() -> None:
    assert stats([]) is None
    assert stats([3.0, 1.0, 2.0]) == {
        "median": 2.0,
        "min": 1.0,
        "max": 3.0,
        "mean": 2.0,
        "spread": 2.0,
        "n": 3,
    }


# --- ratios -----------------------------------------------------------------------------------


def test_ratios_pair_trial_by_trial() -> None:
    # trial 2 was slow on both sides (a busy machine): its ratio is still 2
    assert ratios([2.0, 4.0, 20.0], [1.0, 2.0, 10.0]) == [2.0, 2.0, 2.0]


def test_ratio_summary_is_the_median_of_the_ratios_not_the_ratio_of_the_medians() -> None:
    a, b = [1.0, 3.0, 10.0], [2.0, 1.0, 4.0]
    s = ratio_summary(a, b)
    assert s.values == (0.5, 3.0, 2.5)
    assert s.median == 2.5
    assert (s.min, s.max) == (0.5, 3.0)
    assert summary(a).median / summary(b).median == 1.5  # what it is not


def test_ratios_of_unequal_lengths_is_an_error() -> None:
    with pytest.raises(ValueError, match="3 numerators against 2 denominators"):
        ratios([1.0, 2.0, 3.0], [1.0, 2.0])


# --- interleaved ------------------------------------------------------------------------------


def test_rotated() -> None:
    assert rotated(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert rotated(["a", "b", "c"], 1) == ["b", "c", "a"]
    assert rotated(["a", "b", "c"], 5) == ["c", "a", "b"]
    assert rotated([], 3) == []


def test_interleaved_rotates_the_order_every_trial_after_the_warm_up() -> None:
    calls: list[tuple[str, int]] = []

    def contender(name: str, value: float) -> object:
        def run(trial: int) -> float:
            calls.append((name, trial))
            return value * (trial + 1)

        return run

    results = interleaved(
        {"a": contender("a", 1.0), "b": contender("b", 10.0), "c": contender("c", 100.0)},
        trials=3,
        warmup=1,
    )
    assert calls == [
        ("a", -1),
        ("b", -1),
        ("c", -1),  # warm-up, results dropped
        ("a", 0),
        ("b", 0),
        ("c", 0),
        ("b", 1),
        ("c", 1),
        ("a", 1),
        ("c", 2),
        ("a", 2),
        ("b", 2),
    ]
    assert results == {"a": [1.0, 2.0, 3.0], "b": [10.0, 20.0, 30.0], "c": [100.0, 200.0, 300.0]}
    assert list(results) == ["a", "b", "c"]  # the contenders' order, whoever ran first


def test_interleaved_two_contenders_alternate_who_goes_first() -> None:
    order: list[str] = []
    interleaved({"A": lambda t: order.append("A"), "B": lambda t: order.append("B")}, trials=4)
    assert "".join(order) == "ABBAABBA"


def test_interleaved_reports_each_trial() -> None:
    seen: list[tuple[int, dict[str, float]]] = []
    interleaved(
        {"x": lambda t: float(t), "y": lambda t: 2.0 * t},
        trials=2,
        on_trial=lambda i, r: seen.append((i, r)),
    )
    assert seen == [(0, {"x": 0.0, "y": 0.0}), (1, {"x": 1.0, "y": 2.0})]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"trials": 0}, "trials must be >= 1, got 0"),
        ({"trials": 2, "warmup": -1}, "warmup must be >= 0, got -1"),
    ],
)
def test_interleaved_rejects_bad_counts(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        interleaved({"a": lambda t: t}, **kwargs)


def test_interleaved_needs_a_contender() -> None:
    with pytest.raises(ValueError, match="at least one contender"):
        interleaved({}, trials=1)


# --- the machine ------------------------------------------------------------------------------


def test_cpu_model_and_flags_from_x86_cpuinfo() -> None:
    assert cpu_model(X86_CPUINFO) == "Intel(R) Xeon(R) Platinum 8480+"
    assert cpu_flags(X86_CPUINFO) == (
        "sse4_2",
        "avx",
        "f16c",
        "fma",
        "avx2",
        "avx512f",
        "avx512bw",
        "avx512_bf16",
        "amx_tile",
        "amx_bf16",
    )


def test_cpu_flags_from_arm_cpuinfo() -> None:
    assert cpu_flags(ARM_CPUINFO) == ("asimd", "asimdhp", "bf16", "i8mm", "sve")


def test_cpu_description_names_model_cpus_and_flags() -> None:
    text = cpu_description(X86_CPUINFO)
    assert text.startswith("Intel(R) Xeon(R) Platinum 8480+, ")
    assert " CPUs usable; flags sse4_2 avx f16c fma avx2 avx512f " in text
    assert cpu_description("").endswith("; flags unknown")


def test_load_note_formats_the_three_averages() -> None:
    assert load_note((1.5, 1.234, 0.0)) == "1.50 1.23 0.00"


def test_load_note_without_a_load_average(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(measure, "load_average", lambda: None)
    assert load_note() == "n/a"
    assert machine_note().endswith("; load average n/a")


def test_machine_note_with_the_load_before(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(measure, "load_average", lambda: (2.0, 1.0, 0.5))
    monkeypatch.setattr(measure, "cpu_description", lambda: "Some CPU, 2 CPUs usable; flags avx2")
    assert machine_note((0.25, 0.5, 0.75)) == (
        "CPU: Some CPU, 2 CPUs usable; flags avx2; "
        "load average 0.25 0.50 0.75 before, 2.00 1.00 0.50 after"
    )


def test_versions() -> None:
    found = versions(["pytest", "no-such-distribution-sakura"])
    assert found["pytest"] == pytest.__version__
    assert found["no-such-distribution-sakura"] is None


def test_the_statistics_do_not_import_torch() -> None:
    code = (
        "import sys\n"
        "from sakura_bench.measure import summary, interleaved, machine_note\n"
        "machine_note(); summary([1.0])\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "False"


def test_summary_is_frozen() -> None:
    s = summary([1.0])
    assert isinstance(s, Summary)
    with pytest.raises(AttributeError):
        s.median = 2.0  # type: ignore[misc]
