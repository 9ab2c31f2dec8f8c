"""`hivekeeper models search` and `models pull` against the loopback hub (tests/core/hub_server.py), through the real
huggingface_hub in a child process (it reads HF_ENDPOINT and HF_HUB_OFFLINE when imported; this process is
offline): which repos a search keeps and what it says of them, a GGUF file and a safetensors checkpoint pulled
into our models folder byte for byte, a pull killed mid-file and resumed, a full disk refused before the first byte,
and one line with exit 2 for every bad id, missing file and offline hub."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import gguf
import pytest
from safetensors import safe_open

from hivekeeper.core.cli.main import main
from hivekeeper.core.runtime.demo_model import make_demo_checkpoint

from ...child_output import ChildOutput, run
from ..hub_server import LoopbackHub
from .test_models import write_gguf

pytestmark = pytest.mark.slow  # each step is a child process (huggingface_hub reads the endpoint at import)

CLI = [sys.executable, "-m", "hivekeeper.core.cli.main", "models"]
CHUNK = 10 * 1024 * 1024  # huggingface_hub writes a download in chunks of 10 MiB (its DOWNLOAD_CHUNK_SIZE)


@pytest.fixture(scope="module")
def repos(tmp_path_factory) -> dict[str, Path]:
    """A one-file GGUF repo, a two-file one, a 12 MB one (more than one write chunk), a safetensors llama, and a
    safetensors model of an architecture the runtime does not run (gpt2)."""
    root = tmp_path_factory.mktemp("hubrepos")
    Q8, F16 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F16
    write_gguf(root / "one" / "tiny-Q8_0.gguf", Q8)
    write_gguf(root / "two" / "tiny-Q8_0.gguf", Q8)
    write_gguf(root / "two" / "tiny-F16.gguf", F16)
    write_gguf(root / "big" / "big-F16.gguf", F16, vocab=96_000)
    llama = make_demo_checkpoint(root / "llama", layers=1, hidden=64, vocab=512)
    other = shutil.copytree(llama, root / "other")
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    return {"org/tiny-GGUF": root / "one", "org/tiny-two-GGUF": root / "two", "org/big-GGUF": root / "big",
            "org/tiny-llama": llama, "org/tiny-gpt2": other}


@pytest.fixture
def hub(repos):
    cards = {"org/tiny-GGUF": {"downloads": 30}, "org/tiny-llama": {"downloads": 20}, "org/tiny-gpt2": {"downloads": 99}}
    with LoopbackHub(repos, cards) as hub:
        yield hub


@pytest.fixture
def env(hub, tmp_path) -> dict[str, str]:
    """The child's environment: the loopback hub, online, an empty models folder and HF home in tmp_path, no token
    or proxy."""
    env = {k: v for k, v in os.environ.items()
           if not k.lower().endswith("_proxy") and k not in ("HF_TOKEN", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE",
                                                             "HF_HUB_DISABLE_PROGRESS_BARS")}
    env.update(HF_ENDPOINT=hub.endpoint, HF_HUB_OFFLINE="0", HF_HOME=str(tmp_path / "hf"), NO_PROXY="127.0.0.1",
               OMP_NUM_THREADS="1", HIVEKEEPER_MODELS_DIR=str(tmp_path / "models"))
    return env


def models(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return run([*CLI, *args], timeout=180, env=env)


def one_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    return lines[0]


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def written_files(env: dict[str, str]) -> list[Path]:
    """Files under the models folder and the HF home (where nothing should be written)."""
    return [p for key in ("HIVEKEEPER_MODELS_DIR", "HF_HOME") for p in Path(env[key]).rglob("*") if p.is_file()]


def gguf_parameters(path: Path) -> int:
    return int(sum(t.n_elements for t in gguf.GGUFReader(str(path)).tensors))


def safetensors_parameters(folder: Path) -> int:
    total = 0
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), framework="np") as f:
            total += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    return total


# ---- search --------------------------------------------------------------------------------------------------------
def test_search_keeps_the_formats_and_architectures_we_run_with_size_and_fit(hub, env, repos):
    result = models(env, "search", "TINY", "--json")
    assert result.returncode == 0, result.stderr
    found = {m["id"]: m for m in json.loads(result.stdout)}
    # gpt2 matches the text and is safetensors, but the runtime does not run it; big-GGUF does not match
    assert list(found) == ["org/tiny-GGUF", "org/tiny-llama", "org/tiny-two-GGUF"]  # most downloaded first
    tiny = found["org/tiny-GGUF"]
    assert (tiny["format"], tiny["architecture"]) == ("gguf", "llama")
    assert tiny["parameters"] == gguf_parameters(repos["org/tiny-GGUF"] / "tiny-Q8_0.gguf")
    assert tiny["size_bytes"] == int(tiny["parameters"] * 4.5 / 8)  # estimated as a 4-bit file
    llama = found["org/tiny-llama"]
    assert (llama["format"], llama["architecture"]) == ("safetensors", "llama")
    assert llama["parameters"] == safetensors_parameters(repos["org/tiny-llama"])
    assert llama["size_bytes"] == 4 * llama["parameters"]  # stored as F32
    assert {m["fit"] for m in found.values()} == {"fits here"}  # a few hundred kB
    # the queries huggingface_hub sent: one per format, filtered on the hub
    queries = [r.file for r in hub.requests if r.origin == "api"]
    assert len(queries) == 2

    table = models(env, "search", "llama", "--no-fit")
    assert table.returncode == 0, table.stderr
    header, row = table.stdout.splitlines()
    assert header.split()[:3] == ["ID", "FORMAT", "ARCH"] and row.split()[:3] == ["org/tiny-llama", "safetensors",
                                                                                 "llama"]
    nothing = models(env, "search", "no-such-words", "--no-fit")
    assert nothing.returncode == 0 and nothing.stdout == "" and "no hub model matching" in nothing.stderr


def test_search_and_pull_offline_or_unreachable_say_so_in_one_line(env, tmp_path):
    offline = {**env, "HF_HUB_OFFLINE": "1"}
    for args in (("search", "tiny"), ("pull", "org/tiny-GGUF")):
        assert "HF_HUB_OFFLINE is set" in one_line(models(offline, *args))
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    started = time.monotonic()
    line = one_line(models({**env, "HF_ENDPOINT": closed}, "search", "tiny"))
    assert closed in line and "cannot be reached" in line
    assert time.monotonic() - started < 60  # no retries for minutes
    assert written_files(env) == []


# ---- pull ----------------------------------------------------------------------------------------------------------
def test_pull_a_gguf_file_and_a_checkpoint_into_our_models_folder(hub, env, repos, monkeypatch, capsys):
    # huggingface_hub draws its bar on a terminal only; TQDM_POSITION=-1 is its switch to draw it anyway
    result = models({**env, "TQDM_POSITION": "-1"}, "pull", "org/tiny-GGUF")
    assert result.returncode == 0, result.stderr
    path = Path(result.stdout.split(": ", 1)[1].strip())
    assert path == Path(env["HIVEKEEPER_MODELS_DIR"]) / "org--tiny-GGUF" / "tiny-Q8_0.gguf"
    assert "tiny-Q8_0.gguf: 100%" in result.stderr  # huggingface_hub's progress bar, named after the file
    assert sha256(path) == sha256(repos["org/tiny-GGUF"] / "tiny-Q8_0.gguf")

    result = models(env, "pull", "org/tiny-two-GGUF", "--file", "tiny-F16.gguf")
    assert result.returncode == 0, result.stderr
    assert sha256(result.stdout.split(": ", 1)[1].strip()) == sha256(repos["org/tiny-two-GGUF"] / "tiny-F16.gguf")

    result = models(env, "pull", "org/tiny-llama")
    assert result.returncode == 0, result.stderr
    folder = Path(result.stdout.split(": ", 1)[1].strip())
    wanted = {p.name for p in repos["org/tiny-llama"].iterdir()} - {"README.md"}  # what a checkpoint load reads
    assert {p.name for p in folder.iterdir()} == wanted
    for name in wanted:
        assert sha256(folder / name) == sha256(repos["org/tiny-llama"] / name), name

    # `models list` finds all three in our folder (no partial file left behind); a second pull downloads nothing
    assert not list(Path(env["HIVEKEEPER_MODELS_DIR"]).rglob("*.partial"))
    monkeypatch.setenv("HIVEKEEPER_MODELS_DIR", env["HIVEKEEPER_MODELS_DIR"])
    assert main(["models", "list", "--json", "--no-fit"]) == 0
    listed = {m["id"]: m for m in json.loads(capsys.readouterr().out) if m["source"] == "hivekeeper"}
    assert sorted(listed) == ["org--tiny-GGUF", "org--tiny-llama", "org--tiny-two-GGUF"]
    assert listed["org--tiny-llama"]["format"] == "safetensors" and listed["org--tiny-GGUF"]["quantization"] == "Q8_0"
    sent = len(hub.downloaded())
    again = models(env, "pull", "org/tiny-GGUF")
    assert again.returncode == 0 and "0 B to download" in again.stderr and len(hub.downloaded()) == sent


def test_bad_ids_and_files_are_one_line_each(env):
    assert "no such repository" in one_line(models(env, "pull", "org/nothing"))
    line = one_line(models(env, "pull", "org/tiny-two-GGUF", "--file", "tiny-Q4.gguf"))
    assert "no file 'tiny-Q4.gguf'" in line and "tiny-F16.gguf, tiny-Q8_0.gguf" in line
    line = one_line(models(env, "pull", "org/tiny-two-GGUF"))
    assert "holds 2 GGUF files: choose one with --file" in line
    assert written_files(env) == []


def test_a_full_disk_is_refused_before_the_first_byte(hub, env, repos):
    size = (repos["org/big-GGUF"] / "big-F16.gguf").stat().st_size
    line = one_line(models({**env, "HIVEKEEPER_DISK_FREE_BYTES": str(size)}, "pull", "org/big-GGUF"))
    assert "not enough free disk space" in line and f"{size / 1e6:.1f} MB to download" in line
    assert hub.downloaded() == [] and written_files(env) == []


def test_a_killed_pull_resumes_and_the_file_is_identical(hub, env, repos):
    source = repos["org/big-GGUF"] / "big-F16.gguf"
    assert source.stat().st_size > CHUNK + (1 << 20)
    hub.stall_after["big-F16.gguf"] = CHUNK + (1 << 20)  # one whole chunk written, then the hub goes quiet
    partial = Path(env["HIVEKEEPER_MODELS_DIR"]) / "org--big-GGUF" / ".big-F16.gguf.partial"
    child = ChildOutput(subprocess.Popen([*CLI, "pull", "org/big-GGUF"], env=env, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE))
    try:
        deadline = time.monotonic() + 120
        while not (partial.is_file() and partial.stat().st_size >= CHUNK):
            assert child.proc.poll() is None and time.monotonic() < deadline, child.report()
            time.sleep(0.1)
        child.proc.kill()
    finally:
        child.close()
    assert partial.stat().st_size == CHUNK

    result = models(env, "pull", "org/big-GGUF")
    assert result.returncode == 0, result.stderr
    assert f"{(source.stat().st_size - CHUNK) / 1e6:.1f} MB to download" in result.stderr
    assert sha256(result.stdout.split(": ", 1)[1].strip()) == sha256(source)
    (ranged,) = hub.range_requests()
    assert ranged.range == f"bytes={CHUNK}-" and ranged.status == 206
