"""The models on this machine, found without the network: the Hugging Face cache, our own models folder, the GGUF
files of Ollama's and LM Studio's standard folders (read in place, never copied), and the bundled default model.

Users of Ollama and LM Studio already hold GGUF files; `hivekeeper models list` shows them next to ours, each with
its size, format, quantization and whether the planner finds it fits here, so any of them can be passed to
`--model` by its path. `models rm` deletes a model from our folder or the HF cache only: the other apps' folders
are theirs (we refuse, and say which command of theirs removes it).

Folders (each overridable, so tests and unusual setups point them elsewhere):
- HF cache: HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub (planner.model_catalog.hf_cache_dir);
  one row per `models--ORG--NAME` repo, or per GGUF file when a repo holds several.
- ours: HIVEKEEPER_MODELS_DIR, else default_data_dir()/models: GGUF files, checkpoint folders (config.json) and
  folders holding one GGUF.
- Ollama: OLLAMA_MODELS (Ollama's own variable), else ~/.ollama/models: manifests/HOST/NAMESPACE/NAME/TAG (JSON),
  whose `application/vnd.ollama.image.model` layer is blobs/sha256-DIGEST, a GGUF file.
- LM Studio: HIVEKEEPER_LMSTUDIO_DIRS (folders separated by os.pathsep), else ~/.lmstudio/models and
  ~/.cache/lm-studio/models: PUBLISHER/REPO/FILE.gguf.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from hivekeeper.planner.errors import InputError

MODELS_DIR_ENV = "HIVEKEEPER_MODELS_DIR"
OLLAMA_DIR_ENV = "OLLAMA_MODELS"
LMSTUDIO_DIRS_ENV = "HIVEKEEPER_LMSTUDIO_DIRS"
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
OLLAMA_DEFAULT_HOST = "registry.ollama.ai"
OLLAMA_PREFIX = "ollama:"
LMSTUDIO_PREFIX = "lmstudio:"
HF_REPO_PREFIX = "models--"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
# sources: where a model lives, and whether `models rm` may delete it
SOURCES = {"hf-cache": "the Hugging Face cache", "hivekeeper": "Hivekeeper's models folder",
           "ollama": "Ollama's models folder", "lmstudio": "LM Studio's models folder",
           "bundled": "the bundled default model (a Python package)"}
REMOVABLE = ("hf-cache", "hivekeeper")


@dataclass
class LibraryModel:
    """One model on this machine. `path` is what `--model` takes; `root` is the folder rm deletes (removable
    sources only). quantization: a GGUF's main tensor type, or a checkpoint's dtype/quantization method."""

    id: str
    source: str
    path: str
    size_bytes: int
    format: str  # "gguf", "safetensors", "pytorch", "unknown"
    quantization: str
    root: str = ""
    repo: str = ""  # the HF cache's repository id (rm deletes a repository whole)
    fit: str = ""  # planner.policy.fit_words ("fits here", "needs the swarm", "runs here, N% streamed from disk", ...)
    fit_reason: str = ""

    @property
    def removable(self) -> bool:
        return self.source in REMOVABLE

    def as_dict(self) -> dict:
        return {**asdict(self), "removable": self.removable}


def human_bytes(size: int) -> str:
    """'12.4 MB': sizes as `models list` and the app's Models page show them."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"


# ---- folders -------------------------------------------------------------------------------------------------------
def our_models_dir() -> Path:
    from hivekeeper.core.machine.detect import default_data_dir

    return Path(os.environ.get(MODELS_DIR_ENV) or default_data_dir() / "models").expanduser()


def ollama_dir() -> Path:
    return Path(os.environ.get(OLLAMA_DIR_ENV) or "~/.ollama/models").expanduser()


def lmstudio_dirs() -> list[Path]:
    value = os.environ.get(LMSTUDIO_DIRS_ENV)
    folders = value.split(os.pathsep) if value else ["~/.lmstudio/models", "~/.cache/lm-studio/models"]
    return [Path(f).expanduser() for f in folders if f]


