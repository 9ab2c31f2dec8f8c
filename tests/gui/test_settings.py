"""Settings: defaults, round trip through the file, validation that names the field, atomic writes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hivekeeper.gui.viewmodels.ring_buffer import RingBuffer
from hivekeeper.gui.settings import Settings, SettingsStore, settings_from_dict
from hivekeeper.planner.errors import InputError


def test_settings_round_trip_through_the_file(tmp_path):
    store = SettingsStore(tmp_path)
    assert store.load() == Settings()  # no file yet: defaults
    settings = Settings()
    settings.plan.goal = "batch"
    settings.plan.reserve_gb["gpu"] = 2.5
    settings.swarm.initial_peers = ["/ip4/127.0.0.1/tcp/4000/p2p/QmPeer"]
    settings.chat.temperature = 0.0
    settings.page = 3
    store.save(settings)
    assert store.load() == settings
    assert [p.name for p in tmp_path.iterdir()] == ["settings.json"]  # no temporary file left behind


@pytest.mark.parametrize("doc, field", [
    ({"plan": {"goal": "fastest"}}, "plan.goal"),
    ({"plan": {"batch_size": -1}}, "plan.batch_size"),
    ({"plan": {"reserve_gb": {"vram": 1}}}, "plan.reserve_gb"),
    ({"chat": {"top_p": 0}}, "chat.top_p"),
    ({"chat": {"temprature": 1.0}}, "chat.temprature"),
    ({"swarm": {"initial_peers": ["not-an-address"]}}, "swarm.initial_peers"),
    ({"colour": "blue"}, "colour"),
])
def test_bad_settings_name_the_field(doc, field):
    with pytest.raises(InputError, match=f"field '{field}"):
        settings_from_dict(doc, "settings.json")


def test_a_bad_file_is_set_aside_and_defaults_are_used(tmp_path):
    store = SettingsStore(tmp_path)
    store.path.write_text(json.dumps({"plan": {"goal": 42}}))
    settings, error = store.load_or_default()
    assert settings == Settings()
    assert "plan.goal" in error and str(store.path) in error
    assert (tmp_path / "settings.json.bad").is_file() and not store.path.exists()
    store.path.write_text("{not json")
    assert "not valid JSON" in store.load_or_default()[1]


def test_saving_never_leaves_a_half_written_file(tmp_path, monkeypatch):
    store = SettingsStore(tmp_path)
    store.save(Settings())
    before = store.path.read_text()

    def broken_dump(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(json, "dump", broken_dump)
    changed = Settings()
    changed.plan.goal = "serve"
    with pytest.raises(InputError, match="settings.json: cannot write"):
        store.save(changed)
    assert store.path.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["settings.json"]


def test_ring_buffer_keeps_the_last_samples_in_order():
    ring = RingBuffer(4)
    assert ring.last() is None and len(ring) == 0
    for i in range(6):
        ring.append(float(i), 10.0 * i)
    t, v = ring.arrays()
    assert np.array_equal(t, [2, 3, 4, 5]) and np.array_equal(v, [20, 30, 40, 50])
    assert ring.last() == 50.0 and len(ring) == 4


def test_the_qt_bindings_keep_none_alive(qapp):
    """Methods that return nothing must not drop a reference to None: PySide6 6.12.0 on Python 3.11 did, and the
    app died with "none_dealloc" after a few thousand calls. app.main refuses to start on such bindings."""
    import sys

    from PySide6.QtWidgets import QLabel

    from hivekeeper.gui.app import broken_bindings

    widget = QLabel()
    before = sys.getrefcount(None)
    for _ in range(2000):
        widget.setText("x")
        qapp.processEvents()
    assert sys.getrefcount(None) >= before - 50  # other code may drop a few; the bug drops 4000
    assert broken_bindings() is None
