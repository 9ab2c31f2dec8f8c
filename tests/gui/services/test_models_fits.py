"""The app's model listing (gui/services/models.list_with_fits) judges fits as `hivekeeper models list` does: on this
machine's saved profile when the app has no detected machine to give it, not on raw detection's estimates."""

from __future__ import annotations

import json

from hivekeeper.core.runtime.library import scan_library

from ...core.cli.test_models import MID_CONFIG, hf_config_repo, measure_here


def test_the_apps_listing_fits_on_the_measured_machine_as_models_list(tmp_path, measured_machine, monkeypatch, cli):
    from hivekeeper.gui.services.models import list_with_fits

    for env in ("HIVEKEEPER_MODELS_DIR", "OLLAMA_MODELS", "HIVEKEEPER_LMSTUDIO_DIRS"):
        monkeypatch.setenv(env, str(tmp_path / "empty"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    hf_config_repo(tmp_path / "hub", "org/mid", MID_CONFIG)
    measure_here(tmp_path / "config", measured_machine, monkeypatch)
    listed = {m.id: m for m in list_with_fits(None, lambda: False)}
    assert "org/mid" in {m.id for m in scan_library()}
    said = {r["id"]: r for r in json.loads(cli("models", "list", "--json").stdout)}
    assert listed["org/mid"].fit_reason == said["org/mid"]["fit_reason"]
    assert "at 34.1 GB/s" in listed["org/mid"].fit_reason, listed["org/mid"].fit_reason
