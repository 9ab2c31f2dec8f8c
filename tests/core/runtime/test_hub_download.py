"""resolve_checkpoint with a hub id, against a loopback hub (tests/core/hub_server.py) through the real huggingface_hub.

huggingface_hub reads HF_ENDPOINT and HF_HUB_OFFLINE when it is imported, and this test process runs offline
(tests/conftest.py), so every download runs in a subprocess with its own environment: the endpoint on 127.0.0.1,
HF_HUB_OFFLINE=0, HF_HOME in tmp_path, no token and no proxy.
"""

from __future__ import annotations

import fcntl
import filecmp
import json
import os
import pty
import shutil
import socket
import struct
import subprocess
import sys
import termios
import threading
from pathlib import Path

import pytest
import torch

from hivekeeper.core.runtime.checkpoint import INDEX_FILE, SIDE_FILES, load_span
from hivekeeper.core.runtime.demo_model import make_demo_checkpoint

from ...child_output import ChildOutput
from ..hub_server import LoopbackHub

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.slow]

REPO = "user/demo"
BIG_REPO = "user/big"


@pytest.fixture(scope="module")
def demo_repo(tmp_path_factory) -> Path:
    """4 layers in 6 shards of about 0.2 MB; most layers straddle two shards, the LM head has its own."""
    return make_demo_checkpoint(tmp_path_factory.mktemp("hub") / "demo", layers=4, shard_size_mb=0.2)


@pytest.fixture(scope="module")
def big_repo(tmp_path_factory) -> Path:
    """A 12.6 MB embedding shard: larger than huggingface_hub's 10 MiB read chunk, so a cut download resumes."""
    return make_demo_checkpoint(tmp_path_factory.mktemp("hub") / "big", layers=1, hidden=256, vocab=12288,
                                tie_embeddings=True, shard_size_mb=4)


@pytest.fixture
def hub(demo_repo, big_repo, tmp_path):
    broken_index = tmp_path / "noshard"  # an index naming a shard the repo lacks
    shutil.copytree(demo_repo, broken_index)
    (broken_index / "model-00003-of-00006.safetensors").unlink()
    with LoopbackHub({REPO: demo_repo, BIG_REPO: big_repo, "user/noshard": broken_index}) as hub:
        yield hub


def hub_env(endpoint: str, home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.lower().endswith("_proxy") and k not in ("HF_TOKEN", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE",
                                                             "TRANSFORMERS_OFFLINE", "HF_HUB_DISABLE_PROGRESS_BARS")}
    env.update(HF_ENDPOINT=endpoint, HF_HUB_OFFLINE="0", HF_HOME=str(home), NO_PROXY="127.0.0.1")
    return env


RESOLVE = """
import json, sys
from hivekeeper.core.runtime.checkpoint import resolve_checkpoint
from hivekeeper.planner.errors import InputError
for request in map(json.loads, sys.argv[1:]):
    if request.get("blocks") is not None:
        request["blocks"] = tuple(request["blocks"])
    try:
        print(json.dumps({"folder": str(resolve_checkpoint(**request))}))
    except InputError as exc:
        print(json.dumps({"error": str(exc)}))
"""


