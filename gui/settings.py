"""The app's settings: what the user chose on each page, kept as JSON in the platform's config folder.

Writes go to a temporary file beside settings.json and are renamed into place, so a crash never leaves half a
file. Reading validates every field; a bad value raises InputError naming the file and the field, and the app
then starts from defaults (keeping the bad file as settings.json.bad for the user to look at).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from hivekeeper.core.atomic_file import write_json_atomic
from hivekeeper.planner.errors import InputError

DEFAULT_MODEL = "meta-llama/Meta-Llama-3.1-8B-Instruct"
GOALS = ("chat", "batch", "serve")
QUANTS = ("auto", "none", "int8", "nf4")
TIERS = ("gpu", "cpu", "disk")


def config_dir() -> Path:
    """HIVEKEEPER_CONFIG_DIR, else the platform's user config folder (e.g. ~/.config/hivekeeper)."""
    explicit = os.environ.get("HIVEKEEPER_CONFIG_DIR")
    if explicit:
        return Path(explicit).expanduser()
    import platformdirs

    return Path(platformdirs.user_config_dir("hivekeeper", appauthor=False))


# ---- the settings --------------------------------------------------------------------------------------------------
@dataclass
class PlanSettings:
    model: str = DEFAULT_MODEL  # catalog id, hub id in the local cache, or a checkpoint folder
    hardware: str = "detected"  # "detected" (this machine) or a catalog machine id
    goal: str = "chat"
    quant: str = "auto"
    context_len: int = 0  # 0: prompt + output
    batch_size: int = 0  # 0: let the planner choose
    reserve_gb: dict[str, float] = field(default_factory=lambda: {"gpu": 0.0, "cpu": 0.0, "disk": 0.0})
    prompt_len: int = 512
    output_len: int = 128
    price_per_hour: float = 0.0  # 0: the machine's catalog price, if any
    override_placement: bool = False
    weights_percent: dict[str, float] = field(default_factory=lambda: {"gpu": 100.0, "cpu": 0.0, "disk": 0.0})
    cache_percent: dict[str, float] = field(default_factory=lambda: {"gpu": 100.0, "cpu": 0.0, "disk": 0.0})


@dataclass
class SwarmSettings:
    model: str = ""  # what to serve: a checkpoint folder or hub id ("" = the plan's model)
    new_swarm: bool = True
    initial_peers: list[str] = field(default_factory=list)
    num_blocks: int = 0  # 0: the plan's recommendation
    host: str = "0.0.0.0"
    public_name: str = ""


@dataclass
class ChatSettings:
    mode: str = "local"  # "local" or "swarm"
    model: str = ""  # checkpoint folder or hub id ("" = the plan's model)
    system_prompt: str = "You are a helpful assistant."
    temperature: float = 0.7
    top_p: float = 0.9
    top_k: int = 50
    max_new_tokens: int = 256
    conversation_id: str = ""  # the conversation open when the app closed


@dataclass
class Settings:
    plan: PlanSettings = field(default_factory=PlanSettings)
    swarm: SwarmSettings = field(default_factory=SwarmSettings)
    chat: ChatSettings = field(default_factory=ChatSettings)
    page: int = 0  # the page shown when the app closed

    def as_dict(self) -> dict:
        return asdict(self)


# ---- validation ----------------------------------------------------------------------------------------------------
class _Checker:
    def __init__(self, where: str):
        self.where = where

    def fail(self, name: str, problem: str) -> InputError:
        return InputError(f"{self.where}: field {name!r} {problem}")

    def integer(self, name: str, value: Any, low: int, high: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise self.fail(name, f"must be an integer from {low} to {high}, got {value!r}")
        return value

    def number(self, name: str, value: Any, low: float, high: float) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
            raise self.fail(name, f"must be a number from {low:g} to {high:g}, got {value!r}")
        return float(value)

    def text(self, name: str, value: Any, choices: tuple[str, ...] | None = None, max_len: int = 4096) -> str:
        if not isinstance(value, str) or len(value) > max_len:
            raise self.fail(name, f"must be text of at most {max_len} characters, got {value!r}"[:300])
        if choices is not None and value not in choices:
            raise self.fail(name, f"must be one of {', '.join(choices)}, got {value!r}")
        return value

    def flag(self, name: str, value: Any) -> bool:
        if not isinstance(value, bool):
            raise self.fail(name, f"must be true or false, got {value!r}")
        return value

    def tiers(self, name: str, value: Any, high: float) -> dict[str, float]:
        if not isinstance(value, dict) or set(value) - set(TIERS):
            raise self.fail(name, f"must be an object with keys among {', '.join(TIERS)}, got {value!r}")
        return {tier: self.number(f"{name}.{tier}", value.get(tier, 0.0), 0.0, high) for tier in TIERS}


def _section(doc: dict, name: str, cls, check: _Checker) -> dict:
    """The known keys of one section (unknown keys are an error: they are usually typos)."""
    section = doc.get(name, {})
    if not isinstance(section, dict):
        raise check.fail(name, "must be an object")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(section) - known)
    if unknown:
        raise check.fail(f"{name}.{unknown[0]}", f"is not a setting (known: {', '.join(sorted(known))})")
    return {**asdict(cls()), **section}


