"""`hivekeeper serve` on a TCP port a running server already listens on: refused (exit 2, one line naming the port)
before any daemon starts, and the first server keeps serving. p2pd listens with SO_REUSEPORT, so without the check
both daemons would share the port.

The refused commands run through the CLI's main() in this process (what they print is read at the file
descriptors, so a daemon's output would show too): they must stop before torch loads, and a process of its own for
each only added its interpreter's start. The first server is a real SwarmServer with its own p2pd in this process.
"""

from __future__ import annotations

import pytest
import torch

from hivekeeper.core.cli.main import main
from hivekeeper.core.swarm.dht import dht_prefix_for

from .client.servers import InProcessServers

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


def hivekeeper(capfd, *args: str) -> tuple[int, str, str]:
    """`hivekeeper ARGS` through the CLI's main(): its exit code, and what it wrote to stdout and stderr."""
    capfd.readouterr()
    code = main(list(args))
    out, err = capfd.readouterr()
    return code, out, err


def _port_of(maddr: str) -> int:
    parts = maddr.split("/")  # /ip4/127.0.0.1/tcp/PORT/p2p/PEER
    return int(parts[parts.index("tcp") + 1])


def _local_greedy(checkpoint, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    from hivekeeper.core.runtime.checkpoint import load_config, load_embedding, load_head, load_span
    from hivekeeper.core.runtime.model import KVCache

    layers = load_config(checkpoint).num_layers
    span, embedding, head = load_span(checkpoint, 0, layers), load_embedding(checkpoint), load_head(checkpoint)
    cache = KVCache.allocate(span.config, layers, 1, prompt.shape[1] + new_tokens)
    tokens, hidden = [], embedding(prompt)
    with torch.inference_mode():
        for _ in range(new_tokens):
            next_ids = head(span(hidden, cache))[:, -1].argmax(-1)
            tokens.append(next_ids)
            hidden = embedding(next_ids[:, None])
    return torch.stack(tokens, dim=1)


def test_serve_on_a_port_in_use_is_refused_and_the_first_server_keeps_serving(tiny_checkpoint, capfd):
    from hivekeeper.core.swarm.client.inference import SwarmModel

    servers = InProcessServers(tiny_checkpoint, dht_prefix_for(str(tiny_checkpoint)))
    try:
        first = servers.running[servers.start((0, 2), "first", throughput=10.0)][0]
        port = _port_of(first.maddrs[0])
        for host in ("127.0.0.1", "0.0.0.0"):  # the same address, and every interface (which includes it)
            code, out, err = hivekeeper(capfd, "serve", "--model", str(tiny_checkpoint), "--new-swarm", "--host",
                                        host, "--port", str(port), "--json-status")
            lines = [line for line in err.splitlines() if line.strip()]
            assert code == 2, err
            assert len(lines) == 1 and f"port {port}" in lines[0] and "in use" in lines[0], err
            assert out == ""  # no status line: nothing was started
        # a server asked to join the swarm on that port is refused the same way
        code, _, err = hivekeeper(capfd, "serve", "--model", str(tiny_checkpoint), "--initial-peers", *first.maddrs,
                                  "--host", "127.0.0.1", "--port", str(port))
        assert code == 2 and str(port) in err

        assert not servers.running[first.peer_id][1].done() and len(servers.running) == 1  # still serving
        prompt = torch.tensor([[1, 17, 42, 99, 7]])
        with SwarmModel(str(tiny_checkpoint), initial_peers=first.maddrs) as model:
            assert torch.equal(model.generate(prompt, 6), _local_greedy(tiny_checkpoint, prompt, 6))
    finally:
        servers.close()


def test_a_bad_host_or_port_is_one_line_before_anything_starts(tiny_checkpoint, capfd):
    for flags, words in ((["--host", "localhost"], "--host 'localhost' is not an IPv4 address"),
                         (["--host", "127.0.0.1", "--port", "70000"], "--port 70000: use 1 to 65535")):
        code, _, err = hivekeeper(capfd, "serve", "--model", str(tiny_checkpoint), "--new-swarm", *flags)
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1 and words in lines[0], err