def resolve(env: dict[str, str], *requests: dict, stderr: list[str] | None = None) -> list[dict]:
    """resolve_checkpoint(**request) for each request, in one subprocess: {"folder": ...} or {"error": ...}.
    The subprocess's stderr is appended to `stderr` when given."""
    proc = subprocess.run([sys.executable, "-c", RESOLVE, *map(json.dumps, requests)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    if stderr is not None:
        stderr.append(proc.stderr)
    return [json.loads(line) for line in proc.stdout.splitlines()]


def shards_of_layers(folder: Path, layers) -> set[str]:
    weight_map = json.loads((folder / INDEX_FILE).read_text())["weight_map"]
    return {file for name, file in weight_map.items() if any(name.startswith(f"model.layers.{i}.") for i in layers)}


def all_shards(folder: Path) -> set[str]:
    return {p.name for p in folder.glob("model-*.safetensors")}


def test_a_block_range_fetches_config_index_and_only_its_shards(hub, demo_repo, tmp_path):
    env = hub_env(hub.endpoint, tmp_path / "hf")
    (result,) = resolve(env, {"model": REPO, "blocks": [1, 3]})
    folder = Path(result["folder"])
    assert folder.parent.name == "snapshots" and folder.name == hub.commit_of(REPO)
    needed = shards_of_layers(demo_repo, [1, 2])
    assert needed and all_shards(demo_repo) - needed  # the range does not need every shard
    small_files = {"config.json", INDEX_FILE, *(f for f in SIDE_FILES if (demo_repo / f).exists())}
    assert sorted(hub.downloaded(REPO)) == sorted(small_files | needed)  # each sent once, nothing else
    assert {p.name for p in folder.iterdir()} == small_files | needed
    for name in small_files | needed:
        assert filecmp.cmp(folder / name, demo_repo / name, shallow=False), name

    hidden = torch.randn(2, 5, 64)
    with torch.inference_mode():
        assert torch.equal(load_span(folder, 1, 3)(hidden), load_span(demo_repo, 1, 3)(hidden))

    # a later run for the whole model fetches only the shards it does not have yet
    (again,) = resolve(env, {"model": REPO})
    assert Path(again["folder"]) == folder
    second_run = hub.downloaded(REPO)[len(small_files | needed):]
    assert sorted(second_run) == sorted(all_shards(demo_repo) - needed)
    assert {p.name for p in folder.glob("model-*.safetensors")} == all_shards(demo_repo)


def test_a_cut_download_resumes_and_the_file_is_identical(hub, big_repo, tmp_path):
    embedding_shard = "model-00001-of-00002.safetensors"  # 12.6 MB: cut at 90%, after one full 10 MiB chunk
    other_shard = "model-00002-of-00002.safetensors"  # 2.9 MB: cut at half, before any full chunk
    size = (big_repo / embedding_shard).stat().st_size
    hub.drop_once.update({embedding_shard: 0.9, other_shard: 0.5})
    (result,) = resolve(hub_env(hub.endpoint, tmp_path / "hf"), {"model": BIG_REPO, "blocks": [0, 0],
                                                                  "embeddings": True})
    folder = Path(result["folder"])
    for shard in (embedding_shard, other_shard):
        assert filecmp.cmp(folder / shard, big_repo / shard, shallow=False), shard
    # huggingface_hub keeps what it wrote in whole 10 MiB chunks and asks for the rest with a Range request
    (ranged,) = hub.range_requests()
    assert ranged.origin == "cdn" and ranged.file == embedding_shard and ranged.status == 206
    start = int(ranged.range.removeprefix("bytes=").removesuffix("-"))
    assert 0 < start < 0.9 * size
    # the small shard had no whole chunk yet: it was fetched again from the start
    assert hub.downloaded(BIG_REPO).count(other_shard) == 2
    assert not list((tmp_path / "hf").rglob("*.incomplete"))


def test_missing_repo_failing_hub_and_missing_shard_are_one_line_errors(hub, tmp_path):
    hub.fail_repo["user/broken"] = 500
    missing, broken, noshard = resolve(hub_env(hub.endpoint, tmp_path / "hf"),
                                       {"model": "user/missing"}, {"model": "user/broken"},
                                       {"model": "user/noshard", "blocks": [1, 3]})
    for result, repo in ((missing, "user/missing"), (broken, "user/broken"), (noshard, "user/noshard")):
        assert "folder" not in result
        message = result["error"]
        assert f"cannot get model '{repo}'" in message and "hivekeeper demo-model DIR" in message
        assert "\n" not in message
    assert "no such repository" in missing["error"] and "HF_TOKEN" in missing["error"]
    assert "HTTP 500" in broken["error"] and "network access" in broken["error"]
    assert "has no model-00003-of-00006.safetensors" in noshard["error"]
    assert not hub.downloaded("user/missing") and not hub.downloaded("user/broken")


def test_a_downloaded_range_resolves_with_the_hub_gone_or_offline(demo_repo, tmp_path):
    """No request is needed for cached files, nor for side files the hub said the repo lacks (they would cost
    huggingface_hub's retries, about 20 s each, with the network down)."""
    plain = tmp_path / "plain"  # a repo without the optional side files
    shutil.copytree(demo_repo, plain, ignore=shutil.ignore_patterns("generation_config.json", "special_tokens_map*"))
    with LoopbackHub({REPO: plain}) as hub:
        env = hub_env(hub.endpoint, tmp_path / "hf")
        (first,) = resolve(env, {"model": REPO, "blocks": [1, 3]})
    # the hub is gone: its port refuses connections
    stderr: list[str] = []
    (gone,) = resolve(env, {"model": REPO, "blocks": [1, 3]}, stderr=stderr)
    assert gone == first and "Retrying" not in stderr[0]
    offline, more = resolve({**env, "HF_HUB_OFFLINE": "1"}, {"model": REPO, "blocks": [1, 3]},
                            {"model": REPO, "blocks": [0, 4]})
    assert offline == first
    missing = sorted(all_shards(plain) - shards_of_layers(plain, [1, 2]))[0]
    assert f"{missing} is not in the local cache and HF_HUB_OFFLINE is set" in more["error"]


def run_with_terminal_stderr(command: list[str], env: dict[str, str], timeout: float = 180) -> tuple[int, str, str]:
    """(returncode, stdout, stderr) with stderr on a pseudo-terminal, as a user sees it (tqdm only draws there)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # rows, columns: bars need a width
    chunks: list[bytes] = []

    def read_terminal() -> None:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed its end
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=read_terminal, daemon=True)
    reader.start()
    try:
        child = ChildOutput(subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                             stderr=slave))
        os.close(slave)
        try:
            returncode = child.wait(timeout)  # past it: killed, and its stdout so far in the failure
        except AssertionError as failure:
            raise AssertionError(f"{failure}\n--- terminal ---\n{b''.join(chunks).decode(errors='replace')}") from None
        finally:
            child.close()
        reader.join(timeout=10)
    finally:
        os.close(master)
    return returncode, child.stdout, b"".join(chunks).decode(errors="replace")


def test_generate_from_a_hub_id_shows_download_progress(hub, demo_repo, tmp_path):
    returncode, stdout, stderr = run_with_terminal_stderr(
        [sys.executable, "-m", "hivekeeper.core.cli.main", "generate", "--model", REPO, "--prompt", "hello",
         "--max-new-tokens", "3", "--json"], hub_env(hub.endpoint, tmp_path / "hf"))
    assert returncode == 0, stderr
    assert json.loads(stdout)["new_tokens"] == 3
    assert sorted(hub.downloaded(REPO)) == sorted(
        {"config.json", INDEX_FILE, *all_shards(demo_repo), *(f for f in SIDE_FILES if (demo_repo / f).exists())})
    for shard in all_shards(demo_repo):  # one tqdm bar per file, named after it, run to the end
        bar = [line for line in stderr.replace("\r", "\n").splitlines() if shard in line]
        assert any("100%" in line for line in bar), (shard, stderr[-2000:])


def test_generate_with_the_hub_unreachable_says_what_to_do(tmp_path):
    with socket.socket() as probe:  # a port with nobody listening: connections are refused
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.run(
        [sys.executable, "-m", "hivekeeper.core.cli.main", "generate", "--model", REPO, "--prompt", "hello"],
        env=hub_env(f"http://127.0.0.1:{port}", tmp_path / "hf"), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 2 and proc.stdout == ""
    # one line, at once: the hub is probed once instead of huggingface_hub retrying (a line per retry, ~25 s)
    errors = proc.stderr.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("hivekeeper generate:"), proc.stderr
    assert "cannot get model 'user/demo'" in errors[0] and "cannot be reached" in errors[0]
    assert "Connection refused" in errors[0] and "hivekeeper demo-model DIR" in errors[0]
    assert "Traceback" not in proc.stderr
    assert not list((tmp_path / "hf").rglob("*.safetensors"))


def test_a_server_from_the_hub_fetches_only_the_span_it_chose(hub, demo_repo, tmp_path):
    from hivekeeper.core.swarm.local import LocalSwarm

    env = {**hub_env(hub.endpoint, tmp_path / "hf"), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    with LocalSwarm(REPO, extra_args=("--torch-threads", "1", "--balance-period", "0"), env=env) as swarm:
        server = swarm.start("--num-blocks", "1")  # the first server of a new swarm takes block 0
        online = server.wait_for("online")
    assert online["blocks"] == [0, 1], online
    needed = shards_of_layers(demo_repo, [0])
    assert needed and all_shards(demo_repo) - needed
    fetched_shards = {f for f in hub.downloaded(REPO) if f.endswith(".safetensors")}
    assert fetched_shards == needed  # chosen first, fetched after: not the whole model
