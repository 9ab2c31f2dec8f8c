"""`hivekeeper models list` and `models rm` over tmp folders laid out as the Hugging Face cache, our models folder,
Ollama's (manifests -> blobs) and LM Studio's: small real GGUF files written with the gguf package, read in place;
rm deletes from ours and the HF cache only, and refuses (exit 2, saying why) for the other apps' models."""

from __future__ import annotations

import hashlib
import json
import os

import gguf
import numpy as np
import pytest

from hivekeeper.core.cli.main import main
from hivekeeper.core.runtime.default_model import DEFAULT_MODEL_ID, default_model_file

HIDDEN, FFN, VOCAB = 64, 128, 96


def write_gguf(path, kind: gguf.GGMLQuantizationType, vocab: int = VOCAB) -> os.PathLike:
    """A one-block llama GGUF whose matrices are stored as `kind` (F16 or Q8_0), with no tokenizer (`vocab` rows
    of embedding: 96000 make a 12 MB F16 file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in {"block_count": 1, "embedding_length": HIDDEN, "feed_forward_length": FFN,
                       "attention.head_count": 4, "attention.head_count_kv": 2, "context_length": 256}.items():
        writer.add_uint32(f"llama.{key}", value)
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (vocab, HIDDEN), "blk.0.attn_q.weight": (HIDDEN, HIDDEN),
              "blk.0.attn_k.weight": (HIDDEN // 2, HIDDEN), "blk.0.attn_v.weight": (HIDDEN // 2, HIDDEN),
              "blk.0.attn_output.weight": (HIDDEN, HIDDEN), "blk.0.ffn_gate.weight": (FFN, HIDDEN),
              "blk.0.ffn_up.weight": (FFN, HIDDEN), "blk.0.ffn_down.weight": (HIDDEN, FFN)}
    for name, shape in shapes.items():
        data = rng.standard_normal(shape).astype(np.float32)
        if kind == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, data.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)
    for name in ("output_norm.weight", "blk.0.attn_norm.weight", "blk.0.ffn_norm.weight"):
        writer.add_tensor(name, np.ones(HIDDEN, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def library(tmp_path, monkeypatch):
    """Every folder the library reads, in tmp_path, holding one model each (the HF cache: a small GGUF repo and a
    huge checkpoint given by its config only)."""
    Q8, F16 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F16
    ours, hub, ollama, lmstudio = (tmp_path / n for n in ("ours", "hub", "ollama", "lmstudio"))
    for env, folder in (("HIVEKEEPER_MODELS_DIR", ours), ("HF_HUB_CACHE", hub), ("OLLAMA_MODELS", ollama),
                        ("HIVEKEEPER_LMSTUDIO_DIRS", lmstudio)):
        monkeypatch.setenv(env, str(folder))
    files = {"ours": write_gguf(ours / "tiny-f16.gguf", F16),
             "lmstudio": write_gguf(lmstudio / "someone" / "tiny-GGUF" / "tiny-Q8_0.gguf", Q8)}
    files["hf"] = hf_gguf_repo(hub, "org/tiny-GGUF", write_gguf(tmp_path / "hf.gguf", Q8))
    hf_config_repo(hub, "org/huge", {"model_type": "llama", "hidden_size": 32768, "intermediate_size": 131072,
                                     "num_hidden_layers": 400, "num_attention_heads": 256, "vocab_size": 256000,
                                     "torch_dtype": "bfloat16"})
    (lmstudio / "someone" / "broken-GGUF").mkdir(parents=True)
    (lmstudio / "someone" / "broken-GGUF" / "broken.gguf").write_bytes(b"GGUF" + bytes(12))  # truncated
    files["ollama"] = ollama_model(ollama, "tiny", "latest", write_gguf(tmp_path / "ollama.gguf", Q8))
    return tmp_path, files


def hf_gguf_repo(hub, repo_id: str, source) -> os.PathLike:
    """An HF cache repository as huggingface_hub lays it out: the file in blobs/, linked from a snapshot."""
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    blob = repo / "blobs" / hashlib.sha256(source.read_bytes()).hexdigest()
    blob.parent.mkdir(parents=True)
    source.rename(blob)
    snapshot = repo / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "tiny-Q8_0.gguf").symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    return blob


def hf_config_repo(hub, repo_id: str, config: dict) -> None:
    snapshot = hub / ("models--" + repo_id.replace("/", "--")) / "snapshots" / ("b" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(config))
    (snapshot / "model.safetensors").write_bytes(b"")


def ollama_model(root, name: str, tag: str, source) -> os.PathLike:
    """A model pulled by Ollama: its manifest names the GGUF blob by digest."""
    digest = hashlib.sha256(source.read_bytes()).hexdigest()
    blob = root / "blobs" / f"sha256-{digest}"
    blob.parent.mkdir(parents=True)
    source.rename(blob)
    manifest = root / "manifests" / "registry.ollama.ai" / "library" / name / tag
    manifest.parent.mkdir(parents=True)
    layers = [{"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}",
               "size": blob.stat().st_size},
              {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "0" * 64, "size": 10}]
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": layers}))
    return blob


def listed(capsys, *flags: str) -> dict[str, dict]:
    assert main(["models", "list", "--json", *flags]) == 0
    return {row["id"]: row for row in json.loads(capsys.readouterr().out)}


def test_list_finds_every_source_read_in_place_with_format_quantization_and_fit(library, capsys):
    _, files = library
    rows = listed(capsys)
    expected = {"tiny-f16.gguf": ("hivekeeper", files["ours"], "F16"),
                "org/tiny-GGUF": ("hf-cache", None, "Q8_0"),
                "ollama:tiny:latest": ("ollama", files["ollama"], "Q8_0"),
                "lmstudio:someone/tiny-GGUF/tiny-Q8_0.gguf": ("lmstudio", files["lmstudio"], "Q8_0")}
    for model_id, (source, path, quant) in expected.items():
        row = rows[model_id]
        assert (row["source"], row["format"], row["quantization"]) == (source, "gguf", quant)
        assert row["fit"] == "fits here", row
        if path is not None:  # read in place: the row points at the file itself, never a copy
            assert row["path"] == str(path) and row["size_bytes"] == path.stat().st_size
    # the repository's files: the blob and refs/main (40 bytes); the snapshot's link is not counted again
    assert rows["org/tiny-GGUF"]["size_bytes"] == files["hf"].stat().st_size + 40
    huge = rows["org/huge"]
    assert (huge["format"], huge["quantization"]) == ("safetensors", "bfloat16")
    assert huge["fit"] in ("needs the swarm", "too large"), huge
    assert [r["removable"] for r in rows.values() if r["source"] in ("ollama", "lmstudio", "bundled")] == \
        [False] * sum(r["source"] in ("ollama", "lmstudio", "bundled") for r in rows.values())
    broken = rows["lmstudio:someone/broken-GGUF/broken.gguf"]  # listed, without what cannot be read
    assert (broken["quantization"], broken["fit"]) == ("?", "?") and "broken.gguf" in broken["fit_reason"]
    assert (DEFAULT_MODEL_ID in rows) == (default_model_file() is not None)


# a 1.1B llama given by its config only: its chat plan here is bound by the RAM read rate, which its reason names
MID_CONFIG = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
              "num_attention_heads": 32, "num_key_value_heads": 4, "vocab_size": 32000, "torch_dtype": "bfloat16",
              "max_position_embeddings": 2048}
MEASURED_RAM_READ = 34.1e9  # B/s: no detection estimates it (the suite's fixed profile says 10 GB/s, as estimates may)


def measure_here(folder, measured_machine, monkeypatch) -> None:
    """This machine measured in the config `folder` (the suite's fixed profile, its RAM read MEASURED_RAM_READ),
    and HIVEKEEPER_CONFIG_DIR pointing at it."""
    path = measured_machine(folder)
    doc = json.loads(path.read_text())
    for measurement in doc["measurements"]:
        if measurement["key"] == "ram_read":
            measurement["value"], measurement["samples"] = MEASURED_RAM_READ, [MEASURED_RAM_READ]
    path.write_text(json.dumps(doc))
    monkeypatch.setenv("HIVEKEEPER_CONFIG_DIR", str(folder))


def test_fits_are_planned_on_the_measured_machine_as_plan_plans_it(library, measured_machine, monkeypatch, cli):
    """A newcomer's report: after `measure`, `models list` judged fits from the detection's estimates (RAM read
    "at 10 GB/s") while `plan` used the measured 34.1 GB/s. Both plan on this machine's saved profile now."""
    tmp_path, _ = library
    measure_here(tmp_path / "config", measured_machine, monkeypatch)
    hf_config_repo(tmp_path / "hub", "org/mid", MID_CONFIG)
    row = {r["id"]: r for r in json.loads(cli("models", "list", "--json").stdout)}["org/mid"]
    plan = json.loads(cli("plan", "--model", row["path"], "--no-measure", "--json").stdout)
    assert row["fit_reason"] == plan["reason"] and "at 34.1 GB/s" in row["fit_reason"], (row, plan)


def test_list_prints_a_table(library, capsys):
    assert main(["models", "list", "--no-fit"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:4] == ["ID", "SOURCE", "FORMAT", "QUANT"]
    line = next(line for line in out if line.startswith("ollama:tiny:latest"))
    assert "Q8_0" in line and "ollama" in line and line.endswith(str(library[1]["ollama"]))


def test_rm_deletes_from_our_folder_and_the_hf_cache(library, capsys):
    tmp_path, files = library
    assert main(["models", "rm", "tiny-f16.gguf"]) == 0
    assert main(["models", "rm", "org/tiny-GGUF"]) == 0
    assert "removed org/tiny-GGUF" in capsys.readouterr().out
    assert not files["ours"].exists()
    assert not (tmp_path / "hub" / "models--org--tiny-GGUF").exists()
    rows = listed(capsys, "--no-fit")
    assert "tiny-f16.gguf" not in rows and "org/tiny-GGUF" not in rows and "org/huge" in rows
    assert [p.name for p in (tmp_path / "hub").iterdir()] == ["models--org--huge"]  # nothing left aside


@pytest.mark.parametrize("model_id, says", [("ollama:tiny:latest", "ollama rm tiny:latest"),
                                            ("lmstudio:someone/tiny-GGUF/tiny-Q8_0.gguf", "LM Studio"),
                                            ("no/such-model", "no model")])
def test_rm_refuses_other_apps_models_and_unknown_ids(library, capsys, model_id, says):
    _, files = library
    before = {name: path.read_bytes() for name, path in files.items() if name in ("ollama", "lmstudio")}
    assert main(["models", "rm", model_id]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1
    assert {name: files[name].read_bytes() for name in before} == before
