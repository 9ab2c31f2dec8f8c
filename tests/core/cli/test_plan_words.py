"""The words of `hivekeeper plan` for the built-in model on small machines, as a newcomer read them (session 24): an
empty "kept free" row with --reserve-gb 0, "cannot even hold the client side" for a 96 MB model on 1 GB of RAM that
the default headroom kept free, "DISK" in the reason under a row that writes "disk", and "only with the swarm" for a
plan that runs here with part of its weights on disk. Through `main()` (the `cli` fixture) with hardware files and
explicit sizes, so neither this machine's memory nor its speed decides what is planned."""

from __future__ import annotations

import json
import re

import pytest

from hivekeeper.planner.hardware_catalog import get_hardware, hardware_to_json

HINT = re.compile(r"With --reserve-gb ([\d.]+) \(")


@pytest.fixture
def small_machine(tmp_path):
    """A hardware file: cpu-generic with `ram_gb` of RAM, `in_use_gb` of it held by other programs."""
    def write(ram_gb: float, in_use_gb: float = 0.0) -> str:
        spec = hardware_to_json(get_hardware("cpu-generic"))
        spec["cpu"].update(ram_gb=ram_gb, **({"in_use_gb": in_use_gb} if in_use_gb else {}))
        path = tmp_path / f"machine-{ram_gb}-{in_use_gb}.json"
        path.write_text(json.dumps(spec))
        return str(path)
    return write


def plan(cli, *args: str, json_out: bool = False):
    done = cli("plan", "--no-measure", *args, *(("--json",) if json_out else ()))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout) if json_out else done.stdout


def row(text: str, name: str) -> str:
    """The value of the human table's row `name`."""
    match = re.search(rf"^  {re.escape(name)} +(.*)$", text, re.MULTILINE)
    assert match, text
    return match.group(1)


def test_reserve_zero_says_nothing_is_kept_free(cli):
    text = plan(cli, "--hardware", "cpu-generic", "--ram-gb", "1", "--reserve-gb", "0")
    assert row(text, "kept free") == "nothing (--reserve-gb 0)"
    given = plan(cli, "--hardware", "cpu-generic", "--ram-gb", "4", "--reserve-gb", "0.5")
    assert row(given, "kept free") == "RAM 0.5 GB (--reserve-gb 0.5)"  # no GPU row on a machine without one


def test_a_headroom_that_takes_the_ram_is_named_and_a_smaller_reserve_suggested(cli, small_machine):
    machine = small_machine(1.2)
    data = plan(cli, "--hardware", machine, json_out=True)
    assert data["fit"] == "none" and data["policy"] is None
    reason = data["reason"]
    assert "Of its 1.2 GB of RAM the plan keeps 1.2 GB free (the default headroom: the larger of 2 GiB" in reason
    assert "leaving nothing; the client side alone needs " in reason and "of it the runtime itself" in reason
    hint = HINT.search(reason)
    assert hint, reason
    assert 0 < float(hint.group(1)) < 1.2
    text = plan(cli, "--hardware", machine)
    assert f"why: {reason}" in text  # the table's why line is the JSON's reason
    followed = plan(cli, "--hardware", machine, "--reserve-gb", hint.group(1), json_out=True)
    assert followed["policy"] is not None and followed["policy"]["weights"]["disk"] == 0  # the advice holds


def test_ram_other_programs_hold_is_named_and_never_suggested_away(cli, small_machine):
    data = plan(cli, "--hardware", small_machine(1.2, in_use_gb=0.5), json_out=True)
    assert "plus 0.5 GB that other programs hold" in data["reason"]
    hint = HINT.search(data["reason"])
    assert hint is None or float(hint.group(1)) >= 0.5, data["reason"]
    crowded = plan(cli, "--hardware", small_machine(1.2, in_use_gb=1.0), json_out=True)
    assert crowded["fit"] == "none" and HINT.search(crowded["reason"]) is None  # only others' RAM is left to give