# ---- scanning ------------------------------------------------------------------------------------------------------
def scan_library() -> list[LibraryModel]:
    """Every model found, in source order (bundled, ours, HF cache, Ollama, LM Studio), without fit."""
    return bundled_models() + our_models() + hf_cache_models() + ollama_models() + lmstudio_models()


def bundled_models() -> list[LibraryModel]:
    from hivekeeper.core.runtime.default_model import DEFAULT_MODEL_ID, default_model_file

    path = default_model_file()
    return [] if path is None else [gguf_model(DEFAULT_MODEL_ID, "bundled", path)]


def our_models() -> list[LibraryModel]:
    folder = our_models_dir()
    found = []
    for entry in sorted(children(folder)):
        if entry.is_file() and entry.suffix.lower() == ".gguf":
            found.append(gguf_model(entry.name, "hivekeeper", entry, root=entry))
        elif entry.is_dir():
            found.extend(folder_models(entry.name, "hivekeeper", entry, root=entry))
    return found


def hf_cache_models() -> list[LibraryModel]:
    from hivekeeper.planner.model_catalog import hf_cache_dir

    found = []
    for repo in sorted(children(hf_cache_dir())):
        if repo.is_dir() and repo.name.startswith(HF_REPO_PREFIX):
            repo_id = repo.name[len(HF_REPO_PREFIX):].replace("--", "/")
            snapshot = latest_snapshot(repo)
            if snapshot is not None:
                rows = folder_models(repo_id, "hf-cache", snapshot, root=repo, size=tree_bytes(repo))
                for row in rows:
                    row.repo = repo_id
                found.extend(rows)
    return found


def latest_snapshot(repo: Path) -> Path | None:
    """The snapshot refs/main names, else the newest one."""
    snapshots = repo / "snapshots"
    try:
        main = (repo / "refs" / "main").read_text().strip()
    except OSError:
        main = ""
    if main and (snapshots / main).is_dir():
        return snapshots / main
    candidates = sorted((s for s in children(snapshots) if s.is_dir()), key=lambda s: s.stat().st_mtime)
    return candidates[-1] if candidates else None


def ollama_models() -> list[LibraryModel]:
    root = ollama_dir()
    found = []
    for manifest in sorted(p for p in (root / "manifests").rglob("*") if p.is_file()):
        parts = manifest.relative_to(root / "manifests").parts
        blob = ollama_blob(root, manifest)
        if len(parts) == 4 and blob is not None:
            found.append(gguf_model(OLLAMA_PREFIX + ollama_name(parts), "ollama", blob))
    return found


def ollama_name(parts: tuple[str, ...]) -> str:
    """HOST/NAMESPACE/NAME/TAG as Ollama writes it: NAME:TAG for its own library, HOST/NAMESPACE/NAME:TAG else."""
    host, namespace, name, tag = parts
    if host == OLLAMA_DEFAULT_HOST:
        return f"{name}:{tag}" if namespace == "library" else f"{namespace}/{name}:{tag}"
    return f"{host}/{namespace}/{name}:{tag}"


def ollama_blob(root: Path, manifest: Path) -> Path | None:
    """The model layer's blob of a manifest, when the manifest is readable and the blob is there."""
    try:
        layers = json.loads(manifest.read_text(encoding="utf-8")).get("layers", [])
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return None
    for layer in layers if isinstance(layers, list) else []:
        if isinstance(layer, dict) and layer.get("mediaType") == OLLAMA_MODEL_LAYER:
            blob = root / "blobs" / str(layer.get("digest", "")).replace(":", "-")
            return blob if blob.is_file() else None
    return None


def lmstudio_models() -> list[LibraryModel]:
    found = []
    for folder in lmstudio_dirs():
        for file in sorted(folder.rglob("*.gguf")) if folder.is_dir() else []:
            found.append(gguf_model(LMSTUDIO_PREFIX + file.relative_to(folder).as_posix(), "lmstudio", file))
    return found


def children(folder: Path) -> list[Path]:
    try:
        return list(folder.iterdir())
    except OSError:
        return []


