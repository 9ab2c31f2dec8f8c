"""Models on the Hugging Face hub: finding ones Hivekeeper runs (`models search`) and downloading one (`models pull`).

Search asks the hub through huggingface_hub's HfApi.list_models, once per weight format we read (filter `gguf`,
then `safetensors`), and keeps the repos whose architecture the runtime runs (core/runtime/model.py's families,
planner/gguf_metadata.py's GGUF architectures). The hub gives a parameter count, not a file size, so the size shown
is an estimate: the parameters times their stored width for safetensors, times 4.5 bits (a 4-bit file such as
Q4_0) for a GGUF repo. "Fits here" compares that size with this machine's memory and disk, less the default
headroom (planner/hardware.py) — a rough first answer; `hivekeeper plan` gives the real one after the pull.

Pull downloads into our models folder (library.our_models_dir: HIVEKEEPER_MODELS_DIR, else the data folder's
models/), as ORG--NAME/ holding the repo's files under their own names, not into the Hugging Face cache: since
huggingface_hub 2.x, `hf_hub_download` writes each download to a temporary file unique to its process and deletes
it on failure, so a pull killed mid-file (or a closed laptop) would start that file again from zero. Here each file
is appended to `.NAME.partial` by huggingface_hub's own `http_get` (its progress bar on stderr, its retries, a
Range request from where the partial file ends), checked against the hub's sha256, then renamed into place; a
checkpoint's config.json comes last, so a folder is a checkpoint only once complete. `models list` shows a pulled
model (source hivekeeper), `--model PATH` runs it, `models rm` deletes it. `--model ORG/NAME` still goes through
`resolve_checkpoint` and the HF cache, which fetches only the shards a block range needs.
Before the first byte the file sizes come from the hub's model info (one request) and are checked against the free
space of the models folder's filesystem; HIVEKEEPER_DISK_FREE_BYTES caps the free space assumed (for keeping room,
and for tests, which cannot fill a real disk).

The hub is never asked with HF_HUB_OFFLINE set: that is one line, as is any hub error (InputError, exit 2).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hivekeeper.planner.errors import InputError

FORMATS = ("gguf", "safetensors")
FREE_DISK_ENV = "HIVEKEEPER_DISK_FREE_BYTES"
DISK_MARGIN_BYTES = 64 << 20  # kept free besides the files: the cache's metadata, other programs' small writes
GGUF_BITS_ESTIMATE = 4.5  # a GGUF repo's size is estimated as a 4-bit file's (Q4_0: 4.5 bits per weight)
# bytes per parameter of the dtypes the hub counts in `safetensors.parameters`
DTYPE_BYTES = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "F16": 2, "BF16": 2, "I16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
               "I8": 1, "U8": 1, "BOOL": 1}
SEARCH_EXPAND = ["config", "gguf", "safetensors", "tags", "downloads"]
INFO_TIMEOUT_S = 15.0
MODELS_DIR_HINT = "HIVEKEEPER_MODELS_DIR chooses another folder"


@dataclass
class HubModel:
    """One search result: a hub repo in a format and architecture we run, its parameter count, estimated size and
    whether that size fits this machine."""

    id: str
    format: str  # "gguf" or "safetensors"
    architecture: str
    parameters: int
    size_bytes: int  # estimated (module doc)
    downloads: int
    fit: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class PullPlan:
    """What a pull fetches: the repo's commit, the files with their sizes, and the bytes still to download."""

    repo_id: str
    commit: str
    files: dict[str, int]  # name -> size, in download order
    gguf_file: str | None  # the one GGUF file pulled, or None for a safetensors checkpoint
    missing_bytes: int
    sha256: dict[str, str] = field(default_factory=dict)  # the hub's sha256 of each LFS file


# ---- the hub, or why not -------------------------------------------------------------------------------------------
def check_online(timeout: float = 5.0) -> None:
    """InputError when huggingface_hub may not ask the hub (HF_HUB_OFFLINE) or the hub does not answer one request
    (any HTTP status is an answer). One request without retries: huggingface_hub retries a refused connection for
    ~25 s, printing a line each time, which suits a blip mid-download, not a machine that is offline."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    if constants.HF_HUB_OFFLINE:
        raise InputError(f"the Hugging Face hub is not asked while HF_HUB_OFFLINE is set; unset it (the hub is "
                         f"{constants.ENDPOINT}, HF_ENDPOINT changes it)")
    try:
        get_session().head(constants.ENDPOINT, timeout=timeout)
    except Exception as exc:  # refused, DNS, timeout, TLS
        raise InputError(f"the Hugging Face hub at {constants.ENDPOINT} cannot be reached ({first_line(exc)}); "
                         f"check the connection, or HF_ENDPOINT") from None


def hub_failure(what: str, exc: BaseException) -> InputError:
    """One line for a failed hub request: what was asked, and the error's first line."""
    from huggingface_hub import constants

    return InputError(f"{what} failed at the hub {constants.ENDPOINT} ({first_line(exc)})")


