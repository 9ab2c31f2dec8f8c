"""`hivekeeper finetune` on the tiny demo model, run in this process through the command's own entry point.

- Bad data (a line that is not JSON, an empty file, an example longer than the context, a chat that does not end
  with the assistant's reply, bytes that are not UTF-8, a UTF-16 file) is one error line naming the file and line,
  exit 2, and no prompts file is written. A UTF-8 BOM (Notepad's) and a U+2028 inside a JSON string are read.
- --prompt-tokens at or past the default model's context (8192) and an --out that is a folder are refused in one
  line before the data is read.
- A run saves its prompts with the model id, method and step in the file's metadata; a second run with more
  --steps resumes from that file and ends where one uninterrupted run ends; a resume that leaves out --method and
  --prompt-tokens takes the file's, and one that names another size is told the file's.
- `generate --prompts FILE` runs the trained prompts first: its text differs from the plain model's, and a prompts
  file for another model's shape is refused in one line, and so is a prompt that leaves no room after the trained
  prompts (naming the prompts file and its tokens). It runs through the local plan: with every block streamed
  from disk, or K/V recomputed from kept block inputs, the text is the all-resident run's.
- `api --prompts FILE` decodes concurrent requests together (the continuous batcher, each row starting with the
  prompts' K/V), each reply the prompted model's own greedy text.
"""

from __future__ import annotations

import http.client
import json
import threading
import time

import pytest
import torch

from hivekeeper.core.cli.main import main
from hivekeeper.core.finetune.prompts import load_prompts
from hivekeeper.core.runtime.default_model import DEFAULT_MODEL_ID, INSTALL_HINT, default_model_file

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PAIRS = [{"prompt": "The sky is", "completion": " blue."}, {"prompt": "Grass is", "completion": " green."},
         {"messages": [{"role": "user", "content": "Snow?"}, {"role": "assistant", "content": "White."}]}]


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    return path


def finetune(checkpoint, data, out, *extra: str) -> int:
    return main(["finetune", "--model", str(checkpoint), "--data", str(data), "--out", str(out), "--prompt-tokens",
                 "2", "--batch", "2", "--lr", "0.05", *extra])


@pytest.mark.parametrize("text, line, says", [
    ('{"prompt": "a", "completion": " b"}\n{"prompt": "a", "completion"\n', 2, "not a JSON line"),
    ("\n\n", None, "the data file is empty"),
    ('{"prompt": "' + "word " * 2500 + '", "completion": " b"}\n', 1, "the model's context leaves 2046"),
    ('{"messages": [{"role": "user", "content": "hi"}]}\n', 1, "the last message must be the assistant's"),
    ('{"text": "hi"}\n', 1, "needs 'messages' or both 'prompt' and 'completion'"),
    (b'{"prompt": "a", "completion": " b"}\n{"prompt": "caf\xe9", "completion": " b"}\n', 2,
     "byte 0xe9 is not UTF-8: the data file must be UTF-8"),  # Latin-1
    ('{"prompt": "a", "completion": " b"}\n'.encode("utf-16"), 1, "UTF-16 text: the data file must be UTF-8"),
], ids=["not-json", "empty", "too-long", "no-reply", "no-fields", "latin-1", "utf-16"])
def test_bad_data_is_one_line_naming_file_and_line(tiny_checkpoint, tmp_path, capsys, text, line, says):
    data = tmp_path / "bad.jsonl"
    data.write_bytes(text if isinstance(text, bytes) else text.encode())
    out = tmp_path / "p.prompts"
    assert finetune(tiny_checkpoint, data, out, "--steps", "1") == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1
    assert f"{data}:{line}:" in error if line else f"{data}:" in error
    assert says in error
    assert not out.exists()


@pytest.mark.parametrize("raw", [
    b"\xef\xbb\xbf" + json.dumps(PAIRS[0]).encode() + b"\r\n",  # UTF-8 with a BOM and CRLF, as Notepad saves it
    json.dumps({"prompt": "The sky\u2028is", "completion": " blue."}, ensure_ascii=False).encode() + b"\n",
], ids=["bom", "line-separator-in-a-string"])
def test_utf8_with_a_bom_or_a_line_separator_in_a_string_trains(cli, tiny_checkpoint, tmp_path, raw):
    data, out = tmp_path / "data.jsonl", tmp_path / "p.prompts"
    data.write_bytes(raw)
    done = cli("finetune", "--model", str(tiny_checkpoint), "--data", str(data), "--out", str(out),
               "--prompt-tokens", "2", "--steps", "1")
    assert done.returncode == 0, done.stderr
    assert load_prompts(out)[1].step == 1


DEFAULT_MODEL = pytest.mark.skipif(default_model_file() is None,
                                   reason=f"the default model is not installed ({INSTALL_HINT})")


