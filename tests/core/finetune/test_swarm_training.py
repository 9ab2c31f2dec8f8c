"""Training prompts through a loopback swarm (issue 21): the tiny demo model (fp32) served by three in-process servers
with their own p2pds on 127.0.0.1: `first` serves block 0, `second` and `spare` block 1 (`spare` claims a speed a
million times lower, so routes take `second` while it lives).

- The loss and the gradients of soft and deep prompts through rpc_forward / rpc_backward equal those of the same
  blocks run here, within 1e-5.
- A server killed between two steps makes the next step fail; the step is redone on the spare server, no step is
  lost or counted twice: the prompts after 5 steps equal those of an uninterrupted local run.
"""

from __future__ import annotations

import json

import pytest
import torch

from hivekeeper.core.finetune.blocks import local_blocks, swarm_blocks
from hivekeeper.core.finetune.data import read_examples
from hivekeeper.core.finetune.prompts import PromptsInfo, TrainablePrompts
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


def test_generate_through_the_swarm_with_ptune_prompts_equals_local(parts, tiny_checkpoint, servers, tmp_path,
                                                                   capsys):
    from hivekeeper.core.cli.main import main
    from hivekeeper.core.finetune.prompts import save_prompts

    ptune, deep = tmp_path / "ptune.prompts", tmp_path / "deep.prompts"
    for path, method in ((ptune, "ptune"), (deep, "deep_ptune")):
        info = PromptsInfo("tiny", method, 3, parts.config.hidden_size, parts.config.num_layers)
        save_prompts(path, new_prompts(parts, method), info)
    common = ["generate", "--model", str(tiny_checkpoint), "--prompt", "The sky is", "--max-new-tokens", "6",
              "--temperature", "0", "--ignore-eos", "--json"]
    swarm = ["--swarm", "--initial-peers", *servers.initial_peers, "--dht-prefix", PREFIX]
    texts = []
    for extra in ([], swarm):
        assert main([*common, "--prompts", str(ptune), *extra]) == 0
        texts.append(json.loads(capsys.readouterr().out)["text"])
    assert texts[0] == texts[1]
    assert main([*common, "--prompts", str(deep), *swarm]) == 2
    assert "deep_ptune prompts run locally" in capsys.readouterr().err


def trainer(parts, blocks, examples, steps: int = 5) -> Trainer:
    prompts = new_prompts(parts)
    info = PromptsInfo("tiny", "deep_ptune", 3, parts.config.hidden_size, parts.config.num_layers)
    return Trainer(parts, blocks, prompts, info, examples, TrainConfig(steps=steps, lr=0.05, batch=2))


def test_a_server_killed_mid_training_loses_no_step(parts, examples, tiny_checkpoint, blocks_through, servers,
                                                    tmp_path):
    reference = trainer(parts, local_blocks(tiny_checkpoint), examples)
    reference.run(tmp_path / "local.prompts")
    through = trainer(parts, blocks_through, examples)
    killed = []

    def kill_after_step_2(report) -> None:
        if report.step == 2:
            killed.append(blocks_through.last_route[1][0])
            servers.leave(killed[0])

    reports = through.run(tmp_path / "swarm.prompts", on_step=kill_after_step_2)
    assert [r.step for r in reports] == [1, 2, 3, 4, 5]
    assert [(f["step"], f["peer"]) for f in through.failovers] == [(3, killed[0])]
    assert reports[2].redone == 1 and blocks_through.last_route[1][0] != killed[0]
    for name, param in reference.prompts.named_parameters():
        torch.testing.assert_close(dict(through.prompts.named_parameters())[name], param, atol=1e-4, rtol=0)