def test_an_explicit_reserve_says_what_it_leaves(cli):
    data = plan(cli, "--hardware", "cpu-generic", "--ram-gb", "0.3", "--reserve-gb", "0", json_out=True)
    assert data["fit"] == "none"
    assert "Of its 0.3 GB of RAM the plan keeps 0 GB free (--reserve-gb 0), leaving 0.3 GB" in data["reason"]
    assert HINT.search(data["reason"]) is None  # nothing kept free: a smaller reserve is no way out


def test_tier_names_have_one_casing(cli):
    text = plan(cli, "--hardware", "cpu-generic", "--ram-gb", "0.64", "--reserve-gb", "0")
    assert "disk" in row(text, "weights")
    why = text.split("\nwhy: ", 1)[1]
    assert "% disk" in why and "DISK" not in why


def test_a_plan_with_weights_on_disk_says_it_runs_here(cli):
    args = ("--hardware", "cpu-generic", "--ram-gb", "0.64", "--reserve-gb", "0")
    data = plan(cli, *args, json_out=True)
    disk = data["policy"]["weights"]["disk"]
    assert data["fit"] == "swarm" and 0 < disk < 0.5  # a local policy, and the swarm suggested
    fit = row(plan(cli, *args), "fit")
    assert fit.startswith(f"runs locally, streaming {100 * disk:.0f}% of the weights from disk at ")
    assert f"{data['decode_tokens_per_s']:.3g} tokens/s" in fit and "the swarm is suggested instead" in fit
    assert "only with the swarm" not in fit


def test_the_app_and_models_say_it_runs_here_too():
    """The app's fit line and `models`' fit column (planner.policy.fit_words) said "needs the swarm" for the same plan,
    which runs here at a local speed with part of its weights on disk."""
    from hivekeeper.core.cli.main import build_parser
    from hivekeeper.core.cli.plan import build_plan
    from hivekeeper.planner.policy import fit_words

    args = build_parser().parse_args(["plan", "--hardware", "cpu-generic", "--ram-gb", "0.64", "--reserve-gb", "0",
                                      "--no-measure"])
    found = build_plan(args)[0]
    disk = found.prediction.policy.weights.disk
    assert found.fit == "swarm" and fit_words(found) == f"runs here, {100 * disk:.0f}% streamed from disk; the swarm " \
                                                         "is suggested"


def test_a_cpu_plan_bound_by_fixed_costs_says_no_kernel_launches(cli, small_machine):
    """A newcomer (session 26) read "kernel launches per decode step" in a CPU-only plan's why: GPU words. A GPU plan
    keeps them."""
    data = plan(cli, "--hardware", small_machine(1.2), "--reserve-gb", "0.5", json_out=True)
    assert data["reason"].startswith("fixed overhead: 30 blocks × 1 micro-batch(es) of fixed costs (norms, rotary, "
                                     "calls) per decode step"), data["reason"]
    gpu = plan(cli, "--hardware", "t4", json_out=True)
    assert gpu["reason"].startswith("fixed overhead: 30 blocks × 1 micro-batch(es) of kernel launches per decode "
                                    "step"), gpu["reason"]


def test_a_context_beyond_prompt_and_output_says_what_filling_it_costs(cli):
    """A newcomer (session 26) read 163 tokens/s for `plan --context 8192`, planned at the default 512 + 128 tokens,
    for a chat that decoded at 35-41 near 8k tokens: the plan now warns what a conversation filling the context gets,
    as `--prompt-len` planning it predicts."""
    args = ("--hardware", "cpu-generic", "--reserve-gb", "0")
    data = plan(cli, *args, "--context", "8192", json_out=True)
    warning = next(text for text in data["warnings"] if text.startswith("--context 8,192: "))
    filled = re.search(r"\((\d[\d,]*) prompt tokens\) decodes at ([\d.]+) tokens/s", warning)
    assert filled and filled.group(1) == "8,064", warning
    asked = plan(cli, *args, "--prompt-len", "8064", "--output-len", "128", json_out=True)
    assert float(filled.group(2)) == pytest.approx(asked["decode_tokens_per_s"], rel=0.01)
    assert float(filled.group(2)) < 0.8 * data["decode_tokens_per_s"]
    plain = plan(cli, *args, json_out=True)
    assert not any(text.startswith("--context") for text in plain["warnings"])
