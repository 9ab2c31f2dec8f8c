"""What this machine's CPU computes a 16-bit (bf16/fp16) plan in: the one decision the engine follows, by the rule
of core/machine/cpu_dtype_rule.py (flags, then the saved `hivekeeper measure` bf16-vs-fp32 decode step).

`local_plan.compute_dtype` (with the plan's decode rows) and the engine's `cpu_attention_dtype` (at any rows) ask
`runs_natively_on_cpu`; `hivekeeper detect`
prints `sixteen_bit_choice().line()`; the planner sees the same decision in the CPU's FLOP/s table, which
detect_hardware and profiles.apply_measurements set with cpu_dtype_rule.with_choice.

The engine asks for every block of every step, so this machine's profile file is found by one detection per config
folder, and read again only when the file changes (a profile saved by `hivekeeper measure` or the app counts at the
next step, in this process too).
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

from hivekeeper.core.machine.cpu_dtype_rule import SixteenBitChoice, choose, choose_from_profile
from hivekeeper.core.machine.cpu_features import FLAGS_ENV, has_half_math
from hivekeeper.core.machine.detect import detect_hardware
from hivekeeper.core.machine.profile_files import config_dir, machine_fingerprint, profile_path

DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}


@lru_cache(maxsize=8)
def this_machines_profile(folder: str) -> Path:
    """Where this machine's profile is (or would be) in the config `folder`: one detection per folder."""
    return profile_path(machine_fingerprint(detect_hardware()))


@lru_cache(maxsize=16)
def choice_from_file(path: Path, stamp: tuple | None, flags: str | None) -> SixteenBitChoice:
    """choose_from_profile, once per version of the file (`stamp`: its modification time, inode and size; None: no
    file) and pinned flags (the arguments past `path` are only the cache's key)."""
    return choose_from_profile(path)


def sixteen_bit_choice() -> SixteenBitChoice:
    """This machine's decision (its profile looked up only with native bf16 math, where it can change the answer)."""
    if not has_half_math():
        return choose()
    path = this_machines_profile(str(config_dir()))
    try:
        found = path.stat()
        stamp = (found.st_mtime_ns, found.st_ino, found.st_size)
    except OSError:
        stamp = None
    return choice_from_file(path, stamp, os.environ.get(FLAGS_ENV))


def forget() -> None:
    """Detect and read again at the next call (tests that pin other flags)."""
    this_machines_profile.cache_clear()
    choice_from_file.cache_clear()


def dtype_name(dtype) -> str:
    """'bf16', 'fp16' or 'fp32' for a torch dtype or a name ('bfloat16', 'torch.float16', 'bf16', ...)."""
    name = str(dtype).removeprefix("torch.")
    return DTYPE_NAMES.get(name, name)


def runs_natively_on_cpu(dtype, rows: int | None = None, planned_rows: int | None = None) -> bool:
    """Whether this CPU computes in `dtype` itself, else in fp32: fp32 always; bf16 for a plan whose decode
    micro-batches multiply `rows` rows, made for micro-batches of `planned_rows` (None: no plan), where the rule says
    so (SixteenBitChoice.at); `rows` None: at any rows, i.e. whether the CPU multiplies `dtype` natively at all (its
    attention over a bf16 cache, the kernels to warm up)."""
    name = dtype_name(dtype)
    if name == "fp32":
        return True
    choice = sixteen_bit_choice()
    if rows is None:
        return name == "bf16" and choice.native
    return name == choice.at(rows, planned_rows)
