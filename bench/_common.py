"""What the benchmarks share (not a benchmark itself): demo checkpoints written once into the data folder, and a
fixed prompt of token ids."""

from __future__ import annotations

from pathlib import Path


def demo_checkpoint(name: str, shape: dict) -> Path:
    """A demo checkpoint of `shape` (demo_model.DemoSpec fields), written once into <data dir>/bench-models/<name>
    and reused. torch is imported only here, so a bench's parent process can stay light until it needs one."""
    from hivekeeper.core.runtime.demo_model import DemoSpec, write_demo_checkpoint
    from hivekeeper.core.machine.detect import default_data_dir

    path = default_data_dir() / "bench-models" / name
    if not (path / "config.json").is_file():
        write_demo_checkpoint(path, DemoSpec(**shape), overwrite=True)
    return path


def demo_preset(preset: str) -> Path:
    """The checkpoint of a demo_model.PRESETS entry ("100m", "1b")."""
    from hivekeeper.core.runtime.demo_model import PRESETS

    return demo_checkpoint(preset, PRESETS[preset])


def fixed_prompt(vocab_size: int, tokens: int) -> list[int]:
    """BOS then a deterministic spread of ordinary token ids: the same prompt for every run and implementation."""
    return [1] + [(7 * i) % (vocab_size - 10) + 10 for i in range(tokens - 1)]
