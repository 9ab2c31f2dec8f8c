"""Interoperability with a real Petals peer: Hivekeeper servers and clients against Petals 2.2 ones, on 127.0.0.1.

Needs a separate virtualenv with Petals ($PETALS_VENV, by default petals-venv beside the repository's folder;
docs/swarm.md says how to build it); without one it prints a JSON line saying it was skipped and why. With it, on
a 4-block demo model:

    petals_client->hivekeeper_server   Petals' client generates through one `hivekeeper serve` (blocks 0:4), and
                                       runs a forward without a cache (rpc_forward) whose logits are compared
    hivekeeper_client->petals_server   our SwarmModel generates through one Petals server (blocks 0:4)
    mixed_swarm                        a Petals server (0:2) and ours (2:4) in one swarm; both clients generate
    mixed_swarm_reversed               ours (0:2) then a Petals server (2:4); our client with server-to-server
                                       push (our server pushes to the Petals one), and Petals' client
    prompt_tuning_petals_client        Petals' client in deep_ptune mode takes one training step (loss, backward:
                                       rpc_forward and rpc_backward with deep prompts) through our server and
                                       through a Petals server; the losses and prompt gradients are compared
    beam_search_petals_client          Petals' client runs a 3-beam search (hypo_ids reorder the servers' caches)
                                       through our server and through a Petals server; the tokens are compared

Every generation is greedy and compared token by token with the same model run locally in this process.
Starts and stops every process itself (each in its own process group, so its p2pd goes too). Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from hivekeeper.core.runtime.checkpoint import load_embedding, load_head, load_span
from hivekeeper.core.runtime.demo_model import make_demo_checkpoint
from hivekeeper.core.runtime.model import KVCache
from hivekeeper.core.swarm.local import ServerProcess

LAYERS, NEW_TOKENS, PREFIX = 4, 12, "petals-interop"
CLIENT_TIMEOUT_S = 120
PROMPT = [1, 17, 42, 99, 7, 300, 5]
REPOSITORY = Path(__file__).resolve().parents[1]
PETALS_VENV = Path(os.environ.get("PETALS_VENV") or REPOSITORY.parent / "petals-venv")
PETALS_PYTHON = PETALS_VENV / "bin" / "python"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}

VERSIONS_CODE = """
import json, hivemind, petals, torch, transformers
print(json.dumps({"petals": petals.__version__, "hivemind": hivemind.__version__,
                  "transformers": transformers.__version__, "torch": torch.__version__}))
"""

# Scripts for the Petals venv: each loads the model with Petals' own client from the job in argv[1] (this preamble,
# with extra from_pretrained arguments), then prints "RESULT <json>".
PETALS_PREAMBLE = """
import json, sys, torch
from petals import AutoDistributedModelForCausalLM
job = json.loads(sys.argv[1])
torch.set_num_threads(1)
model = AutoDistributedModelForCausalLM.from_pretrained(job["model"], initial_peers=job["peers"],
                                                        dht_prefix=job["prefix"], torch_dtype=torch.float32{extra})
"""


def petals_script(body: str, extra_model_args: str = "") -> str:
    return PETALS_PREAMBLE.replace("{extra}", extra_model_args) + body


# greedy generation, then a forward without a session
PETALS_CLIENT_CODE = petals_script("""
ids = torch.tensor([job["prompt"]])
with torch.inference_mode():
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=job["new_tokens"],
                         do_sample=False, pad_token_id=0)
    result = {"new_ids": out[0, ids.shape[1]:].tolist()}
    if job.get("forward"):
        result["last_logits"] = model(ids).logits[0, -1].tolist()
