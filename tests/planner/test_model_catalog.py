"""The catalog's "did you mean" for an unknown model id (planner/model_catalog.py's did_you_mean): ids are compared
case-insensitively, whole and by their last path part, and the built-in model's id is among the candidates."""

from __future__ import annotations

import pytest

from hivekeeper.planner.errors import InputError
from hivekeeper.planner.model_catalog import BUILT_IN_MODEL_ID, did_you_mean, get_model


@pytest.mark.parametrize("given", ["HuggingFaceTB/SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct",
                                   "smollm2-135m", "HuggingFaceTB/smollm2-135M-instruct"])
def test_the_built_in_models_names_suggest_it_first(given):
    """Session 23: the hub id of the built-in model suggested three Meta-Llama-3.1 ids (alike as whole ids) and not
    the built-in model, whose name after the org is the same but for case."""
    assert did_you_mean(given)[0] == BUILT_IN_MODEL_ID


@pytest.mark.parametrize("given, first", [("meta-llama/Llama-3.2-3B", "meta-llama/Llama-3.2-1B"),
                                          ("mistral/Mixtral-8x7b", "mistralai/Mixtral-8x7B-v0.1"),
                                          ("QWEN/qwen2.5-0.5b-instruct", "Qwen/Qwen2.5-0.5B")])
def test_catalog_ids_still_come_first_where_they_are_closest(given, first):
    close = did_you_mean(given)
    assert close[0] == first and BUILT_IN_MODEL_ID not in close and len(close) <= 3


def test_nothing_alike_suggests_nothing():
    assert did_you_mean("acme/zzzz") == [] and did_you_mean("x") == []


def test_the_unknown_model_error_says_the_suggestions():
    with pytest.raises(InputError) as error:
        get_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert f"did you mean {BUILT_IN_MODEL_ID} or " in str(error.value)
