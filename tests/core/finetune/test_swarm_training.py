"""Training prompts through a loopback swarm (issue 21): the tiny demo model (fp32) served by five in-process servers
with their own p2pds on 127.0.0.1: `first` serves block 0, `second`, `spare`, `spare-2` and `spare-3` block 1 (the
spares claim a speed a million times lower, so routes take `second` while it lives). Two tests kill the server of
block 1 they use, and one needs two servers of block 1, in any order.

- The loss and the gradients of soft and deep prompts through rpc_forward / rpc_backward equal those of the same
  blocks run here, within 1e-5.
- Generating with trained prompts (ptune, and deep_ptune, whose per-block prompts each server gets in its session's
  first step) gives the local run's tokens, also when the server of block 1 is killed mid-generation (the
  replacement is sent the prompts with the replay), and when another server spot-checks every step (its referee
  session is sent them too).
- A server killed between two steps makes the next step fail; the step is redone on the spare server, no step is
  lost or counted twice: the prompts after 5 steps equal those of an uninterrupted local run.
"""

from __future__ import annotations

import json

import pytest
import torch

from hivekeeper.core.finetune.blocks import local_blocks, swarm_blocks
from hivekeeper.core.finetune.data import read_examples
from hivekeeper.core.finetune.prompts import PromptsInfo, TrainablePrompts, save_prompts
from hivekeeper.core.finetune.trainer import TrainConfig, Trainer, batch_loss, load_frozen_parts
from hivekeeper.core.runtime.tokenizer import load_tokenizer

from ..swarm.client.servers import InProcessServers

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

PREFIX = "finetune-test"
PAIRS = [("The sky is", " blue and wide."), ("Grass is", " green in spring."), ("Snow is", " white and cold."),
         ("The sun is", " bright at noon.")]


@pytest.fixture(scope="module")
def servers(tiny_checkpoint):
    swarm = InProcessServers(tiny_checkpoint, PREFIX)
    try:
        swarm.start((0, 1), "first")
        swarm.start((1, 2), "second", throughput=1.0)
        swarm.start((1, 2), "spare", throughput=1e-6)
        # two tests kill a server of block 1 and one needs two of them (route and referee): in any order, enough
        swarm.start((1, 2), "spare-2", throughput=1e-6)
        swarm.start((1, 2), "spare-3", throughput=1e-6)
        yield swarm
    finally:
        swarm.close()


@pytest.fixture(scope="module")
def examples(tiny_checkpoint, tmp_path_factory):
    data = tmp_path_factory.mktemp("finetune") / "pairs.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n" for p, c in PAIRS))
    return read_examples(data, load_tokenizer(tiny_checkpoint), 100)


@pytest.fixture(scope="module")
def parts(tiny_checkpoint):
    return load_frozen_parts(tiny_checkpoint)


@pytest.fixture
def blocks_through(servers, tiny_checkpoint):
    blocks = swarm_blocks(str(tiny_checkpoint), 2, servers.initial_peers, PREFIX)
    yield blocks
    blocks.client.close()


def new_prompts(parts, method: str = "deep_ptune") -> TrainablePrompts:
    prompts = TrainablePrompts(method, 3, parts.config.hidden_size, parts.config.num_layers)
    prompts.start_from_vocabulary(parts.embedding.weight, seed=1)
    if prompts.deep is not None:  # not the zeros training starts from: their gradients must flow either way
        with torch.no_grad():
            prompts.deep.normal_(0, 0.05, generator=torch.Generator().manual_seed(2))
    return prompts


def loss_and_gradients(parts, blocks, prompts, examples):
    prompts.zero_grad(set_to_none=True)
    loss, _ = batch_loss(parts, blocks, prompts, examples)
    loss.backward()
    return loss.item(), {name: p.grad.clone() for name, p in prompts.named_parameters()}


