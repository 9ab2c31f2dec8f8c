"""Issue 22 item 1: a GGUF bigger than the RAM budget holds it. The real default model's file (SmolLM2-135M-Instruct,
Q4_1 blocks and a tied Q8_0 embedding, ~98 MB) is run by `hivekeeper generate --prompts-file` in a child process
under a budget of two thirds of the file: the plan sizes blocks and head by their packed bytes (an fp32 sizing
refused this budget: the fp32 embedding alone is 113 MB), the weights are read with pread so that no page of the
file's memory map stays in the process, the peak RSS (the child's VmHWM, read from outside) stays within budget +
10% over the runtime's baseline, and the greedy text equals the run with every block in RAM.
"""

from __future__ import annotations

import functools

import pytest
import torch

from hivekeeper.core.offload.local_plan import fallback_policy
from hivekeeper.core.offload.offloaded_model import OffloadedModel
from hivekeeper.core.offload.packed_stream import PackedBlockReader, PackedEmbedding, load_outside
from hivekeeper.core.offload.placement import place_model
from hivekeeper.core.runtime.checkpoint import load_embedding
from hivekeeper.core.runtime.default_model import INSTALL_HINT, default_model_file
from hivekeeper.core.runtime.generation import generate
from hivekeeper.core.runtime.gguf import GGUFCheckpoint
from hivekeeper.core.runtime.model import RotaryTable

from .test_bigger_than_ram import PROMPTS, generate_batch

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(default_model_file() is None,
                                 reason=f"the default model is not installed ({INSTALL_HINT})")]

NEW_TOKENS = 5  # generate_batch's --max-new-tokens


@pytest.mark.slow
@pytest.mark.parametrize("file_share, disk_blocks", [(1 / 1.5, 5), (1.0, 1)])
def test_a_gguf_bigger_than_the_budget_holds_it_and_gives_the_resident_text(tmp_path, file_share, disk_blocks):
    """At two thirds of the file and at the file's size the planner finds a plan of its own ("auto"): it counts the
    packed head and embedding as the engine holds them (costmodel.outside_bytes; counted in fp32, 113 MB where the
    engine holds 30, it found none at 0.5-1.0x the file and the run fell back to streaming what RAM cannot hold)."""
    path = default_model_file()
    budget = round(path.stat().st_size * file_share)
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("\n".join(PROMPTS) + "\n")

    report, peak = generate_batch(path, prompts_file, "--ram-budget-gb", f"{budget / 1e9:.4f}")
    engine = report["plan"]["engine"]
    assert report["plan"]["source"] == "auto", report["plan"]["reason"]
    assert report["plan"]["policy"]["weight_format"] == "q4_1"
    assert report["batch"] == len(PROMPTS) and engine["blocks"].get("disk", 0) >= disk_blocks
    assert engine["ram_bytes"] <= budget
    checkpoint = GGUFCheckpoint(path)
    head = checkpoint.stored_bytes("model.embed_tokens.weight")  # tied: the head's Q8_0 bytes serve the lookups
    assert engine["ram_breakdown"]["embedding_and_head"] == head + 4 * checkpoint.config.hidden_size
    assert peak - report["baseline_rss_bytes"] <= 1.1 * budget, (peak, report["baseline_rss_bytes"],
                                                                 engine["ram_breakdown"])
    assert report["texts"] == resident_texts(path) and len(set(report["texts"])) > 1


@functools.cache
@torch.inference_mode()
def resident_texts(path) -> list[str]:
    checkpoint = GGUFCheckpoint(path)
    tokenizer = checkpoint.tokenizer()
    plan = place_model(checkpoint.config, fallback_policy("fp32", len(PROMPTS)), device="cpu", dtype=torch.float32,
                       batch=len(PROMPTS), max_length=32)
    assert plan.streamed_blocks == ()
    with OffloadedModel(path, plan) as model:
        result = generate(model, [tokenizer.encode(p) for p in PROMPTS], max_new_tokens=NEW_TOKENS,
                          tokenizer=tokenizer, ignore_eos=True)
    return result.texts


def test_the_packed_embedding_looks_up_the_rows_the_fp32_embedding_holds():
    """The tied embedding kept as the head's Q8_0 rows gives, for any ids, exactly the dequantized fp32 rows."""
    path = default_model_file()
    checkpoint = GGUFCheckpoint(path)
    reader = PackedBlockReader(checkpoint, RotaryTable(checkpoint.config))
    try:
        embedding, head = load_outside(reader)
    finally:
        reader.close()
    assert isinstance(embedding, PackedEmbedding)
    assert embedding.packed.data_ptr() == head.lm_head.packed.data_ptr()  # shared, not a second copy
    ids = torch.tensor([[0, 1, 49151, 7], [3000, 3000, 12, 42]])
    assert torch.equal(embedding(ids), load_embedding(path)(ids))
