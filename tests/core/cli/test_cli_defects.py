"""Issue 14 item 11, each through the real command: an empty prompt is exit 2; a --max-new-tokens beyond the model's
context is capped and says so; an unknown hub id suggests the catalog's close ids (and Meta's current Llama 3.1
names are aliases); chat has /help; `detect --help` says what it prints; the README's Python matches pyproject.
Each test runs one real child process; its variations go through the same `main()` in this process (the `cli`
fixture), since each child costs seconds of imports."""

from __future__ import annotations

import json
import os
import re
import sys
import tomllib
from pathlib import Path

import pytest

from ...child_output import run

ROOT = Path(__file__).resolve().parents[3]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def hivekeeper(*args: str, input: str | None = None, timeout: float = 300, env: dict | None = None):
    """The real command as a child (`env`: variables set beside the suite's)."""
    return run([sys.executable, "-m", "hivekeeper.core.cli.main", *args], timeout=timeout, input=input,
               env={**ENV, **(env or {})})


def one_line(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.parametrize("prompt", ["", "   \n"])
def test_an_empty_prompt_is_exit_2(tiny_checkpoint, prompt, cli):
    command = hivekeeper if prompt == "" else cli
    result = command("generate", "--model", str(tiny_checkpoint), "--prompt", prompt)
    assert result.returncode == 2 and result.stdout == ""
    assert "--prompt is empty" in one_line(result)


@pytest.fixture(scope="module")
def short_context_checkpoint(tmp_path_factory):
    """The tiny demo model with a 96-token context: the capped generation runs the whole context, and the default
    2048 positions cost the child ~2000 decode steps."""
    from hivekeeper.core.runtime.demo_model import make_demo_checkpoint

    return make_demo_checkpoint(tmp_path_factory.mktemp("short") / "short-context", max_position=96)


def test_max_new_tokens_beyond_the_context_is_capped_and_said(short_context_checkpoint, cli):
    from hivekeeper.core.runtime.checkpoint import load_config

    context = load_config(short_context_checkpoint).max_position_embeddings
    assert context == 96
    result = hivekeeper("generate", "--model", str(short_context_checkpoint), "--prompt", "Hello there",
                        "--max-new-tokens", str(10**12), "--ignore-eos", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    note = re.search(r"note: --max-new-tokens 1000000000000 capped at (\d+): the model's context is (\d+) tokens "
                     r"and the prompt takes (\d+)", result.stderr)
    assert note, result.stderr
    capped, said_context, prompt_tokens = map(int, note.groups())
    assert said_context == context and capped == context - prompt_tokens
    assert report["new_tokens"] == capped  # what it said is what it did
    small = cli("generate", "--model", str(short_context_checkpoint), "--prompt", "Hello", "--max-new-tokens", "3",
                       "--json")
    assert small.returncode == 0 and "capped" not in small.stderr


def test_unknown_hub_ids_suggest_and_current_llama_names_are_aliases(cli):
    alias = hivekeeper("plan", "--model", "meta-llama/Llama-3.1-8B", "--hardware", "rtx-4090", "--json")
    assert alias.returncode == 0, alias.stderr
    assert json.loads(alias.stdout)["model"] == "meta-llama/Meta-Llama-3.1-8B-Instruct"
    unknown = cli("plan", "--model", "meta-llama/Llama-3.2-3B", "--hardware", "rtx-4090")
    assert unknown.returncode == 2
    assert "did you mean meta-llama/Llama-3.2-1B" in one_line(unknown)
    typo = cli("plan", "--model", "mistral/Mixtral-8x7b", "--hardware", "rtx-4090")
    assert typo.returncode == 2 and "did you mean mistralai/Mixtral-8x7B-v0.1" in one_line(typo)


def test_chat_has_help(tiny_checkpoint):
    result = hivekeeper("chat", "--model", str(tiny_checkpoint), "--max-new-tokens", "4", input="/help\n/exit\n")
    assert result.returncode == 0, result.stderr
    text = result.stdout + result.stderr
    assert "/help lists the commands" in text  # the greeting names it
    for command in ("/reset", "/exit, /quit", "Ctrl-C"):
        assert re.search(rf"^\s+{re.escape(command)}\s+\S", text, re.M), text
    assert "up to 4 new tokens per reply" in text and "unknown command" not in text


def test_detect_help_says_text_and_json(cli):
    help_text = cli("detect", "--help").stdout
    assert "(JSON)" not in help_text and "--json for a hardware JSON document" in help_text
    text = cli("detect")
    assert text.returncode == 0 and not text.stdout.lstrip().startswith("{")
    as_json = hivekeeper("detect", "--json")
    assert as_json.returncode == 0 and isinstance(json.loads(as_json.stdout), dict)


def test_readme_python_version_is_pyproject_s():
    required = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    version = required.removeprefix(">=")
    readme = (ROOT / "README.md").read_text()
    assert f"Python ≥ {version}" in readme
    assert not re.search(r"Python (≥|>=) ?3\.(?!" + re.escape(version.split(".")[1]) + r")\d+", readme)


@pytest.mark.parametrize("args, words", [
    (("demo-model", "/proc/hivekeeper-demo"), "/proc: not a folder on a disk (a virtual file system)"),
    (("plan", "--model", "{empty}"), "the file is empty, not a GGUF file"),
    (("plan", "--reserve-gb", "100000", "--no-measure"), "GB of RAM that this machine has"),
])
def test_a_newcomers_bad_input_says_what_is_wrong(tmp_path, cli, args, words):
    """Session 21's newcomer: /proc was "not enough free disk space ... (0.00 GB free)", an empty file "starts with
    b''", and --reserve-gb ended "... of RAM of detected"."""
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    result = cli(*(arg.replace("{empty}", str(empty)) for arg in args))
    assert result.returncode == 2 and words in one_line(result), result.stderr
    assert not Path("/proc/hivekeeper-demo").exists()


def test_a_host_override_out_of_range_is_refused_before_the_first_measurement(tmp_path):
    """Session 22 (a newcomer's run): `plan --ram-gb 0` on a machine never measured measured it quickly (28 s), saved
    the profile, then refused the value by its JSON field name. Now the flag is checked first, with the hardware
    file's own range: one line naming the flag, nothing measured or saved."""
    result = hivekeeper("plan", "--ram-gb", "0", env={"HIVEKEEPER_CONFIG_DIR": str(tmp_path / "config")})
    assert result.returncode == 2 and result.stdout == ""
    assert one_line(result) == "hivekeeper plan: error: --ram-gb must be from 0.001 to 65536, got 0"
    assert not (tmp_path / "config").exists()


@pytest.mark.parametrize("args, said", [
    (("generate", "--prompt", "hi", "--top-p", "2"), "--top-p must be in (0, 1]"),
    (("generate", "--prompt", "hi", "--temperature", "-1"), "--temperature must be a number >= 0"),
    (("chat", "--history", "/nonexistent-folder-hk/h.json"), "--history /nonexistent-folder-hk/h.json: folder "
                                                            "/nonexistent-folder-hk does not exist"),
])
def test_bad_options_are_named_as_typed(args, said, cli, tiny_checkpoint):
    """Sampling errors named the API's fields (top_p); `chat --history` in a missing folder created it at the root."""
    result = cli(*args[:1], "--model", str(tiny_checkpoint), *args[1:])
    assert result.returncode == 2 and said in one_line(result)
    assert not Path("/nonexistent-folder-hk").exists()


def test_a_text_file_given_to_prompts_points_at_prompts_file(tmp_path, cli, tiny_checkpoint):
    lines = tmp_path / "lines.txt"
    lines.write_text("hello there\nhow are you\n")
    result = cli("generate", "--model", str(tiny_checkpoint), "--prompt", "hi", "--prompts", str(lines))
    assert result.returncode == 2
    assert f"{lines}: corrupt safetensors header" in one_line(result) and "use --prompts-file" in one_line(result)


def test_measure_refuses_a_config_dir_that_is_a_file_before_measuring(tmp_path):
    """It measured, then ended with a NotADirectoryError traceback (exit 1)."""
    not_a_folder = tmp_path / "config.json"
    not_a_folder.write_text("{}")
    result = hivekeeper("measure", "--no-disk", timeout=120,
                        env={"HIVEKEEPER_CONFIG_DIR": str(not_a_folder), "HIVEKEEPER_MEASURE_SIZES": "tiny"})
    assert result.returncode == 2 and "measure [" not in result.stderr
    assert one_line(result).endswith("HIVEKEEPER_CONFIG_DIR, when set, must name a folder")


def test_detect_refuses_a_data_dir_that_is_a_file(tmp_path, cli):
    """It reported 'filesystem of <the file>'; a folder not made yet is still read at its nearest parent
    (tests/core/machine/test_detect.py)."""
    a_file = tmp_path / "models.txt"
    a_file.write_text("")
    result = cli("detect", "--data-dir", str(a_file))
    assert result.returncode == 2 and f"--data-dir {a_file}: not a folder" in one_line(result)


# ---- session 23's newcomer ------------------------------------------------------------------------------------------
def test_a_broken_config_json_is_named_before_a_missing_tokenizer(tmp_path, cli):
    """`generate` on a folder whose config.json is not JSON said "tokenizer.json: missing. This checkpoint has no fast
    tokenizer; convert it ...", while `models list` said what is wrong: config.json is read first now."""
    folder = tmp_path / "badcfg"
    folder.mkdir()
    (folder / "config.json").write_text("{bad")
    result = cli("generate", "--model", str(folder), "--prompt", "hi")
    assert result.returncode == 2 and result.stdout == ""
    line = one_line(result)
    assert f"{folder / 'config.json'}: not valid JSON" in line and "tokenizer" not in line, line


def test_the_built_in_model_cut_short_says_so_in_plain_words(tmp_path, cli):
    """`head -c 1000000 model.gguf > cut.gguf`, then `generate --model cut.gguf`: the line ended in struct's
    "unpack_from requires a buffer of at least 1000007 bytes ...". Now the file's size and what runs past its end."""
    from hivekeeper.core.runtime.default_model import INSTALL_HINT, default_model_file

    source = default_model_file()
    if source is None:
        pytest.skip(f"the built-in model is not installed ({INSTALL_HINT})")
    cut = tmp_path / "cut.gguf"
    with open(source, "rb") as whole:
        cut.write_bytes(whole.read(1_000_000))
    result = cli("generate", "--model", str(cut), "--prompt", "hi")
    assert result.returncode == 2 and result.stdout == ""
    line = one_line(result)
    assert f"{cut}: corrupt or truncated GGUF file (1,000,000 bytes; its header runs past the end of the file)" in line
    assert not re.search(r"unpack|buffer|reshape", line), line


def test_the_built_in_models_hub_name_suggests_the_built_in_model(cli):
    """`plan --model HuggingFaceTB/SmolLM2-135M-Instruct` suggested only Meta-Llama-3.1 ids (their whole ids look
    alike); the built-in model, the same name after the org, comes first now."""
    result = cli("plan", "--model", "HuggingFaceTB/SmolLM2-135M-Instruct", "--hardware", "rtx-4090")
    assert result.returncode == 2
    assert "did you mean smollm2-135m-instruct or " in one_line(result), result.stderr