print("RESULT " + json.dumps(result), flush=True)
""")


def skip(reason: str) -> None:
    print(json.dumps({"bench": "petals_interop", "skipped": True, "reason": reason}))


def petals_versions() -> dict:
    proc = subprocess.run([str(PETALS_PYTHON), "-c", VERSIONS_CODE], capture_output=True, text=True, env=ENV,
                          timeout=300)
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        raise RuntimeError(lines[-1] if lines else f"exit {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


class PetalsServer:
    """`python -m petals.cli.run_server` in the Petals venv, in its own process group."""

    def __init__(self, model: Path, log_path: Path, *, blocks: str, initial_peers: list[str] | None = None):
        join = ["--initial_peers", *initial_peers] if initial_peers else ["--new_swarm"]
        args = [str(PETALS_PYTHON), "-m", "petals.cli.run_server", str(model), *join, "--dht_prefix", PREFIX,
                "--block_indices", blocks, "--host_maddrs", "/ip4/127.0.0.1/tcp/0", "--device", "cpu",
                "--torch_dtype", "float32", "--throughput", "100",  # a number: no speed test (it goes online)
                "--skip_reachability_check", "--no_auto_relay", "--inference_max_length", "256",
                "--attn_cache_tokens", "1024", "--num_handlers", "2"]
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.popen = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, env=ENV,
                                      start_new_session=True)

    def wait_started(self, timeout: float = 180.0) -> list[str]:
        """Its multiaddrs, once it announced its blocks online."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.log_path.read_text(errors="replace")
            maddrs = re.search(r"Running a server on \[([^\]]*)\]", text)
            if maddrs and re.search(r"\] Started", text):
                return re.findall(r"'([^']+)'", maddrs.group(1))
            if self.popen.poll() is not None:
                raise RuntimeError(f"petals server exited with {self.popen.returncode}:\n{text[-2000:]}")
            time.sleep(0.5)
        raise TimeoutError(f"petals server did not start in {timeout:g}s")

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(20)
            except subprocess.TimeoutExpired:
                pass
        try:  # its handler processes and p2pd share the group
            os.killpg(self.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.popen.wait()
        self._log.close()


# Runs in the Petals venv: a prompt-tuning step (deep_ptune: a prompt before the input and one added inside every
# block, which the servers receive as the `prompts` tensor) -- loss, then backward through the servers
# (rpc_forward + rpc_backward), returning the prompts' gradients.
PETALS_PTUNE_CODE = petals_script("""
prompts, deep = model.transformer.prompt_embeddings, model.transformer.intermediate_prompt_embeddings
generator = torch.Generator().manual_seed(0)
with torch.no_grad():
    prompts.weight.copy_(torch.randn(prompts.weight.shape, generator=generator) * 0.5)
    deep.weight.copy_(torch.randn(deep.weight.shape, generator=generator) * 0.5)
ids = torch.tensor([job["prompt"]])
loss = model(input_ids=ids, labels=ids).loss
loss.backward()
print("RESULT " + json.dumps({"loss": loss.item(), "prompt_grad": prompts.weight.grad.flatten().tolist(),
                              "deep_grad": deep.weight.grad.flatten().tolist()}), flush=True)
""", ', tuning_mode="deep_ptune", pre_seq_len=job["pre_seq_len"]')
PRE_SEQ_LEN = 3

# Runs in the Petals venv: beam search, whose steps reorder the servers' caches with hypo_ids.
PETALS_BEAM_CODE = petals_script("""
ids = torch.tensor([job["prompt"]])
with torch.inference_mode():
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=job["new_tokens"], num_beams=3,
                         do_sample=False, pad_token_id=0)
print("RESULT " + json.dumps({"new_ids": out[0, ids.shape[1]:].tolist()}), flush=True)
""")


def our_server(model: Path, log_dir: Path, name: str, *args: str) -> ServerProcess:
    argv = ["--model", str(model), "--host", "127.0.0.1", "--dht-prefix", PREFIX, "--throughput", "100",
            "--torch-threads", "1", "--balance-period", "0", *args]
    server = ServerProcess(argv, {**ENV, "XDG_CACHE_HOME": str(log_dir / "cache")}, log_dir / f"{name}.log")
    server.wait_for("online", timeout=120)
    return server


def run_petals_client(model: Path, peers: list[str], forward: bool = False, code: str = PETALS_CLIENT_CODE) -> dict:
    job = {"model": str(model), "peers": peers, "prefix": PREFIX, "prompt": PROMPT, "new_tokens": NEW_TOKENS,
           "forward": forward, "pre_seq_len": PRE_SEQ_LEN}
    proc = subprocess.Popen([str(PETALS_PYTHON), "-c", code, json.dumps(job)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=CLIENT_TIMEOUT_S)
    except subprocess.TimeoutExpired:  # Petals retries forever; its p2pd is in the same group
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        stderr += f"\n(killed after {CLIENT_TIMEOUT_S}s)"
    try:  # anything it left behind (its p2pd) goes too
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    warnings = [line for line in stderr.splitlines() if "[WARN]" in line or "Error" in line]
    details = " | ".join(warnings[:3] + [stderr.strip()[-300:]])
    raise RuntimeError(f"petals client exited with {proc.returncode}: {details}")


def run_our_client(model: Path, peers: list[str], stats_of: str | None = None, use_push: bool = False) -> dict:
    """Greedy generation with our client; stats_of: a Hivekeeper server's peer id whose rpc_info stats to add;
    use_push: servers push each step's output to the next server of the chain."""
    from hivekeeper.core.swarm.client.inference import SwarmModel

    with SwarmModel(str(model), initial_peers=peers, dht_prefix=PREFIX, retry_seconds=20, use_push=use_push) as swarm:
        new_ids = swarm.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS)
        result = {"new_ids": new_ids[0].tolist()}
        if stats_of:
            _, info = swarm.client.run(swarm.client.ping(stats_of, timeout=10))
            result["hivekeeper_server_stats"] = info.get("hivekeeper_stats")
    return result


def local_reference(model: Path) -> tuple[list[int], torch.Tensor]:
    """Greedy new tokens and the last position's logits of the whole model run here."""
    span, embedding, head = load_span(model, 0, LAYERS), load_embedding(model), load_head(model)
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        last_logits = head(span(embedding(ids)))[0, -1]
        cache = KVCache.allocate(span.config, LAYERS, 1, len(PROMPT) + NEW_TOKENS)
        hidden, tokens = embedding(ids), []
        for _ in range(NEW_TOKENS):
            next_id = head(span(hidden, cache))[:, -1].argmax(-1)
            tokens.append(int(next_id))
            hidden = embedding(next_id[:, None])
    return tokens, last_logits


def attempt(results: dict, name: str, expected: list[int], run) -> None:
    """Run one direction; record whether it worked and whether its tokens equal the local ones."""
    started = time.perf_counter()
    try:
        out = run()
        results[name] = {"ok": True, "tokens_equal": out["new_ids"] == expected, "new_ids": out["new_ids"],
                         "seconds": round(time.perf_counter() - started, 2)}
        if "last_logits_diff" in out:
            results[name]["forward_max_abs_diff"] = out["last_logits_diff"]
        if "hivekeeper_server_stats" in out:
            results[name]["hivekeeper_server_stats"] = out["hivekeeper_server_stats"]
    except Exception as exc:
        results[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[-1500:],
                         "seconds": round(time.perf_counter() - started, 2)}
        traceback.print_exc(file=sys.stderr)


def compare_tuning(ours: dict, theirs: dict) -> dict:
    """The same prompt-tuning step through our server and a Petals server: loss and gradients side by side."""
    diffs = {key: float((torch.tensor(ours[key]) - torch.tensor(theirs[key])).abs().max())
             for key in ("prompt_grad", "deep_grad")}
    scale = max(float(torch.tensor(theirs[key]).abs().max()) for key in diffs)
    return {"loss_ours": ours["loss"], "loss_petals": theirs["loss"], "grad_max_abs_diff": diffs,
            "grad_max_abs": scale, "equal_within_1e-4": abs(ours["loss"] - theirs["loss"]) <= 1e-4 * max(
                1.0, abs(theirs["loss"])) and all(d <= 1e-4 * max(1.0, scale) for d in diffs.values())}


def main() -> None:
    if not PETALS_PYTHON.exists():
        skip(f"no Petals virtualenv at {PETALS_VENV} (set PETALS_VENV; see docs/swarm.md)")
        return
    try:
        versions = petals_versions()
    except Exception as exc:
        skip(f"Petals does not import in {PETALS_VENV}: {exc}")
        return
    torch.set_num_threads(1)
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="petals-interop-") as tmp:
        tmp = Path(tmp)
        model = make_demo_checkpoint(tmp / PREFIX, layers=LAYERS)
        expected, local_logits = local_reference(model)
        servers: list = []
        prompt_tuning: dict = {"error": "not run"}
        beam_search: dict = {"error": "not run"}

        def forward_checked(peers):
            out = run_petals_client(model, peers, forward=True)
            out["last_logits_diff"] = float((torch.tensor(out["last_logits"]) - local_logits).abs().max())
            return out

        try:
            ours = our_server(model, tmp, "hivekeeper-server", "--new-swarm", "--block-indices", f"0:{LAYERS}")
            servers.append(ours)
            attempt(results, "petals_client->hivekeeper_server", expected, lambda: forward_checked(ours.maddrs))
            tuning, beams = {}, {}
            try:
                tuning["ours"] = run_petals_client(model, ours.maddrs, code=PETALS_PTUNE_CODE)
            except Exception as exc:
                tuning["error_ours"] = f"{type(exc).__name__}: {exc}"[-1500:]
            try:
                beams["ours"] = run_petals_client(model, ours.maddrs, code=PETALS_BEAM_CODE)["new_ids"]
            except Exception as exc:
                beams["error_ours"] = f"{type(exc).__name__}: {exc}"[-1500:]
            ours.stop()

            theirs = PetalsServer(model, tmp / "petals-server.log", blocks=f"0:{LAYERS}")
            servers.append(theirs)
            attempt(results, "hivekeeper_client->petals_server", expected,
                    lambda: run_our_client(model, theirs.wait_started()))
            try:
                tuning["petals"] = run_petals_client(model, theirs.wait_started(), code=PETALS_PTUNE_CODE)
            except Exception as exc:
                tuning["error_petals"] = f"{type(exc).__name__}: {exc}"[-1500:]
            try:
                beams["petals"] = run_petals_client(model, theirs.wait_started(), code=PETALS_BEAM_CODE)["new_ids"]
            except Exception as exc:
                beams["error_petals"] = f"{type(exc).__name__}: {exc}"[-1500:]
            theirs.stop()
            beam_search = {**beams, "equal": "ours" in beams and beams.get("ours") == beams.get("petals")}
            if "ours" in tuning and "petals" in tuning:
                prompt_tuning = compare_tuning(tuning["ours"], tuning["petals"])
            else:
                prompt_tuning = {key: value for key, value in tuning.items() if key.startswith("error")}

            half = LAYERS // 2
            theirs = PetalsServer(model, tmp / "petals-server-mixed.log", blocks=f"0:{half}")
            servers.append(theirs)
            peers = theirs.wait_started()
            ours = our_server(model, tmp, "hivekeeper-server-mixed", "--initial-peers", *peers,
                              "--block-indices", f"{half}:{LAYERS}")
            servers.append(ours)
            attempt(results, "mixed_swarm:petals_client", expected, lambda: run_petals_client(model, peers))
            # our client does not push by default, so pushed steps on our server came from the Petals server
            attempt(results, "mixed_swarm:hivekeeper_client", expected,
                    lambda: run_our_client(model, peers, stats_of=ours.peer_id))
            theirs.stop()
            ours.stop()

            # the other order: ours first, so with use_push our server pushes each step to the Petals server
            ours = our_server(model, tmp, "hivekeeper-server-first", "--new-swarm", "--block-indices", f"0:{half}")
            servers.append(ours)
            theirs = PetalsServer(model, tmp / "petals-server-second.log", blocks=f"{half}:{LAYERS}",
                                  initial_peers=ours.maddrs)
            servers.append(theirs)
            theirs.wait_started()
            attempt(results, "mixed_swarm_reversed:hivekeeper_client_with_push", expected,
                    lambda: run_our_client(model, ours.maddrs, use_push=True))
            attempt(results, "mixed_swarm_reversed:petals_client", expected,
                    lambda: run_petals_client(model, ours.maddrs))
        finally:
            for server in reversed(servers):
                server.stop()
    print(json.dumps({
        "bench": "petals_interop", "skipped": False, "versions": {**versions, "hivekeeper_side": hivekeeper_versions()},
        "model": f"demo llama, {LAYERS} blocks, random weights, fp32", "prompt_ids": PROMPT, "local_new_ids": expected,
        "worked": sorted(name for name, r in results.items() if r["ok"]),
        "tokens_equal": all(r.get("tokens_equal", False) for r in results.values()),
        "directions": results,
        "prompt_tuning_petals_client": prompt_tuning,
        "beam_search_petals_client": beam_search,
    }))


def hivekeeper_versions() -> dict:
    import hivemind

    return {"hivemind": hivemind.__version__, "torch": torch.__version__}


if __name__ == "__main__":
    main()