def first_line(exc: BaseException) -> str:
    """`Type: first line of the message` (huggingface_hub's messages run over several lines)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


# ---- search --------------------------------------------------------------------------------------------------------
def runnable_architectures() -> tuple[str, ...]:
    """The GGUF architectures the runtime reads, and the HF model types they map to (the same names as
    core/runtime/model.py's SUPPORTED_FAMILIES, which would import torch)."""
    from hivekeeper.planner.gguf_metadata import ARCHITECTURES

    return tuple(sorted(set(ARCHITECTURES) | set(ARCHITECTURES.values())))


def search_hub(text: str, limit: int = 20) -> list[HubModel]:
    """Hub repos matching `text` in a format and an architecture we run, most downloaded first (at most `limit`)."""
    from huggingface_hub import HfApi

    check_online()
    if limit < 1:
        raise InputError(f"--limit {limit}: must be at least 1")
    found: dict[str, HubModel] = {}
    for fmt in FORMATS:
        try:
            infos = list(HfApi().list_models(search=text, filter=fmt, sort="downloads", limit=limit,
                                             expand=SEARCH_EXPAND))
        except Exception as exc:  # refused, DNS, HTTP errors: all one line
            raise hub_failure(f"searching {text!r}", exc) from None
        for info in infos:
            model = hub_model(info, fmt)
            if model is not None and model.id not in found:
                found[model.id] = model
    return sorted(found.values(), key=lambda m: -m.downloads)[:limit]


def hub_model(info, fmt: str) -> HubModel | None:
    """A search row from the hub's ModelInfo, or None when its architecture is not one we run."""
    if fmt == "gguf":
        summary = info.gguf or {}
        arch = str(summary.get("architecture") or "")
        params = int(summary.get("total") or 0)
        size = int(params * GGUF_BITS_ESTIMATE / 8)
    else:
        arch = str((info.config or {}).get("model_type") or "")
        counts = info.safetensors.parameters if info.safetensors else {}
        params = int(sum(counts.values()))
        size = int(sum(n * DTYPE_BYTES.get(dtype, 2) for dtype, n in counts.items()))
    if arch not in runnable_architectures():
        return None
    return HubModel(info.id, fmt, arch, params, size, int(info.downloads or 0))


def add_size_fits(models: list[HubModel], hardware=None) -> None:
    """Each result's fit by its estimated size, in place (module doc)."""
    from hivekeeper.core.machine.detect import detect_hardware
    from hivekeeper.planner.hardware import default_headroom

    hardware = hardware if hardware is not None else detect_hardware()
    reserve = default_headroom(hardware)
    memory = hardware.cpu.memory_bytes - reserve["cpu"]
    if hardware.gpus and not hardware.gpus[0].unified_memory:
        memory += sum(g.memory_bytes for g in hardware.gpus) - reserve["gpu"]
    disk = hardware.disk.capacity_bytes - reserve["disk"]
    for model in models:
        model.fit = size_fit(model.size_bytes, memory, disk)


def size_fit(size: int, memory: float, disk: float) -> str:
    if size <= memory:
        return "fits here"
    if size <= memory + disk:
        return "runs here, streamed from disk"
    return "needs the swarm"


# ---- pull ----------------------------------------------------------------------------------------------------------
def pull_folder(repo_id: str) -> Path:
    """Where a pull puts a repo's files: ORG--NAME in our models folder (library.our_models_dir)."""
    from hivekeeper.core.runtime.library import our_models_dir

    return our_models_dir() / repo_id.replace("/", "--")


def partial_path(final: Path) -> Path:
    """A file being downloaded: hidden, and not named *.gguf, so `models list` never shows it."""
    return final.with_name(f".{final.name}.partial")


def plan_pull(repo_id: str, gguf_file: str | None = None) -> PullPlan:
    """Which files a pull fetches and how many bytes are not yet here (one model-info request)."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    check_online()
    try:
        info = HfApi().model_info(repo_id, files_metadata=True, timeout=INFO_TIMEOUT_S)
    except GatedRepoError:
        raise InputError(f"{repo_id}: the repository is gated: accept its conditions on its hub page, then log in "
                         f"with `hf auth login` or set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise InputError(f"{repo_id}: no such repository on the hub, or it is private (check the id; for a private "
                         f"model log in with `hf auth login` or set HF_TOKEN)") from None
    except Exception as exc:
        raise hub_failure(f"asking for {repo_id}", exc) from None
    siblings = {s.rfilename: s for s in info.siblings or []}
    names, single = pull_files(repo_id, {n: int(s.size or 0) for n, s in siblings.items()}, gguf_file)
    files = {name: int(siblings[name].size or 0) for name in names}
    sha256 = {name: siblings[name].lfs.sha256 for name in names if siblings[name].lfs}
    plan = PullPlan(repo_id, info.sha, files, single, 0, sha256)
    plan.missing_bytes = missing_bytes(plan)
    return plan


def pull_files(repo_id: str, sizes: dict[str, int], gguf_file: str | None) -> tuple[list[str], str | None]:
    """(the files to fetch, the GGUF file when it is one): the named GGUF; a safetensors checkpoint, as
    resolve_checkpoint would fetch it, config.json last (a folder is a checkpoint once config.json is in it);
    or the repo's only GGUF file."""
    from hivekeeper.core.runtime.checkpoint_files import INDEX_FILE, SIDE_FILES

    ggufs = sorted(n for n in sizes if n.lower().endswith(".gguf"))
    listing = f"its GGUF files: {', '.join(ggufs[:12])}" if ggufs else "it has no GGUF file"
    if gguf_file is not None:
        if not gguf_file.lower().endswith(".gguf"):
            raise InputError(f"--file {gguf_file}: not a .gguf file name ({listing})")
        if gguf_file not in sizes:
            raise InputError(f"{repo_id}: no file {gguf_file!r} in the repository ({listing})")
        return [gguf_file], gguf_file
    weights = sorted(n for n in sizes if n.endswith(".safetensors") and "/" not in n)
    if "config.json" in sizes and weights:
        small = [n for n in (INDEX_FILE, *SIDE_FILES) if n in sizes]
        return small + weights + ["config.json"], None
    if len(ggufs) == 1:
        return ggufs, ggufs[0]
    if ggufs:
        raise InputError(f"{repo_id} holds {len(ggufs)} GGUF files: choose one with --file NAME ({listing})")
    raise InputError(f"{repo_id}: neither a safetensors checkpoint (config.json and .safetensors weights) nor a "
                     f"GGUF file: nothing Hivekeeper runs")


def missing_bytes(plan: PullPlan) -> int:
    """Bytes of the plan's files not yet here (a file cut short counts what it still lacks)."""
    folder = pull_folder(plan.repo_id)
    missing = 0
    for name, size in plan.files.items():
        final = folder / name
        if final.is_file() and final.stat().st_size == size:
            continue
        partial = partial_path(final)
        missing += size - min(partial.stat().st_size if partial.is_file() else 0, size)
    return missing


def free_disk_bytes(folder: Path) -> int:
    """Free bytes of the filesystem that holds `folder` (its nearest existing parent), capped by
    HIVEKEEPER_DISK_FREE_BYTES when set."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    cap = os.environ.get(FREE_DISK_ENV)
    if cap:
        try:
            free = min(free, int(cap))
        except ValueError:
            raise InputError(f"{FREE_DISK_ENV}={cap!r}: not a whole number of bytes") from None
    return free


def check_disk(plan: PullPlan) -> None:
    """InputError, before anything is written, when the files do not fit on the models folder's disk."""
    folder = pull_folder(plan.repo_id)
    free = free_disk_bytes(folder)
    if plan.missing_bytes + DISK_MARGIN_BYTES > free:
        raise InputError(f"{folder.parent}: not enough free disk space to pull {plan.repo_id}: "
                         f"{plan.missing_bytes / 1e6:.1f} MB to download and {DISK_MARGIN_BYTES >> 20} MiB to "
                         f"spare, {free / 1e6:.1f} MB free ({MODELS_DIR_HINT})")


def pull(plan: PullPlan) -> Path:
    """Download what `plan` names into pull_folder; the GGUF file, or the checkpoint folder. Progress shows on
    stderr; a failure is an InputError saying that a rerun resumes."""
    check_disk(plan)
    folder = pull_folder(plan.repo_id)
    for name, size in plan.files.items():
        fetch_file(plan, name, size, folder / name)
    return folder / plan.gguf_file if plan.gguf_file else folder


def fetch_file(plan: PullPlan, name: str, size: int, final: Path) -> None:
    """One file, appended to its partial file from where that ends (a Range request), checked against the hub's
    sha256 when it has one, then renamed into place."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    if final.is_file() and final.stat().st_size == size:
        return
    final.parent.mkdir(parents=True, exist_ok=True)
    partial = partial_path(final)
    try:
        url = hf_hub_url(plan.repo_id, name, revision=plan.commit)
        location = get_hf_file_metadata(url, timeout=INFO_TIMEOUT_S).location or url
        with partial.open("ab") as out:
            http_get(location, out, resume_size=out.tell(), headers=build_hf_headers(), expected_size=size,
                     displayed_filename=name)
    except Exception as exc:  # cut too many times, HTTP errors, a disk that filled meanwhile
        error = hub_failure(f"downloading {name} of {plan.repo_id}", exc)
        raise InputError(f"{error}; run the same command again to resume") from None
    expected = plan.sha256.get(name)
    if expected is not None and file_sha256(partial) != expected:
        partial.unlink()
        raise InputError(f"{plan.repo_id}: {name} arrived corrupt (its sha256 is not the hub's {expected}); it was "
                         f"deleted: run the same command again")
    os.replace(partial, final)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def downloaded_bytes(plan: PullPlan) -> int:
    """Bytes of the plan's files here, finished or partial (what a progress display polls)."""
    return sum(plan.files.values()) - missing_bytes(plan)