@pytest.mark.parametrize("method", ["deep_ptune", "ptune"])
def test_gradients_through_the_swarm_equal_local_ones(parts, examples, tiny_checkpoint, blocks_through, servers,
                                                      method):
    prompts = new_prompts(parts, method)
    local_loss, local_grads = loss_and_gradients(parts, local_blocks(tiny_checkpoint), prompts, examples)
    swarm_loss, swarm_grads = loss_and_gradients(parts, blocks_through, prompts, examples)
    assert [start for _, start, _ in blocks_through.last_route] == [0, 1]  # two servers, each its slice of prompts
    assert abs(local_loss - swarm_loss) < 1e-5
    assert set(swarm_grads) == ({"input", "deep"} if method == "deep_ptune" else {"input"})
    for name, grad in local_grads.items():
        assert grad.abs().max() > 1e-4, name  # a real gradient, not zeros on both sides
        torch.testing.assert_close(swarm_grads[name], grad, atol=1e-5, rtol=0)


def saved_prompts(parts, method: str, path, deep_scale: float = 0.05):
    prompts = new_prompts(parts, method)
    if prompts.deep is not None:  # large enough that a server without them answers other tokens
        with torch.no_grad():
            prompts.deep.mul_(deep_scale / 0.05)
    save_prompts(path, prompts, PromptsInfo("tiny", method, 3, parts.config.hidden_size, parts.config.num_layers))
    return path


@pytest.mark.parametrize("method", ["ptune", "deep_ptune"])
def test_generate_through_the_swarm_with_prompts_equals_local(parts, tiny_checkpoint, servers, tmp_path, capsys,
                                                              method):
    from hivekeeper.core.cli.main import main

    path = saved_prompts(parts, method, tmp_path / f"{method}.prompts", deep_scale=1.0)
    common = ["generate", "--model", str(tiny_checkpoint), "--prompt", "The sky is", "--max-new-tokens", "6",
              "--temperature", "0", "--ignore-eos", "--json", "--prompts", str(path)]
    swarm = ["--swarm", "--initial-peers", *servers.initial_peers, "--dht-prefix", PREFIX]
    runs = []
    for extra in ([], swarm):
        assert main([*common, *extra]) == 0
        runs.append(json.loads(capsys.readouterr().out))
    assert runs[0]["text"] == runs[1]["text"]
    assert runs[1]["failovers"] == []


def greedy_ids(model, prompt_ids: list[int], new_tokens: int, after_token=None) -> list[int]:
    """Greedy tokens of a runner (embedding, span, head), one step per token; after_token(i, cache) after each."""
    cache = model.span.allocate_cache(1, len(prompt_ids) + new_tokens)
    ids, chosen = torch.tensor([prompt_ids]), []
    with torch.inference_mode():
        for i in range(new_tokens):
            ids = model.head(model.span(model.embedding(ids), cache))[:, -1].argmax(-1, keepdim=True)
            chosen.append(int(ids[0, 0]))
            if after_token is not None:
                after_token(i, cache)
    cache.close()
    return chosen


def test_a_server_killed_mid_generation_with_deep_prompts_keeps_the_tokens(parts, tiny_checkpoint, servers,
                                                                          tmp_path):
    from hivekeeper.core.finetune.prompted import local_prompted_model, swarm_prompted_model
    from hivekeeper.core.offload.local_plan import plan_local_run
    from hivekeeper.core.offload.offloaded_model import OffloadedModel
    from hivekeeper.core.swarm.client.inference import SwarmModel

    path = saved_prompts(parts, "deep_ptune", tmp_path / "deep.prompts", deep_scale=1.0)
    prompt = load_tokenizer(tiny_checkpoint).encode("Grass is")
    _, plan = plan_local_run("auto", tiny_checkpoint, parts.config, batch=1, prompt_len=8, max_new_tokens=10,
                             max_length=24)
    local, _ = local_prompted_model(OffloadedModel(tiny_checkpoint, plan), path)
    expected = greedy_ids(local, prompt, 10)
    swarm_model = SwarmModel(str(tiny_checkpoint), initial_peers=servers.initial_peers, dht_prefix=PREFIX)
    model, _ = swarm_prompted_model(swarm_model, path)
    killed = []

    def kill_block_1_server(i: int, cache) -> None:
        if i == 2:
            killed.append(cache.inner.route[1][0])
            servers.leave(killed[0])

    try:
        assert greedy_ids(model, prompt, 10, kill_block_1_server) == expected
        failovers, checks = swarm_model.client.failovers, swarm_model.client.spot_check_log
    finally:
        model.close()
    local.close()
    assert [(f["peer_id"], f["blocks"], f["replayed_tokens"]) for f in failovers] == [(killed[0], [1, 2],
                                                                                         3 + len(prompt) + 2)]
    replacement = failovers[0]["new_route"][0][0]
    # the replacement's outputs, prompts' positions included, agree with the client's own run of block 1 with them
    assert any(c["peer_id"] == replacement and c["checked_positions"][0] == 0 and c["ok"] for c in checks)
    assert all(c["ok"] for c in checks)