def settings_from_dict(doc: Any, where: str = "settings") -> Settings:
    """Validate a settings document; missing fields take their defaults."""
    check = _Checker(where)
    if not isinstance(doc, dict):
        raise InputError(f"{where}: expected a JSON object")
    unknown = sorted(set(doc) - {"plan", "swarm", "chat", "page"})
    if unknown:
        raise check.fail(unknown[0], "is not a settings section (plan, swarm, chat, page)")
    p = _section(doc, "plan", PlanSettings, check)
    plan = PlanSettings(
        model=check.text("plan.model", p["model"]),
        hardware=check.text("plan.hardware", p["hardware"], max_len=200),
        goal=check.text("plan.goal", p["goal"], GOALS),
        quant=check.text("plan.quant", p["quant"], QUANTS),
        context_len=check.integer("plan.context_len", p["context_len"], 0, 10_000_000),
        batch_size=check.integer("plan.batch_size", p["batch_size"], 0, 65536),
        reserve_gb=check.tiers("plan.reserve_gb", p["reserve_gb"], 1e6),
        prompt_len=check.integer("plan.prompt_len", p["prompt_len"], 1, 10_000_000),
        output_len=check.integer("plan.output_len", p["output_len"], 1, 10_000_000),
        price_per_hour=check.number("plan.price_per_hour", p["price_per_hour"], 0.0, 10_000.0),
        override_placement=check.flag("plan.override_placement", p["override_placement"]),
        weights_percent=check.tiers("plan.weights_percent", p["weights_percent"], 100.0),
        cache_percent=check.tiers("plan.cache_percent", p["cache_percent"], 100.0),
    )
    s = _section(doc, "swarm", SwarmSettings, check)
    peers = s["initial_peers"]
    if not isinstance(peers, list) or not all(isinstance(a, str) and a.startswith("/") for a in peers):
        raise check.fail("swarm.initial_peers", "must be a list of multiaddrs such as /ip4/1.2.3.4/tcp/31337/p2p/Qm…")
    swarm = SwarmSettings(
        model=check.text("swarm.model", s["model"]),
        new_swarm=check.flag("swarm.new_swarm", s["new_swarm"]),
        initial_peers=list(peers),
        num_blocks=check.integer("swarm.num_blocks", s["num_blocks"], 0, 10_000),
        host=check.text("swarm.host", s["host"], max_len=100),
        public_name=check.text("swarm.public_name", s["public_name"], max_len=200),
    )
    c = _section(doc, "chat", ChatSettings, check)
    chat = ChatSettings(
        mode=check.text("chat.mode", c["mode"], ("local", "swarm")),
        model=check.text("chat.model", c["model"]),
        system_prompt=check.text("chat.system_prompt", c["system_prompt"], max_len=100_000),
        temperature=check.number("chat.temperature", c["temperature"], 0.0, 10.0),
        top_p=check.number("chat.top_p", c["top_p"], 0.01, 1.0),
        top_k=check.integer("chat.top_k", c["top_k"], 0, 100_000),
        max_new_tokens=check.integer("chat.max_new_tokens", c["max_new_tokens"], 1, 100_000),
        conversation_id=check.text("chat.conversation_id", c["conversation_id"], max_len=200),
    )
    page = check.integer("page", doc.get("page", 0), 0, 20)
    return Settings(plan=plan, swarm=swarm, chat=chat, page=page)


# ---- the file ------------------------------------------------------------------------------------------------------
class SettingsStore:
    """settings.json in a config folder: load (validated) and save (atomic)."""

    def __init__(self, folder: Path | None = None):
        self.folder = Path(folder) if folder is not None else config_dir()
        self.path = self.folder / "settings.json"

    def load(self) -> Settings:
        """The saved settings, or defaults when there is no file yet. Bad files raise InputError."""
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return Settings()
        except OSError as exc:
            raise InputError(f"{self.path}: cannot read: {exc.strerror or exc}") from None
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InputError(f"{self.path}: not valid JSON: {exc}") from None
        return settings_from_dict(doc, str(self.path))

    def load_or_default(self) -> tuple[Settings, str | None]:
        """Like load, but a bad file is moved aside to settings.json.bad and defaults are used; returns the error."""
        try:
            return self.load(), None
        except InputError as exc:
            try:
                os.replace(self.path, self.path.with_name(self.path.name + ".bad"))
            except OSError:
                pass
            return Settings(), str(exc)

    def save(self, settings: Settings) -> None:
        # validate what we write, so a bug cannot leave a file the next start refuses
        doc = settings.as_dict()
        settings_from_dict(doc, "settings to save")
        write_json_atomic(self.path, doc)