@DEFAULT_MODEL
@pytest.mark.parametrize("method", ["ptune", "deep_ptune"])
def test_prompt_tokens_past_the_context_are_refused_before_the_data(cli, tmp_path, method):
    """Both methods put their prompt tokens in the first positions of the context: --prompt-tokens must be below
    it, said of the flag itself (not of a data line, which would be read first, and here is not JSON)."""
    data, out = tmp_path / "data.jsonl", tmp_path / "p.prompts"
    data.write_text("not json\n")
    done = cli("finetune", "--model", DEFAULT_MODEL_ID, "--data", str(data), "--out", str(out), "--method", method,
               "--prompt-tokens", "100000")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert done.stderr.startswith("hivekeeper finetune: error: --prompt-tokens 100000: must be below the model's "
                                  "context of 8192 tokens"), done.stderr
    assert not out.exists()


def test_an_out_folder_is_refused_as_a_folder(cli, tiny_checkpoint, data, tmp_path):
    folder = tmp_path / "prompts"
    folder.mkdir()
    done = cli("finetune", "--model", str(tiny_checkpoint), "--data", str(data), "--out", str(folder))
    assert (done.returncode, done.stderr) == (2, f"hivekeeper finetune: error: --out {folder}: a folder, not a "
                                                 "prompts file\n")
    assert list(folder.iterdir()) == []


def test_a_resume_takes_the_files_method_and_prompt_tokens(cli, tiny_checkpoint, data, tmp_path):
    """Trained with --method ptune --prompt-tokens 2 (neither the default), the file resumes without them; asking
    for another size is refused with the file's."""
    out = tmp_path / "z.prompts"
    common = ("finetune", "--model", str(tiny_checkpoint), "--data", str(data), "--out", str(out), "--batch", "2")
    assert cli(*common, "--method", "ptune", "--prompt-tokens", "2", "--steps", "1").returncode == 0
    done = cli(*common, "--steps", "2")
    assert done.returncode == 0 and "resuming" in done.stderr, done.stderr
    _, info, _ = load_prompts(out)
    assert (info.method, info.tokens, info.step) == ("ptune", 2, 2)
    done = cli(*common, "--steps", "3", "--prompt-tokens", "3")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert f"{out}: holds ptune prompts of 2 tokens, not --prompt-tokens 3: pass --prompt-tokens 2" in done.stderr
    assert load_prompts(out)[1].step == 2


def test_a_run_saves_its_prompts_and_a_second_run_resumes(tiny_checkpoint, data, tmp_path, capsys):
    whole, halves = tmp_path / "whole.prompts", tmp_path / "halves.prompts"
    assert finetune(tiny_checkpoint, data, whole, "--steps", "4") == 0
    assert finetune(tiny_checkpoint, data, halves, "--steps", "2") == 0
    _, info, moments = load_prompts(halves)
    assert (info.model, info.method, info.step, info.tokens) == (str(tiny_checkpoint), "deep_ptune", 2, 2)
    assert set(moments) == {f"adam.{n}.{k}" for n in ("input", "deep") for k in ("exp_avg", "exp_avg_sq")}
    assert finetune(tiny_checkpoint, data, halves, "--steps", "4") == 0
    assert "resuming" in capsys.readouterr().err
    resumed, info, _ = load_prompts(halves)
    straight, _, _ = load_prompts(whole)
    assert info.step == 4
    for (name, a), (_, b) in zip(resumed.named_parameters(), straight.named_parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0, msg=name)
    # another method into the same file is refused rather than mixed
    assert finetune(tiny_checkpoint, data, halves, "--steps", "5", "--method", "ptune") == 2
    assert "use another --out" in capsys.readouterr().err


