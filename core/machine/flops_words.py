"""What each dtype's FLOP/s figure of a device is, in words: the Hardware page's compute rows and the catalog side of
its measured-beside-catalog rows (profiles.comparison_rows) both say it.

A device keeps one source for its whole FLOP/s table (ComputeDevice.sources["flops"]), and that text reads as the
fp32 figure's: an estimate's "cores x clock x FLOP/cycle" is the fp32 peak, a measurement lists fp32 first, and a
CPU's 16-bit decision is appended to it (cpu_dtype_rule.with_choice). Shown as it is beside a bf16 figure, it
describes a number the row does not show (the bf16 estimate is 2x it on AVX512-BF16; a bf16 entry raised to the
fp32 rate is fp32's). `flops_source` says what the row's own number is, and keeps the 16-bit decision for the 16-bit
rows.
"""

from __future__ import annotations

import re

from hivekeeper.planner.hardware_catalog import CPU_SOFTWARE_HALF_SLOWDOWN, SOURCE_LABELS

from hivekeeper.core.machine.cpu_dtype_rule import BF16_AT_FP32_WORDS, CHOICE_WORDS, SIXTEEN_BIT

ESTIMATED_PEAK = ("estimated: a theoretical peak (cores x clock x operations per cycle of the CPU's instructions), "
                  "not a rate any matmul was seen to reach; Measure replaces it")


def split_source(source: str) -> tuple[str, str]:
    """(kind, detail) of a source: "catalog:T4 datasheet" -> ("catalog", "T4 datasheet"),
    "measured 2025-01-02 10.00: RAM read, best of 5" -> ("measured", "2025-01-02 10.00: RAM read, best of 5")."""
    match = re.match(r"\s*([A-Za-z]+)\s*:?\s*(.*)", source or "")
    if not match:
        return "unknown", ""
    kind, detail = match.group(1).lower(), match.group(2).strip()
    if kind not in SOURCE_LABELS:  # a catalog entry names its reference directly
        return "catalog", source.strip()
    return kind, detail


def flops_source(dtype: str, flops: dict[str, float], source: str) -> str:
    """Where one dtype's figure of a FLOP/s table (`flops`, whose one source is `source`) comes from, in words that
    say what kind of number it is; the CPU's 16-bit decision goes with the 16-bit rows only."""
    base, _, choice = source.partition(f"; {CHOICE_WORDS}")
    choice = f"{CHOICE_WORDS}{choice}" if choice else ""
    fp32, value = flops.get("fp32", 0.0), flops.get(dtype, 0.0)
    if dtype in SIXTEEN_BIT and fp32 > 0 and abs(value * CPU_SOFTWARE_HALF_SLOWDOWN - fp32) < 1e-3 * fp32:
        # (a spec read back from JSON holds 6 digits: 1e-3 tells the 1/7 apart)
        return (f"derived: 1/{CPU_SOFTWARE_HALF_SLOWDOWN:g} of the fp32 rate, what the planner charges {dtype} "
                f"matmuls where 16-bit plans compute in fp32, not a rate of the {dtype} instructions"
                f"{f' ({choice})' if choice else ''}; the fp32 rate: {base}")
    if dtype == "bf16" and BF16_AT_FP32_WORDS in choice and value == fp32:
        return f"derived: {raised_words(choice)} ({choice.split(f'; {BF16_AT_FP32_WORDS}')[0]}); the fp32 rate: {base}"
    words = own_words(dtype, value, fp32, base)
    return f"{words}; {choice}" if choice and dtype in SIXTEEN_BIT else words


def raised_words(choice: str) -> str:
    """The note with_choice appends where it raised a native CPU's bf16 entry to the fp32 rate."""
    return BF16_AT_FP32_WORDS + choice.split(BF16_AT_FP32_WORDS, 1)[1]


def own_words(dtype: str, value: float, fp32: float, base: str) -> str:
    """A figure that is its dtype's own: a theoretical peak (as a multiple of fp32's), a spec sheet's, measured."""
    kind, detail = split_source(base)
    if kind == "estimated" and dtype != "fp32" and fp32 > 0 and value > 0:
        return f"{ESTIMATED_PEAK}: {value / fp32:.3g}x the fp32 peak ({detail}) for its {dtype} instructions"
    if kind == "estimated":
        return f"{ESTIMATED_PEAK} ({detail})"
    if kind == "catalog":
        return f"catalog: the spec sheet's peak ({detail})"
    return base