def tree_bytes(path: Path) -> int:
    """Bytes of the files under `path` (links not followed: an HF snapshot's links point into its blobs)."""
    if path.is_file():
        return path.stat().st_size
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            file = Path(dirpath) / name
            if not file.is_symlink():
                total += file.stat().st_size
    return total


# ---- one model's format ----------------------------------------------------------------------------------------
# what a file's metadata says, by (path, mtime, size): the gguf package parses a whole GGUF's metadata to read any
# of it (seconds for a large vocabulary), and a listing is asked for again and again (the app, the tests)
FILE_FACTS: dict[tuple[str, str, int, int], object] = {}


def file_fact(path: Path, what: str, read):
    """read(path), remembered for this version of the file."""
    stat = path.stat()
    key = (what, str(path.resolve()), stat.st_mtime_ns, stat.st_size)
    if key not in FILE_FACTS:
        FILE_FACTS[key] = read(path)
    return FILE_FACTS[key]


def gguf_quantization(path: Path) -> str:
    """A GGUF's main tensor type ("?" when the file cannot be read)."""
    from hivekeeper.planner.gguf_metadata import gguf_sizes

    try:
        return gguf_sizes(path).main_type
    except InputError:
        return "?"


def gguf_model(model_id: str, source: str, path: Path, *, root: Path | None = None,
               size: int | None = None) -> LibraryModel:
    """A GGUF file's row, with its main tensor type as the quantization."""
    return LibraryModel(model_id, source, str(path), path.stat().st_size if size is None else size, "gguf",
                        file_fact(path, "quantization", gguf_quantization), root=str(root or ""))


def folder_models(model_id: str, source: str, folder: Path, *, root: Path,
                  size: int | None = None) -> list[LibraryModel]:
    """A folder's rows: a checkpoint (config.json and weights) is one; each GGUF file in it is one (named
    MODEL_ID/FILE when there are several)."""
    size = tree_bytes(root) if size is None else size
    ggufs = sorted(folder.glob("*.gguf"))
    if (folder / "config.json").is_file() and not ggufs:
        return [checkpoint_model(model_id, source, folder, root, size)]
    if len(ggufs) == 1:
        return [gguf_model(model_id, source, ggufs[0], root=root, size=size)]
    return [gguf_model(f"{model_id}/{g.name}", source, g, root=root if source == "hf-cache" else g,
                       size=g.stat().st_size) for g in ggufs]


def checkpoint_model(model_id: str, source: str, folder: Path, root: Path, size: int) -> LibraryModel:
    names = [p.name for p in children(folder)]
    if any(n.endswith(".safetensors") for n in names):
        fmt = "safetensors"
    elif any(n.endswith(WEIGHT_SUFFIXES) for n in names):
        fmt = "pytorch"
    else:
        fmt = "config only"
    return LibraryModel(model_id, source, str(folder), size, fmt, checkpoint_quantization(folder / "config.json"),
                        root=str(root))


def checkpoint_quantization(config_path: Path) -> str:
    """A checkpoint's quantization method (config.json quantization_config), else its torch_dtype."""
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return "?"
    quant = config.get("quantization_config") if isinstance(config, dict) else None
    if isinstance(quant, dict) and quant.get("quant_method"):
        return str(quant["quant_method"])
    return str(config.get("torch_dtype") or "?") if isinstance(config, dict) else "?"


# ---- fit ---------------------------------------------------------------------------------------------------------
def this_machine_for_fits():
    """(HardwareSpec, MachineEfficiency or None): this machine as `plan --hardware auto` plans for it, its saved
    profile's measured numbers and factors in place where `hivekeeper measure` ran (profiles.detect_or_load_profile),
    estimates where it never did; a listing does not measure first."""
    from hivekeeper.core.machine.profiles import detect_or_load_profile

    return detect_or_load_profile()