def trainer(parts, blocks, examples, steps: int = 5) -> Trainer:
    prompts = new_prompts(parts)
    info = PromptsInfo("tiny", "deep_ptune", 3, parts.config.hidden_size, parts.config.num_layers)
    return Trainer(parts, blocks, prompts, info, examples, TrainConfig(steps=steps, lr=0.05, batch=2))


def test_a_server_killed_mid_training_loses_no_step(parts, examples, tiny_checkpoint, blocks_through, servers,
                                                    tmp_path):
    reference = trainer(parts, local_blocks(tiny_checkpoint), examples)
    reference.run(tmp_path / "local.prompts")
    # The server every step routes to until it is killed: "second" may be gone already (the generation test kills
    # it), and among servers of equal throughput a route is drawn at random, so the killed one might not be drawn
    # again; the others claim 1 or 1e-6.
    preferred = servers.start((1, 2), "preferred-for-training", throughput=1e6)
    through = trainer(parts, blocks_through, examples)
    killed = []

    def kill_after_step_2(report) -> None:
        if report.step == 2:
            killed.append(blocks_through.last_route[1][0])
            servers.leave(killed[0])

    reports = through.run(tmp_path / "swarm.prompts", on_step=kill_after_step_2)
    assert [r.step for r in reports] == [1, 2, 3, 4, 5]
    assert killed == [preferred]
    assert [(f["step"], f["peer"]) for f in through.failovers] == [(3, killed[0])]
    assert reports[2].redone == 1 and blocks_through.last_route[1][0] != killed[0]
    for name, param in reference.prompts.named_parameters():
        torch.testing.assert_close(dict(through.prompts.named_parameters())[name], param, atol=1e-4, rtol=0)


def test_remote_spot_checks_of_deep_prompted_steps_agree(parts, tiny_checkpoint, servers, tmp_path):
    """Every step checked by another server of the same blocks (no local referee): the referee's session is sent the
    deep prompts with the positions they cover, so it agrees, nobody is banned and the tokens are the local run's."""
    from hivekeeper.core.finetune.prompted import local_prompted_model, swarm_prompted_model
    from hivekeeper.core.offload.local_plan import plan_local_run
    from hivekeeper.core.offload.offloaded_model import OffloadedModel
    from hivekeeper.core.swarm.client.inference import SwarmModel

    path = saved_prompts(parts, "deep_ptune", tmp_path / "deep.prompts", deep_scale=1.0)
    prompt = load_tokenizer(tiny_checkpoint).encode("Snow is")
    _, plan = plan_local_run("auto", tiny_checkpoint, parts.config, batch=1, prompt_len=8, max_new_tokens=6,
                             max_length=24)
    local, _ = local_prompted_model(OffloadedModel(tiny_checkpoint, plan), path)
    expected = greedy_ids(local, prompt, 6)
    local.close()
    swarm_model = SwarmModel(str(tiny_checkpoint), initial_peers=servers.initial_peers, dht_prefix=PREFIX,
                             spot_check_rate=1.0, spot_check_local_blocks=0)
    model, _ = swarm_prompted_model(swarm_model, path)
    try:
        assert greedy_ids(model, prompt, 6) == expected
        failovers, checks = swarm_model.client.failovers, swarm_model.client.spot_check_log
    finally:
        model.close()
    assert failovers == []
    block_1 = [c for c in checks if c["blocks"] == [1, 2]]
    assert block_1 and block_1[0]["checked_positions"] == [0, 3] and block_1[0]["referee"] != "local"
    assert all(c["ok"] and "second_referee" not in c for c in checks)  # no dispute either
