"""The frozen blocks as one differentiable function: blocks(hidden, deep_prompts) -> hidden.

`LocalBlocks` runs a Span here (autograd through the blocks, exactly what a server runs: server.handler.run_blocks).
`SwarmBlocks` sends the same work through the swarm: forward hop by hop with rpc_forward (each server gets its
blocks' slice of the deep prompts), keeping each hop's input; backward in reverse with rpc_backward, which returns
the gradients of the hop's input and of its prompts. Nothing is trained on the servers; only the gradients of the
client's prompts (and of the hidden states, which carry them to the soft input prompts) come back.

A server that fails (no answer, an error, a bad answer) is banned and raises HopFailed; the trainer then redoes the
whole step on a new route (trainer.py), so no step is lost or half-applied.
"""

from __future__ import annotations

import asyncio

import torch
from torch import Tensor

from hivekeeper.core.swarm.client.inference import SwarmClient, SwarmError
from hivekeeper.core.swarm.client.routing import Hop, NoRoute, route_forward
from hivekeeper.core.swarm.server.handler import run_blocks


class HopFailed(ConnectionError):
    """A server failed during a forward or backward (it is banned); the step should be redone."""

    def __init__(self, peer_id: str, blocks: tuple[int, int], cause: BaseException):
        self.peer_id, self.blocks = peer_id, blocks
        super().__init__(f"server ...{peer_id[-8:]} (blocks {blocks[0]}:{blocks[1]}) failed: "
                         f"{str(cause).splitlines()[0] if str(cause) else type(cause).__name__}")


class LocalBlocks:
    """All blocks of a Span, run here."""

    where = "local"

    def __init__(self, span):
        self.span = span

    def __call__(self, hidden: Tensor, deep: Tensor | None) -> Tensor:
        return run_blocks(self.span, hidden, None, deep)


class SwarmBlocks:
    """All blocks of the model, through the swarm's rpc_forward / rpc_backward."""

    where = "swarm"

    def __init__(self, client: SwarmClient, num_blocks: int):
        self.client, self.num_blocks = client, num_blocks
        self.network_s = 0.0  # seconds spent waiting on servers (compute there + transfer), for the benchmark
        self.last_route: list[tuple[str, int, int]] = []  # (peer, start, end) of the last forward's hops
        self._refresh = False

    def refresh(self) -> None:
        """Read the swarm again before the next forward (after a failure)."""
        self._refresh = True

    def __call__(self, hidden: Tensor, deep: Tensor | None) -> Tensor:
        return _ThroughSwarm.apply(hidden, deep, self)

    def forward_trace(self, hidden: Tensor, deep: Tensor | None) -> tuple[Tensor, list]:
        """(output, [(hop, its input, its prompts)]): a forward over a new route."""
        refresh, self._refresh = self._refresh, False
        return self.client.run(self._forward(hidden.detach().float(), None if deep is None else deep.detach(),
                                             refresh))

    def backward_trace(self, trace: list, grad: Tensor) -> tuple[Tensor, Tensor | None]:
        """(gradient of the input, of the deep prompts or None) from the gradient of the output."""
        return self.client.run(self._backward(trace, grad.detach().float()))

    async def _forward(self, hidden: Tensor, deep: Tensor | None, refresh: bool) -> tuple[Tensor, list]:
        try:
            hops = route_forward(await self.client.spans(refresh), 0, self.num_blocks,
                                 banned=self.client.bans.banned)
        except NoRoute as exc:
            raise SwarmError(str(exc)) from None
        trace, x = [], hidden
        self.last_route = [(hop.peer_id, hop.start, hop.end) for hop in hops]
        for hop in hops:
            part = None if deep is None else deep[hop.start:hop.end].contiguous()
            y = await self._on(hop, self.client.forward_hop(hop, x, part))
            trace.append((hop, x, part))
            x = y.float()
        return x, trace

    async def _backward(self, trace: list, grad: Tensor) -> tuple[Tensor, Tensor | None]:
        parts = []
        for hop, x, part in reversed(trace):
            grad, grad_part = await self._on(hop, self.client.backward_hop(hop, x, grad, part))
            parts.append(grad_part)
        deep = None if trace[0][2] is None else torch.cat(parts[::-1])
        return grad, deep

    async def _on(self, hop: Hop, call):
        """Await one server's answer; its failure bans it and becomes HopFailed."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            return await call
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.client.bans.fail(hop.peer_id)
            raise HopFailed(hop.peer_id, (hop.start, hop.end), exc) from exc
        finally:
            self.network_s += loop.time() - started


class _ThroughSwarm(torch.autograd.Function):
    """Autograd over SwarmBlocks: forward keeps the hops' inputs, backward asks the same servers for gradients."""

    @staticmethod
    def forward(ctx, hidden: Tensor, deep: Tensor | None, blocks: SwarmBlocks) -> Tensor:
        output, ctx.trace = blocks.forward_trace(hidden, deep)
        ctx.blocks, ctx.dtype = blocks, hidden.dtype
        return output.to(hidden.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad_hidden, grad_deep = ctx.blocks.backward_trace(ctx.trace, grad)
        return grad_hidden.to(ctx.dtype), grad_deep, None


def local_blocks(path) -> LocalBlocks:
    """Every block of the checkpoint, here, in fp32 (a GGUF's linears dequantized: autograd needs plain weights)."""
    from hivekeeper.core.runtime.checkpoint import load_config, load_span

    config = load_config(path)
    return LocalBlocks(load_span(path, 0, config.num_layers, dtype=torch.float32, packed=False))


def swarm_blocks(model: str, num_blocks: int, initial_peers, dht_prefix: str | None = None) -> SwarmBlocks:
    """The blocks of `model` through the swarm at initial_peers (close with .client.close())."""
    from hivekeeper.core.swarm.client.inference import ClientConfig
    from hivekeeper.core.swarm.dht import dht_prefix_for

    client = SwarmClient(ClientConfig(tuple(initial_peers), dht_prefix_for(model, dht_prefix), num_blocks))
    return SwarmBlocks(client, num_blocks)