def add_fits(models: list[LibraryModel], hardware=None, efficiency=None) -> None:
    """Each model's fit (a chat with the default headroom, as the app's model fits), in place: on `hardware` with
    `efficiency`, or on this machine as `plan` sees it (this_machine_for_fits) when `hardware` is None."""
    if hardware is None:
        hardware, efficiency = this_machine_for_fits()
    for model in models:
        model.fit, model.fit_reason = model_fit(model.path, hardware, efficiency)


def model_fit(path: str, hardware, efficiency=None) -> tuple[str, str]:
    """(fit words, the planner's reason); ("?", why) when the planner cannot read the model. Planned in the format
    `generate` runs it in (format_choice.plan_constraints): a GGUF's own Q8_0/Q4_0/Q4_1 weights packed on a CPU, as
    many bytes as the file holds them in, not dequantized to fp32; `efficiency`: the machine's cost-model factors
    (None: the defaults)."""
    from hivekeeper.planner import policy as planner_policy
    from hivekeeper.planner.format_choice import plan_constraints
    from hivekeeper.planner.hardware import default_headroom
    from hivekeeper.planner.model_catalog import load_model_spec

    try:
        file = Path(path)
        spec = file_fact(file, "spec", lambda p: load_model_spec(str(p))) if file.is_file() else \
            load_model_spec(path)
        constraints, _ = plan_constraints(path, "auto", hardware, "chat", reserve_bytes=default_headroom(hardware))
        plan = planner_policy.search(spec, hardware, "chat", constraints, efficiency=efficiency)
    except InputError as exc:
        return "?", str(exc)
    return planner_policy.fit_words(plan), plan.reason


# ---- removing ------------------------------------------------------------------------------------------------------
def find_model(models: list[LibraryModel], model_id: str) -> LibraryModel:
    """The model named `model_id`, or an HF cache repository whose GGUF files are listed one by one (InputError
    when there is none)."""
    for model in models:
        if model.id == model_id:
            return model
    files = [m for m in models if m.source == "hf-cache" and m.repo == model_id]
    if files:
        return LibraryModel(model_id, "hf-cache", str(Path(files[0].path).parent), tree_bytes(Path(files[0].root)),
                            "gguf", ", ".join(sorted({m.quantization for m in files})), root=files[0].root,
                            repo=model_id)
    raise InputError(f"no model {model_id!r} on this machine (`hivekeeper models list` shows their ids)")


def remove_model(model: LibraryModel) -> int:
    """Delete a model of our folder or the HF cache; the bytes freed. Another app's model (or the bundled one) is an
    InputError saying whose it is and how to remove it there. The folder is first renamed aside (one atomic step,
    so a half-deleted model is never listed), then deleted."""
    if not model.removable:
        raise InputError(refusal(model))
    if model.source == "hf-cache" and model.id != model.repo:
        raise InputError(f"{model.id} is one GGUF file of the repository {model.repo} in the Hugging Face cache, "
                         f"whose files share its folder: `hivekeeper models rm {model.repo}` deletes the repository")
    root = Path(model.root)
    if not root.exists():
        raise InputError(f"{model.id}: {root} no longer exists")
    freed = tree_bytes(root)
    aside = root.with_name(f".deleting-{uuid.uuid4().hex[:8]}-{root.name}")
    root.rename(aside)
    if aside.is_dir():
        shutil.rmtree(aside)
    else:
        aside.unlink()
    if model.source == "hf-cache":
        shutil.rmtree(root.parent / ".locks" / root.name, ignore_errors=True)
    return freed


def refusal(model: LibraryModel) -> str:
    where = SOURCES[model.source]
    if model.source == "ollama":
        how = f"remove it with `ollama rm {model.id[len(OLLAMA_PREFIX):]}`"
    elif model.source == "lmstudio":
        how = "remove it from LM Studio (My Models)"
    else:
        from hivekeeper.core.runtime.default_model import REQUIREMENT

        how = f"uninstall it with `pip uninstall {REQUIREMENT.split('==')[0]}`"
    return (f"{model.id} is in {where} ({model.path}): Hivekeeper reads it in place and never deletes it; {how}")
