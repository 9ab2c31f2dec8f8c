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
from hivekeeper.core.runtime.default_model import DEFAULT_MODEL_ID
from hivekeeper.core.swarm.server.pause import parse_hours
from hivekeeper.planner.costmodel import TIERS
from hivekeeper.planner.errors import InputError
from hivekeeper.planner.fields import Fields
from hivekeeper.planner.policy import QUANTS  # the Plan page's weight format: any --quant value

GOALS = ("chat", "batch", "serve")


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
    # catalog id, hub id in the local cache, or a checkpoint folder; first the built-in model (Chat's default too)
    model: str = DEFAULT_MODEL_ID
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
class NodeSettings:
    """When the node steps aside and what it may hold (the Settings page; serve's flags of the same names)."""

    idle_minutes: float = 0.0  # pause while input was idle for less than this (0: never)
    on_battery: bool = False
    cpu_above: float = 0.0  # pause while other programs use more than this % of the CPUs (0: never)
    serve_hours: str = ""  # "22-7": serve only then ("" all day)
    cpu_threads: int = 0  # 0: all
    ram_gib: float = 0.0  # 0: no limit beyond the free memory
    gpu_gib: float = 0.0

    def serve_args(self) -> tuple[str, ...]:
        """The `hivekeeper serve` flags that say the same (the headless node's config keys are these names)."""
        args: list[str] = []
        for flag, value in (("--pause-when-active", self.idle_minutes), ("--pause-cpu-above", self.cpu_above),
                            ("--max-cpu-threads", self.cpu_threads), ("--max-ram-gib", self.ram_gib),
                            ("--max-gpu-gib", self.gpu_gib)):
            if value:
                args += [flag, f"{value:g}"]
        if self.on_battery:
            args.append("--pause-on-battery")
        if self.serve_hours:
            args += ["--serve-hours", self.serve_hours]
        return tuple(args)


@dataclass
class Settings:
    plan: PlanSettings = field(default_factory=PlanSettings)
    swarm: SwarmSettings = field(default_factory=SwarmSettings)
    chat: ChatSettings = field(default_factory=ChatSettings)
    node: NodeSettings = field(default_factory=NodeSettings)
    page: int = 0  # the page shown when the app closed

    def as_dict(self) -> dict:
        return asdict(self)


# ---- validation ----------------------------------------------------------------------------------------------------
TEXT_LIMIT = 4096  # characters of a text setting, unless it says otherwise
SECTIONS = {"plan": PlanSettings, "swarm": SwarmSettings, "chat": ChatSettings, "node": NodeSettings}


def section_fields(top: Fields, name: str, cls) -> Fields:
    """One section's fields over its defaults (unknown keys are an error: they are usually typos)."""
    given = top.section(name)
    given.check_keys({f.name for f in fields(cls)}, "a setting")
    return Fields({**asdict(cls()), **given.doc}, top.where, name)


def tier_numbers(section: Fields, key: str, high: float) -> dict[str, float]:
    """{"gpu": x, "cpu": y, "disk": z}, each in [0, high] (a tier left out is 0)."""
    tiers = section.section(key)
    tiers.check_keys(set(TIERS), "a memory tier")
    return {tier: tiers.number(tier, 0.0, high, default=0.0) for tier in TIERS}


def plan_settings(p: Fields) -> PlanSettings:
    return PlanSettings(
        model=p.text("model", max_len=TEXT_LIMIT),
        hardware=p.text("hardware", max_len=200),
        goal=p.text("goal", choices=GOALS),
        quant=p.text("quant", choices=QUANTS),
        context_len=p.integer("context_len", low=0, high=10_000_000),
        batch_size=p.integer("batch_size", low=0, high=65536),
        reserve_gb=tier_numbers(p, "reserve_gb", 1e6),
        prompt_len=p.integer("prompt_len", low=1, high=10_000_000),
        output_len=p.integer("output_len", low=1, high=10_000_000),
        price_per_hour=p.number("price_per_hour", 0.0, 10_000.0),
        override_placement=p.flag("override_placement"),
        weights_percent=tier_numbers(p, "weights_percent", 100.0),
        cache_percent=tier_numbers(p, "cache_percent", 100.0),
    )


def swarm_settings(s: Fields) -> SwarmSettings:
    peers = s.doc["initial_peers"]
    if not isinstance(peers, list) or not all(isinstance(a, str) and a.startswith("/") for a in peers):
        raise s.error("initial_peers", "must be a list of multiaddrs such as /ip4/1.2.3.4/tcp/31337/p2p/Qm…")
    return SwarmSettings(
        model=s.text("model", max_len=TEXT_LIMIT),
        new_swarm=s.flag("new_swarm"),
        initial_peers=list(peers),
        num_blocks=s.integer("num_blocks", low=0, high=10_000),
        host=s.text("host", max_len=100),
        public_name=s.text("public_name", max_len=200),
    )


def chat_settings(c: Fields) -> ChatSettings:
    return ChatSettings(
        mode=c.text("mode", choices=("local", "swarm")),
        model=c.text("model", max_len=TEXT_LIMIT),
        system_prompt=c.text("system_prompt", max_len=100_000),
        temperature=c.number("temperature", 0.0, 10.0),
        top_p=c.number("top_p", 0.01, 1.0),
        top_k=c.integer("top_k", low=0, high=100_000),
        max_new_tokens=c.integer("max_new_tokens", low=1, high=100_000),
        conversation_id=c.text("conversation_id", max_len=200),
    )


def node_settings(n: Fields) -> NodeSettings:
    hours = n.text("serve_hours", max_len=40)
    if hours:
        try:
            parse_hours(hours)
        except ValueError as exc:
            raise n.error("serve_hours", str(exc)) from None
    return NodeSettings(
        idle_minutes=n.number("idle_minutes", 0.0, 24 * 60.0),
        on_battery=n.flag("on_battery"),
        cpu_above=n.number("cpu_above", 0.0, 100.0),
        serve_hours=hours,
        cpu_threads=n.integer("cpu_threads", low=0, high=4096),
        ram_gib=n.number("ram_gib", 0.0, 1e6),
        gpu_gib=n.number("gpu_gib", 0.0, 1e6),
    )


def settings_from_dict(doc: Any, where: str = "settings") -> Settings:
    """Validate a settings document (planner/fields.py checks each field); missing fields take their defaults."""
    top = Fields(doc, where)
    top.check_keys({*SECTIONS, "page"}, "a settings section")
    return Settings(plan=plan_settings(section_fields(top, "plan", PlanSettings)),
                    swarm=swarm_settings(section_fields(top, "swarm", SwarmSettings)),
                    chat=chat_settings(section_fields(top, "chat", ChatSettings)),
                    node=node_settings(section_fields(top, "node", NodeSettings)),
                    page=top.integer("page", default=0, low=0, high=20))


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
