"""Issue 14 (session 11, a new user's first hour): `hivekeeper plan` with no --model said "--model is required"
while `chat` and `generate` use the built-in model; now plan does too. Through `main()` as the command runs it
(the `cli` fixture: test_cmd_plan.py's child processes already run the real command)."""

from __future__ import annotations

import json

from hivekeeper.core.runtime.default_model import DEFAULT_MODEL_ID

ARGS = ("plan", "--hardware", "cpu-generic", "--json")


def test_plan_without_a_model_plans_the_built_in_one(cli):
    done = cli(*ARGS)
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    named = cli(*ARGS, "--model", DEFAULT_MODEL_ID)  # the same plan as naming the built-in model
    assert named.returncode == 0 and json.loads(named.stdout)["model"] == doc["model"]
    assert "SmolLM2-135M" in json.dumps(doc["model"]) and doc["policy"]["weight_format"] == "q4_1"
