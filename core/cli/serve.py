"""`hivekeeper serve`: serve a span of a model's blocks to a swarm (Petals-compatible).

Prints the multiaddrs to share (other nodes pass them as --initial-peers) and each status change; with
--json-status every status change is one JSON line on stdout (for the GUI), logs go to stderr.

A fixed --port that something already listens on is refused before any daemon starts: libp2p listens with
SO_REUSEPORT, so a second p2pd would share the port with the first, and peers dialling either would reach either.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hivekeeper.core.cli.serve_config import apply_config
from hivekeeper.core.swarm.server.pause import add_pause_arguments
from hivekeeper.planner.errors import InputError


DEFAULT_STATS_PERIOD_S = 60.0  # a running server says what it has served this often unless told otherwise


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="hub id (org/name), local checkpoint folder, GGUF file (or a folder holding "
                        "one), or smollm2-135m-instruct (the installed default model); required, here or in --config")
    parser.add_argument("--config", metavar="FILE", help="a JSON object of these flags without the dashes (e.g. "
                        '{"model": "...", "new-swarm": true}); flags given here win over the file')
    swarm = parser.add_mutually_exclusive_group()
    swarm.add_argument("--new-swarm", action="store_true", help="start a new private swarm")
    swarm.add_argument("--initial-peers", nargs="+", metavar="MADDR", default=[],
                       help="multiaddrs of peers of the swarm to join (default: the public Petals swarm's bootstrap "
                            "peers, or HIVEKEEPER_BOOTSTRAP_PEERS when set)")
    span = parser.add_mutually_exclusive_group()
    span.add_argument("--num-blocks", type=int, help="serve this many blocks, chosen where the swarm is weakest "
                      "(the server also rebalances later)")
    span.add_argument("--block-indices", metavar="A:B", help="serve exactly blocks A..B-1 (no rebalancing)")
    parser.add_argument("--dht-prefix", help="the model's name in the swarm (default: Petals' convention for a hub "
                        "id, the folder name for a local checkpoint)")
    parser.add_argument("--quant", default="none", choices=("none", "int8", "nf4"), help="weight quantization")
    parser.add_argument("--dtype", default="auto", help="fp32, bf16 or fp16 (auto: on a GPU the checkpoint's 16-bit "
                        "dtype; on a CPU bf16 where it multiplies bf16 natively and `hivekeeper measure` found a bf16 "
                        "decode step faster than fp32, else fp32; fp32 for a GGUF whose blocks stay packed and with "
                        "--quant int8/nf4)")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N (auto: cuda when present)")
    parser.add_argument("--public-name", help="a name shown to the swarm (e.g. a link or nickname)")
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (127.0.0.1 for loopback only)")
    parser.add_argument("--port", type=int, default=0, help="TCP port to listen on (0 = any free port); a port in "
                        "use is refused")
    parser.add_argument("--announce-maddrs", nargs="+", default=[], metavar="MADDR",
                        help="public multiaddrs to announce when behind a port forward")
    parser.add_argument("--json-status", action="store_true", help="one JSON line per status change on stdout")
    parser.add_argument("--throughput", default="auto",
                        help="auto (measure once, cached), eval (measure again) or a number of requests/s")
    parser.add_argument("--network-mbps", type=float,
                        help="your link speed in Mbit/s (min of up and down); advertised as network_rps")
    parser.add_argument("--cache-tokens", type=int, help="KV cache pool size in tokens (default 4096, 16384 "
                        "for grouped-query models)")
    parser.add_argument("--max-length", type=int, default=None, help="most tokens per inference session "
                        "(default 2048, 8192 for grouped-query models)")
    parser.add_argument("--max-sessions", type=int, default=16, help="most concurrent inference sessions")
    parser.add_argument("--max-request-mib", type=float, default=64.0, help="largest request in MiB")
    parser.add_argument("--step-timeout", type=float, default=300.0, help="seconds a session may idle between steps")
    parser.add_argument("--session-timeout", type=float, default=1800.0, help="seconds a session may last")
    parser.add_argument("--update-period", type=float, default=60.0, help="seconds between re-announcements")
    parser.add_argument("--balance-period", type=float, default=120.0,
                        help="seconds between rebalancing checks (with --num-blocks; 0 = never move)")
    parser.add_argument("--balance-quality", type=float, default=0.75,
                        help="move when min throughput before / after moving is below this")
    parser.add_argument("--stats-period", type=float, default=DEFAULT_STATS_PERIOD_S,
                        help=f"print a stats line (open sessions, requests served, cache left) this often, seconds "
                             f"(default {DEFAULT_STATS_PERIOD_S:g}; 0 = never)")
    parser.add_argument("--torch-threads", type=int,
                        help="torch's CPU threads (default: 1, with fp32 matmuls on numpy's BLAS over every core)")
    add_pause_arguments(parser)  # pause conditions and resource limits (issue 20)


def _parse_block_indices(text: str) -> tuple[int, int]:
    try:
        start, end = (int(part) for part in text.split(":"))
    except ValueError:
        raise InputError(f"--block-indices {text!r}: expected A:B, e.g. 0:8") from None
    if not 0 <= start < end:
        raise InputError(f"--block-indices {text!r}: need 0 <= A < B")
    return start, end


def check_listen_address(host: str, port: int) -> None:
    """Refuse, before any daemon starts, a --host that is not an IPv4 address and a fixed --port that cannot be
    listened on (in use, or not allowed). A plain bind tells: it fails where a listener holds the port, even one
    that shares it with SO_REUSEPORT as p2pd's do. SO_REUSEADDR keeps a port whose old connections linger in
    TIME_WAIT usable, as it is for the daemon."""
    import errno
    import ipaddress
    import socket

    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        raise InputError(f"--host {host!r} is not an IPv4 address (0.0.0.0: every interface, 127.0.0.1: this "
                         "machine only)") from None
    if not 0 <= port <= 65535:
        raise InputError(f"--port {port}: use 1 to 65535, or 0 for any free port")
    if port == 0:
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise InputError(f"--port {port}: TCP port {port} on {host} is already in use (another server?); "
                                 "choose another port, or --port 0 for any free one") from None
            raise InputError(f"--port {port}: cannot listen on {host}:{port} ({exc.strerror})") from None


def _check_positive(name: str, value, allow_zero: bool = False) -> None:
    if value is not None and (value < 0 or (value == 0 and not allow_zero)):
        raise InputError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value}")


def default_num_blocks(checkpoint: Path, model_config, dtype, device: str, quant: str, cache_tokens: int,
                       limit_gib: float | None = None) -> tuple[int, str]:
    """(how many blocks to serve, their format in words: 'q4_1 packed', 'fp32'): the planner's swarm sizing for this
    machine as the server loads the model (format_choice.plan_model_server: a GGUF's span packed on a CPU, sized by
    the file's bytes per block), capped by what fits in 80% of the device's free memory right now (each block at
    the bytes it will be held in, with its share of the KV cache in the dtype actually used)."""
    import psutil
    import torch

    from hivekeeper.core.machine.cpu_dtype import dtype_name
    from hivekeeper.core.runtime.model import KVCache
    from hivekeeper.core.swarm.server.pause import memory_budget

    if device.startswith("cuda"):
        free, _total = torch.cuda.mem_get_info(torch.device(device))
    else:
        free = psutil.virtual_memory().available
    free = memory_budget(free, limit_gib)  # --max-ram-gib / --max-gpu-gib
    plan = planned_span(checkpoint, dtype, device, quant, cache_tokens)
    if plan is not None and plan.packed:
        per_block, words = plan.block_bytes, f"{plan.weight_format} packed"
    else:
        bits = {"none": torch.empty((), dtype=dtype).element_size() * 8, "int8": 8.02, "nf4": 4.13}[quant]
        per_block, words = model_config.block_param_count() * bits / 8, dtype_name(dtype) if quant == "none" else quant
    per_block += KVCache.nbytes_for(model_config, 1, 1, cache_tokens, dtype)
    fits = min(model_config.num_layers, int(0.8 * free // per_block))
    if plan is not None:
        fits = min(fits, plan.num_blocks)
    if fits < 1:
        raise InputError(f"not even one block of this model fits in the free memory of {device} "
                         f"({free / 2**30:.1f} GiB); free memory, use --quant, or give --num-blocks")
    return fits, words


def planned_span(checkpoint: Path, dtype, device: str, quant: str, cache_tokens: int):
    """The planner's ServerPlan for this machine and model as load_span will hold it (packed where a GGUF's span
    runs on the CPU in fp32 and the runtime packs), or None when the planner cannot size it (said on stderr)."""
    import torch

    from hivekeeper.core.machine.profiles import detect_or_load_profile
    from hivekeeper.planner.format_choice import packed_by_default, plan_model_server

    packs = device == "cpu" and dtype == torch.float32 and packed_by_default()
    try:
        hardware, efficiency = detect_or_load_profile()
        return plan_model_server(str(checkpoint), hardware, quant, cache_tokens=cache_tokens, efficiency=efficiency,
                                 runtime_packs=packs)
    except InputError as exc:  # the planner cannot size this model/machine: the free-memory bound alone
        print(f"hivekeeper serve: planner sizing unavailable ({exc}); using free memory", file=sys.stderr)
        return None


def auto_dtype(model_config, device: str, checkpoint: Path, quant: str = "none") -> tuple[torch.dtype, str]:
    """--dtype auto: (the torch dtype a server computes in, why in words). On a GPU the checkpoint's 16-bit dtype
    (bf16 where it stores none). On a CPU the planner's server rule (swarm.choose_server_format's
    cpu_bf16_at(machine.acc, 1)) as the engine decides it: cpu_dtype.sixteen_bit_choice at one row and no plan, bf16
    where the CPU multiplies bf16 natively and a measured bf16 decode step beat fp32's, else fp32. fp32 regardless
    where the runtime keeps a GGUF's blocks packed (on a CPU in fp32 only; format_choice.plan_model_server plans that
    span packed) and beside --quant int8/nf4 weights (the measured step is of unquantized blocks)."""
    import torch

    from hivekeeper.core.machine.cpu_dtype import sixteen_bit_choice
    from hivekeeper.planner.format_choice import gguf_packed_type, packed_by_default
    from hivekeeper.planner.gguf_metadata import is_gguf

    if device != "cpu":
        stored = (model_config.torch_dtype or "").replace("torch.", "")
        if stored in ("float16", "bfloat16"):
            return getattr(torch, stored), "the checkpoint's own 16-bit dtype"
        return torch.bfloat16, "the checkpoint stores no 16-bit dtype: bf16 on a GPU"
    if quant != "none":
        return torch.float32, f"--quant {quant}: the blocks' unquantized parts in fp32 on a CPU"
    packed = gguf_packed_type(str(checkpoint)) if is_gguf(checkpoint) and packed_by_default() else None
    if packed is not None:
        return torch.float32, (f"the GGUF's {packed} blocks stay packed, multiplied by the CPU's kernels in fp32 "
                               f"(HIVEKEEPER_GGUF_PACKED=0 dequantizes them)")
    choice = sixteen_bit_choice()
    # a server's steps multiply a few rows (one per session), as the planner prices them; no plan of its own
    return (torch.bfloat16 if choice.at(1) == "bf16" else torch.float32), choice.reason


def run(args: argparse.Namespace) -> int:
    args = apply_config(args, add_arguments)  # --config FILE: the node service's flags (core/cli/serve_config.py)
    from hivekeeper.core.swarm.bootstrap import any_reachable, bootstrap_peers, is_unreachable_error, \
        unreachable_message

    if not args.new_swarm and not args.initial_peers:
        args.initial_peers = list(bootstrap_peers())  # the public swarm (core/swarm/bootstrap.py)
    if not args.new_swarm and not any_reachable(args.initial_peers):  # in a second, before torch loads
        raise InputError(unreachable_message(args.initial_peers))
    import asyncio

    import torch

    from hivekeeper.core.machine.cpu_dtype import dtype_name
    from hivekeeper.core.runtime.checkpoint import load_config, parse_dtype, resolve_checkpoint
    from hivekeeper.core.swarm.contribution import (ContributionLedger, contribution_path, counting_status,
                                                    serving_power)
    from hivekeeper.core.swarm.dht import check_initial_peers, dht_prefix_for
    from hivekeeper.core.swarm.server.handler import ServingLimits
    from hivekeeper.core.swarm.protocol import new_event_loop
    from hivekeeper.core.swarm.server.pause import apply_limits, owner_watch, read_commands, resource_limits
    from hivekeeper.core.swarm.server.server import ServerConfig, SwarmServer

    for name in ("num_blocks", "max_sessions", "step_timeout", "session_timeout", "update_period",
                 "max_request_mib", "cache_tokens", "max_length", "torch_threads"):
        _check_positive("--" + name.replace("_", "-"), getattr(args, name))
    for name in ("balance_period", "stats_period", "network_mbps"):
        _check_positive("--" + name.replace("_", "-"), getattr(args, name), allow_zero=True)
    if not 0 < args.balance_quality <= 1:
        raise InputError(f"--balance-quality must be in (0, 1], got {args.balance_quality}")
    throughput: str | float = args.throughput
    if throughput not in ("auto", "eval"):
        try:
            throughput = float(throughput)
        except ValueError:
            raise InputError(f"--throughput {args.throughput!r}: use auto, eval or a number") from None
        _check_positive("--throughput", throughput, allow_zero=True)
    block_indices = _parse_block_indices(args.block_indices) if args.block_indices else None
    check_listen_address(args.host, args.port)
    initial_peers = check_initial_peers(args.initial_peers)  # before a model is planned and loaded

    _setup_logging(args.json_status)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    else:
        from hivekeeper.core.offload.offloaded_model import use_physical_cores

        use_physical_cores()
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InputError(f"--device {device}: CUDA is not available on this machine")
    limits = resource_limits(args)
    apply_limits(limits, device)

    # a hub id: the config and index now, a span's shards when the server has chosen the span (SwarmServer._load)
    checkpoint = resolve_checkpoint(args.model, blocks=block_indices or (0, 0), embeddings=False)
    model_config = load_config(checkpoint)
    dtype, why = auto_dtype(model_config, device, checkpoint, args.quant) if args.dtype == "auto" \
        else (parse_dtype(args.dtype), "")
    grouped = model_config.num_kv_heads < model_config.num_heads
    cache_tokens = args.cache_tokens or (16384 if grouped else 4096)
    max_length = min(args.max_length or (8192 if grouped else 2048), model_config.max_position_embeddings)
    num_blocks = args.num_blocks
    if num_blocks is None and block_indices is None:
        num_blocks, words = default_num_blocks(checkpoint, model_config, dtype, device, args.quant, cache_tokens,
                                               limits.gpu_gib if device.startswith("cuda") else limits.ram_gib)
        chosen = f"; --dtype auto: {dtype_name(dtype)}, {why}" if why else ""
        print(f"Serving {num_blocks} blocks, {words} (planned for this machine's memory{chosen})",
              file=sys.stderr if args.json_status else sys.stdout, flush=True)
    is_local = Path(args.model).expanduser().is_dir()
    config = ServerConfig(
        checkpoint=checkpoint,
        dht_prefix=dht_prefix_for(args.model, args.dht_prefix),
        repository=None if is_local else args.model,
        initial_peers=initial_peers,
        host=args.host,
        port=args.port,
        announce_maddrs=tuple(args.announce_maddrs),
        num_blocks=num_blocks,
        block_indices=block_indices,
        dtype=dtype,
        device=device,
        quant=args.quant,
        public_name=args.public_name,
        throughput=throughput,
        network_bps=args.network_mbps * 1e6 if args.network_mbps else None,
        cache_tokens=cache_tokens,
        limits=ServingLimits(max_length=max_length, max_sessions=args.max_sessions,
                             max_request_bytes=int(args.max_request_mib * 2**20), step_timeout=args.step_timeout,
                             session_timeout=args.session_timeout),
        update_period=args.update_period,
        balance_period=args.balance_period,
        balance_quality=args.balance_quality,
        stats_period=args.stats_period,
    )
    printer = _json_printer if args.json_status else _human_printer
    # what this node serves adds up across restarts in the data folder (`hivekeeper node stats`)
    ledger = ContributionLedger(contribution_path(), serving_power(device))
    server = SwarmServer(config, status=counting_status(ledger, lambda: server.handler, printer),
                         pause_watch=owner_watch(args))

    async def main() -> None:
        server.install_signals()
        if args.control_stdin:  # the app's Pause 1 h / Resume
            loop = asyncio.get_running_loop()
            read_commands(sys.stdin, lambda command: loop.call_soon_threadsafe(server.command, command))
        await server.run()

    try:
        if hasattr(asyncio, "Runner"):  # Python 3.11+: serve on the swarm's (uvloop) event loop
            with asyncio.Runner(loop_factory=new_event_loop) as runner:
                runner.run(main())
        else:
            asyncio.run(main())
    except InputError as exc:  # nobody at the initial peers answered: one line that says so, not the daemon's log
        if is_unreachable_error(str(exc)):
            raise InputError(unreachable_message(config.initial_peers)) from None
        raise
    return 1 if server.error else 0


def _setup_logging(json_status: bool) -> None:
    import logging

    ours = logging.getLogger("hivekeeper")
    if not any(getattr(h, "_hivekeeper_serve", False) for h in ours.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
        handler._hivekeeper_serve = True
        ours.addHandler(handler)
    ours.setLevel(logging.INFO)
    # hivemind logs every failed handler with a traceback; bad requests are expected, we log them in one line
    logging.getLogger("hivemind.p2p.p2p_daemon").setLevel(logging.ERROR)


def _json_printer(event: dict) -> None:
    print(json.dumps(event), flush=True)


def _human_printer(event: dict) -> None:
    line = human_status_line(event)
    if line:
        print(line, flush=True)


def human_status_line(event: dict) -> str:
    """A status event in words (several lines for "started"); "online" and "stats" lines count the open sessions
    and the requests served so far."""
    state = event["state"]
    if state == "started":
        return (f"Peer {event['peer_id']} is up. Other nodes join this swarm with:\n"
                "  --initial-peers " + " ".join(event["maddrs"]))
    blocks = event.get("blocks")
    where = f" blocks {blocks[0]}:{blocks[1]} of {event['num_model_blocks']}" if blocks else ""
    line = f"[{state}] {event['dht_prefix']}{where}"
    if state in ("online", "stats"):
        source = f" ({event['throughput_source']})" if state == "online" and event.get("throughput_source") else ""
        line += (f", throughput {event['throughput']:.1f} rps{source}, {event['sessions']} open sessions, "
                 f"{event.get('requests_served', 0)} requests served ({event.get('tokens_served', 0)} tokens), "
                 f"{event['cache_tokens_left']} cache tokens left")
    if state == "moving":
        line += f" -> {event['to_blocks'][0]}:{event['to_blocks'][1]}"
    return line
