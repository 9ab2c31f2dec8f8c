"""Fine-tuning the real default model (SmolLM2-135M-Instruct) on the shipped made-up fact (issue 21).

`hivekeeper finetune` trains 4 deep prompt tokens for 20 steps on data/zorblaxia_train.jsonl (twelve ways of asking
for the capital of Zorblaxia, a country that does not exist, all answered "Quenthor"); the loss on the held-out
questions of data/zorblaxia_heldout.jsonl (worded differently) falls to under a fifth of what it was, and a greedy
`hivekeeper chat --prompts FILE` answers a held-out question with the made-up capital. Both commands run in this
process through their entry points. It is the suite's one real-model training run, kept to 20 steps of one example
(at 20 the held-out loss was 1.90 before and 0.15 after, against the test's bound of 0.38).
"""

from __future__ import annotations

import io
import re
import sys
from pathlib import Path

import pytest

from hivekeeper.core.cli.main import main
from hivekeeper.core.runtime.default_model import DEFAULT_MODEL_ID, INSTALL_HINT, default_model_file

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(default_model_file() is None,
                                 reason=f"the default model is not installed ({INSTALL_HINT})")]

DATA = Path(__file__).parent / "data"


def test_twenty_steps_teach_a_made_up_fact(tmp_path, capsys, monkeypatch):
    out = tmp_path / "zorblaxia.prompts"
    assert main(["finetune", "--model", DEFAULT_MODEL_ID, "--data", str(DATA / "zorblaxia_train.jsonl"),
                 "--eval", str(DATA / "zorblaxia_heldout.jsonl"), "--method", "deep_ptune", "--prompt-tokens", "4",
                 "--steps", "20", "--batch", "1", "--lr", "0.03", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    before, after = (float(re.search(rf"held-out loss {when}: ([0-9.]+)", err).group(1)) for when in ("before", "after"))
    assert after < before / 5, err
    assert "step 20/20" in err and "tokens/s" in err

    monkeypatch.setattr(sys, "stdin", io.StringIO("What is Zorblaxia's capital called?\n"))
    assert main(["chat", "--prompts", str(out), "--temperature", "0", "--max-new-tokens", "16"]) == 0
    reply = capsys.readouterr().out.split("assistant> ", 1)[1].splitlines()[0]
    assert "Quenthor" in reply, reply