def generated(checkpoint, *extra: str, capsys) -> str:
    assert main(["generate", "--model", str(checkpoint), "--prompt", "The sky is", "--max-new-tokens", "6",
                 "--temperature", "0", "--ignore-eos", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)["text"]


@pytest.fixture(scope="module")
def trained(tiny_checkpoint, tmp_path_factory):
    """Prompts trained hard enough (3 steps at lr 0.5) to change the tiny model's greedy text."""
    folder = tmp_path_factory.mktemp("trained")
    data = folder / "data.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    assert finetune(tiny_checkpoint, data, folder / "p.prompts", "--steps", "3", "--lr", "0.5") == 0
    return folder / "p.prompts"


def test_generate_runs_the_trained_prompts_first(tiny_checkpoint, trained, capsys):
    capsys.readouterr()
    plain = generated(tiny_checkpoint, capsys=capsys)
    prompted = generated(tiny_checkpoint, "--prompts", str(trained), capsys=capsys)
    assert prompted != plain


@pytest.mark.parametrize("policy", [
    {"weights": {"disk": 1}, "kv_cache": {"cpu": 1}},  # every block streamed from disk
    {"weights": {"cpu": 1}, "kv_cache": {"cpu": 1}, "kv_cache_mode": "recompute"},  # block inputs kept, K/V redone
])
def test_prompts_run_through_the_local_plan(tiny_checkpoint, trained, tmp_path, capsys, policy):
    capsys.readouterr()
    expected = generated(tiny_checkpoint, "--prompts", str(trained), capsys=capsys)  # the planner's: all resident
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"weight_format": "fp32", **policy}))
    assert main(["generate", "--model", str(tiny_checkpoint), "--prompt", "The sky is", "--max-new-tokens", "6",
                 "--temperature", "0", "--ignore-eos", "--json", "--prompts", str(trained), "--plan", str(plan)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["text"] == expected
    engine, on_disk = doc["plan"]["engine"], "disk" in policy["weights"]
    assert engine["disk_blocks"] == ([0, 1] if on_disk else [])
    assert (doc["bytes_streamed"] > 0) == on_disk
    assert engine["kv_cache_mode"] == policy.get("kv_cache_mode", "keep")


# long enough to be prefilled as one padded group, beginning alike (prefilled once for the group, after the prompts)
API_PROMPTS = ("The sky over the quiet northern valley is", "The sky over the quiet northern valley was green and",
               "The sky over the quiet northern valley looks grey at")


def test_the_api_decodes_prompted_requests_together(tiny_checkpoint, trained, capsys):
    """Requests sent at once to `api --prompts` start together in the continuous batcher (one prefill group, their
    common beginning prefilled once), each row starting with the prompts' K/V, and each reply equals the prompted
    model's own greedy run (the one-request-at-a-time path)."""
    from hivekeeper.core.cli.api import open_server
    from hivekeeper.core.cli.main import build_parser
    from hivekeeper.core.runtime.continuous import ContinuousBatcher
    from hivekeeper.core.runtime.generation import generate

    args = build_parser().parse_args(["api", "--model", str(tiny_checkpoint), "--port", "0", "--prompts",
                                      str(trained)])
    api = open_server(args, None)
    service, engine = api.service, api.service.engine
    expected = [generate(service.runner.model, service.tokenizer.encode(p), max_new_tokens=6,
                         tokenizer=service.tokenizer).texts[0] for p in API_PROMPTS]
    thread = threading.Thread(target=api.serve_forever, daemon=True)
    thread.start()
    replies: dict[str, tuple] = {}

    def ask(prompt: str) -> None:
        connection = http.client.HTTPConnection("127.0.0.1", api.port, timeout=60)
        connection.request("POST", "/v1/completions", json.dumps(
            {"model": str(tiny_checkpoint), "prompt": prompt, "max_tokens": 6, "temperature": 0}).encode(),
            {"Content-Type": "application/json"})
        response = connection.getresponse()
        replies[prompt] = (response.status, json.loads(response.read()))
        connection.close()

    try:
        assert isinstance(engine, ContinuousBatcher)
        askers = [threading.Thread(target=ask, args=(p,)) for p in API_PROMPTS]
        with engine.hold():
            for asker in askers:
                asker.start()
            deadline = time.monotonic() + 60
            while engine.waiting < len(API_PROMPTS) and time.monotonic() < deadline:
                time.sleep(0.01)
        for asker in askers:
            asker.join(60)
    finally:
        api.shutdown()
        api.server_close()
        service.close()
        thread.join(60)
    assert engine.stats.largest_batch == engine.stats.largest_prefill == len(API_PROMPTS)
    assert engine.stats.shared_tokens > 0
    for prompt, text in zip(API_PROMPTS, expected):
        status, doc = replies[prompt]
        assert status == 200, doc
        assert doc["choices"][0]["text"] == text, prompt
    capsys.readouterr()


def test_prompts_of_another_model_are_refused(tiny_checkpoint, data, tmp_path, capsys):
    from hivekeeper.core.finetune.prompts import PromptsInfo, TrainablePrompts, save_prompts

    out = tmp_path / "other.prompts"
    save_prompts(out, TrainablePrompts("ptune", 2, 32, 2), PromptsInfo("other", "ptune", 2, 32, 2))
    assert main(["generate", "--model", str(tiny_checkpoint), "--prompt", "hi", "--prompts", str(out)]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and f"{out}:" in error and "hidden size 32" in error


def test_a_prompt_that_leaves_no_room_after_the_trained_prompts_names_the_prompts_file(tiny_checkpoint, tmp_path,
                                                                                         capsys):
    """The tiny model's context is 2048 tokens: a prompt of about 1900 fits alone but not after 200 trained prompt
    tokens, and the one-line refusal (exit 2) blames the prompts file and its tokens, not max_position_embeddings."""
    from hivekeeper.core.finetune.prompts import PromptsInfo, TrainablePrompts, save_prompts

    out = tmp_path / "long.prompts"
    save_prompts(out, TrainablePrompts("ptune", 200, 64, 2), PromptsInfo("tiny", "ptune", 200, 64, 2))
    capsys.readouterr()
    assert main(["generate", "--model", str(tiny_checkpoint), "--prompt", "a " * 1900, "--prompts", str(out)]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and error.startswith(f"hivekeeper generate: error: {out}: ")
    assert "its 200 trained prompt tokens" in error and "context of 2048 tokens" in error
    assert "shorten --prompt to 1847 tokens or fewer" in error and "max_position_embeddings" not in error
