"""Page 4, Chat: talk to the model on this machine (placed by the planner) or through the swarm.

Replies stream token by token from the chat worker; Stop ends one after the current token. Every conversation is
saved as it changes (the user's message at once, the reply when it ends, stopped or not), with each reply's
tokens/s, and comes back when the app starts again. Under the settings, a switch serves the page's model over the
OpenAI-compatible API (widgets/api_switch.py) for other programs on this machine.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Callable

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QKeySequence, QShortcut, QTextCursor
from PySide6.QtWidgets import (QComboBox, QDoubleSpinBox, QFormLayout, QGroupBox, QHBoxLayout,
                               QLineEdit, QListWidget, QListWidgetItem, QPlainTextEdit, QPushButton, QSpinBox,
                               QTextBrowser, QVBoxLayout, QWidget)

from hivekeeper.core.runtime.chat_history import ChatHistory
from hivekeeper.core.runtime.default_model import DEFAULT_MODEL_ID
from hivekeeper.planner.errors import InputError

from hivekeeper.gui.services.chat import ChatService
from hivekeeper.gui.viewmodels.conversations import Conversation, ConversationStore, title_from
from hivekeeper.gui.settings import ChatSettings
from hivekeeper.gui.style import BAD, LINE, MUTED, label, page_layout
from hivekeeper.gui.widgets.api_switch import ApiSwitch
from hivekeeper.gui.widgets.model_menu import model_menu

MODES = {"local": "on this machine", "swarm": "through the swarm"}


def _bubble(role: str, text: str, note: str = "") -> str:
    body = html.escape(text).replace("\n", "<br>") or "<span style='color:#9aa5b1'>…</span>"
    if role == "user":
        return (f"<table width='100%' cellspacing='0' cellpadding='0'><tr><td width='22%'></td>"
                f"<td style='background:#e3efff; padding:8px 10px; border-radius:8px;'>{body}</td></tr></table>")
    foot = f"<div style='color:{MUTED}; font-size:11px; margin-top:4px'>{html.escape(note)}</div>" if note else ""
    return (f"<table width='100%' cellspacing='0' cellpadding='0'><tr>"
            f"<td style='background:#ffffff; border:1px solid {LINE}; padding:8px 10px;'>{body}{foot}</td>"
            f"<td width='22%'></td></tr></table>")


def reply_note(stats: dict) -> str:
    """"42 tokens · 9.8 tokens/s · first token 0.31 s (stopped)" for a reply's stats."""
    parts = [f"{stats.get('new_tokens', 0)} tokens"]
    if stats.get("tokens_per_s"):
        parts.append(f"{stats['tokens_per_s']:.3g} tokens/s")
    if stats.get("time_to_first_token_s") is not None:
        parts.append(f"first token {stats['time_to_first_token_s']:.2g} s")
    reason = stats.get("finish_reason")
    text = " · ".join(parts)
    if reason == "stopped":
        text += " (stopped)"
    elif reason == "length":
        text += " (length limit)"
    elif reason == "error":
        text += " (interrupted by an error)"
    return text


class ChatPage(QWidget):
    settingsChanged = Signal()
    replyMeasured = Signal(float, float)  # tokens/s, ms per token

    def __init__(self, settings: ChatSettings, service: ChatService, folder: Path, parent: QWidget | None = None):
        super().__init__(parent)
        self.settings = settings
        self.service = service
        self.store = ConversationStore(folder)
        self.default_model = ""  # the plan's model: offered in the model menu, used through the swarm
        self.peers_provider: Callable[[], tuple[str, tuple[str, ...]]] | None = None  # -> (model, peers) of a swarm
        self.conversation: Conversation | None = None
        self.reply_text = ""
        self.replying = False
        self.last_stats: dict | None = None
        self.last_error = ""
        self._loading = False

        layout = page_layout(self, QHBoxLayout, (16, 14), spacing=12)
        layout.addWidget(self._build_list())
        layout.addWidget(self._build_center(), 1)
        layout.addWidget(self._build_settings())

        self._render_timer = QTimer(self)
        self._render_timer.setSingleShot(True)
        self._render_timer.setInterval(40)  # at most 25 redraws a second while tokens stream
        self._render_timer.timeout.connect(self.render)

        service.started.connect(self._on_started)
        service.status.connect(self._on_status)
        service.yielded.connect(self._on_piece)
        service.finished.connect(self._on_finished)
        service.errored.connect(self._on_error)
        service.kernels.connect(self._on_kernels)
        self._load_settings()
        self.refresh_list()
        if settings.conversation_id:
            self.open_conversation(settings.conversation_id)
        self._update_buttons()

    # ---- building ------------------------------------------------------------------------------------------------
    def _build_list(self) -> QWidget:
        box = QWidget()
        box.setFixedWidth(210)
        column = QVBoxLayout(box)
        column.setContentsMargins(0, 0, 0, 0)
        column.addWidget(label("Conversations", "cardTitle"))
        self.list = QListWidget()
        # a long title ends in "…" (the whole of it in the tooltip), not under a horizontal scroll bar
        self.list.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.list.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.list.itemClicked.connect(lambda item: self.open_conversation(item.data(Qt.ItemDataRole.UserRole)))
        column.addWidget(self.list, 1)
        row = QHBoxLayout()
        self.new_button = QPushButton("New chat")
        self.new_button.clicked.connect(self.new_conversation)
        self.delete_button = QPushButton("Delete")
        self.delete_button.clicked.connect(self.delete_conversation)
        row.addWidget(self.new_button)
        row.addWidget(self.delete_button)
        column.addLayout(row)
        return box

    def _build_center(self) -> QWidget:
        box = QWidget()
        column = QVBoxLayout(box)
        column.setContentsMargins(0, 0, 0, 0)
        self.title = label("New chat", "title", wrap=True)  # a conversation's title is its first question
        self.subtitle = label("", "subtitle", wrap=True)
        column.addWidget(self.title)
        column.addWidget(self.subtitle)
        self.transcript = QTextBrowser()
        self.transcript.setOpenExternalLinks(True)
        column.addWidget(self.transcript, 1)
        self.status_label = label("", "small", wrap=True)
        column.addWidget(self.status_label)
        row = QHBoxLayout()
        self.input = QPlainTextEdit()
        self.input.setPlaceholderText("Write a message… (Ctrl+Enter sends)")
        self.input.setFixedHeight(72)
        self.send_button = QPushButton("Send")
        self.send_button.setObjectName("primary")
        self.send_button.clicked.connect(self.send)
        self.stop_button = QPushButton("Stop")
        self.stop_button.setObjectName("danger")
        self.stop_button.clicked.connect(self.stop)
        buttons = QVBoxLayout()
        buttons.addWidget(self.send_button)
        buttons.addWidget(self.stop_button)
        row.addWidget(self.input, 1)
        row.addLayout(buttons)
        column.addLayout(row)
        QShortcut(QKeySequence("Ctrl+Return"), self.input, activated=self.send)
        return box

    def _build_settings(self) -> QWidget:
        box = QGroupBox("Settings")
        box.setFixedWidth(300)
        form = QFormLayout(box)
        self.mode_combo = QComboBox()
        for mode, text in MODES.items():
            self.mode_combo.addItem(text, mode)
        model_row = QHBoxLayout()
        self.model_edit = QLineEdit()
        self.model_edit.setPlaceholderText(f"{DEFAULT_MODEL_ID} (built in)")
        browse = QPushButton("…")
        browse.setToolTip("The built-in model, the plan's, a GGUF file or a checkpoint folder")
        browse.setStyleSheet("padding: 4px 6px;")
        browse.setMenu(model_menu(self, "Model to chat with", self._choose_model, extra=self._plan_entry))
        model_row.addWidget(self.model_edit, 1)
        model_row.addWidget(browse)
        self.system_edit = QPlainTextEdit()
        self.system_edit.setFixedHeight(80)
        self.temperature_spin = QDoubleSpinBox()
        self.temperature_spin.setRange(0.0, 2.0)
        self.temperature_spin.setSingleStep(0.1)
        self.temperature_spin.setSpecialValueText("0 (greedy)")
        self.top_p_spin = QDoubleSpinBox()
        self.top_p_spin.setRange(0.01, 1.0)
        self.top_p_spin.setSingleStep(0.05)
        self.top_k_spin = QSpinBox()
        self.top_k_spin.setRange(0, 100_000)
        self.top_k_spin.setSpecialValueText("off")
        self.max_tokens_spin = QSpinBox()
        self.max_tokens_spin.setRange(1, 100_000)
        form.addRow("Run", self.mode_combo)
        form.addRow("Model", model_row)
        form.addRow("System prompt", self.system_edit)
        form.addRow("Temperature", self.temperature_spin)
        form.addRow("Top-p", self.top_p_spin)
        form.addRow("Top-k", self.top_k_spin)
        form.addRow("Max new tokens", self.max_tokens_spin)
        form.addRow("Trained prompts", self._build_prompts_row())
        self.placement_label = label("", "small", wrap=True)
        form.addRow(self.placement_label)
        self.api_switch = ApiSwitch(self.model)
        form.addRow(self.api_switch)
        self.mode_combo.currentIndexChanged.connect(self._read_widgets)
        self.model_edit.editingFinished.connect(self._read_widgets)
        self.system_edit.textChanged.connect(self._read_widgets)
        for spin in (self.temperature_spin, self.top_p_spin, self.top_k_spin, self.max_tokens_spin):
            spin.valueChanged.connect(self._read_widgets)
        return box

    # ---- settings --------------------------------------------------------------------------------------------------
    def _build_prompts_row(self) -> QHBoxLayout:
        """A prompts file from `hivekeeper finetune` (empty: none), and the Fine-tune panel that makes one."""
        row = QHBoxLayout()
        self.prompts_edit = QLineEdit()
        self.prompts_edit.setPlaceholderText("none")
        self.prompts_edit.setToolTip("A prompts file trained by the Fine-tune panel or `hivekeeper finetune`")
        self.finetune_button = QPushButton("Fine-tune…")
        self.finetune_button.clicked.connect(self.open_finetune)
        self.finetune_panel = None
        row.addWidget(self.prompts_edit, 1)
        row.addWidget(self.finetune_button)
        return row

    def open_finetune(self):
        """The Fine-tune panel for the chat's model; prompts it saves become the chat's trained prompts."""
        from hivekeeper.gui.widgets.finetune_panel import FinetunePanel

        if self.finetune_panel is None:
            self.finetune_panel = FinetunePanel(self.model, self)
            self.finetune_panel.trained.connect(self.prompts_edit.setText)
        self.finetune_panel.open()  # window-modal, not blocking (as the About box)
        return self.finetune_panel

    def _load_settings(self) -> None:
        s = self.settings
        self._loading = True  # setting one widget must not save the others' not-yet-loaded values
        self.mode_combo.setCurrentIndex(max(0, self.mode_combo.findData(s.mode)))
        self.model_edit.setText(s.model)
        self.model_edit.setCursorPosition(0)  # a long path or id shows its beginning, not its end
        self.system_edit.setPlainText(s.system_prompt)
        self.temperature_spin.setValue(s.temperature)
        self.top_p_spin.setValue(s.top_p)
        self.top_k_spin.setValue(s.top_k)
        self.max_tokens_spin.setValue(s.max_new_tokens)
        self._loading = False
        self._update_subtitle()

    def _read_widgets(self, *_) -> None:
        if self._loading:
            return
        s = self.settings
        s.mode = self.mode_combo.currentData()
        s.model = self.model_edit.text().strip()
        s.system_prompt = self.system_edit.toPlainText()
        s.temperature = self.temperature_spin.value()
        s.top_p = self.top_p_spin.value()
        s.top_k = self.top_k_spin.value()
        s.max_new_tokens = self.max_tokens_spin.value()
        self._update_subtitle()
        self.settingsChanged.emit()

    def _choose_model(self, model: str) -> None:
        self.model_edit.setText(model)
        self.model_edit.setCursorPosition(0)
        self._read_widgets()

    def _plan_entry(self) -> list[tuple[str, str]]:
        return [(f"The plan's model: {self.default_model}", self.default_model)] if self.default_model else []

    def set_default_model(self, model: str) -> None:
        """The plan's model (offered in the menu; the empty field chats with the built-in model, which needs no
        download)."""
        self.default_model = model
        self._update_subtitle()

    def model(self) -> str:
        return self.settings.model or DEFAULT_MODEL_ID

    def _update_subtitle(self) -> None:
        """The open conversation's model and run mode as it used them; the settings' when they differ (what the
        next reply uses) or when no conversation is open."""
        now = f"{Path(self.model()).name or 'no model'} · {MODES[self.settings.mode]}"
        conversation = self.conversation
        if conversation is None or not conversation.mode:
            self.subtitle.setText(now)
            return
        used = f"{Path(conversation.model).name or 'no model'} · {MODES[conversation.mode]}"
        self.subtitle.setText(used if used == now else f"{used} (next reply: {now})")

    # ---- conversations ---------------------------------------------------------------------------------------------
    def refresh_list(self) -> None:
        self.list.clear()
        for conversation_id, title in self.store.list():
            item = QListWidgetItem(title)
            item.setToolTip(title)
            item.setData(Qt.ItemDataRole.UserRole, conversation_id)
            self.list.addItem(item)
            if self.conversation is not None and conversation_id == self.conversation.id:
                self.list.setCurrentItem(item)

    def new_conversation(self) -> None:
        if self.replying:
            return
        self.conversation = None
        self.settings.conversation_id = ""
        self.last_error = ""
        self.title.setText("New chat")
        self._update_subtitle()
        self.list.clearSelection()
        self.render()
        self.settingsChanged.emit()

    def open_conversation(self, conversation_id: str) -> None:
        if self.replying:
            return
        try:
            self.conversation = self.store.load(conversation_id)
        except InputError as exc:
            self.status_label.setText(f"Cannot open that conversation: {exc}")
            self.conversation = None
            self.settings.conversation_id = ""
            return
        self.settings.conversation_id = conversation_id
        self.title.setText(self.conversation.title)
        self.last_error = ""
        self._update_subtitle()
        self.render()
        self.refresh_list()
        self.settingsChanged.emit()

    def delete_conversation(self) -> None:
        if self.replying or self.conversation is None:
            return
        self.store.delete(self.conversation.id)
        self.new_conversation()
        self.refresh_list()

    def _save(self) -> None:
        try:
            self.store.save(self.conversation)
        except (InputError, OSError) as exc:
            self.status_label.setText(f"Cannot save the conversation: {exc}")

    # ---- sending ---------------------------------------------------------------------------------------------------
    def backend_key(self):
        from hivekeeper.gui.services.chat_backends import BackendKey

        s = self.settings
        if s.mode == "swarm":
            model, peers = self.peers_provider() if self.peers_provider else ("", ())
            return BackendKey("swarm", s.model or model or self.default_model, tuple(peers),
                              prompts=self.prompts_edit.text().strip())
        return BackendKey("local", self.model(), prompts=self.prompts_edit.text().strip())

    def send(self) -> None:
        text = self.input.toPlainText().strip()
        if not text or self.replying or self.service.busy:
            return
        if not self.model():
            self.status_label.setText("Choose a model first (here or on the Plan page).")
            return
        from hivekeeper.gui.services.chat_backends import Request

        if self.conversation is None:
            self.conversation = self.store.new(self.settings.system_prompt, self.model())
            self.conversation.title = title_from(text)
            self.settings.conversation_id = self.conversation.id
            self.title.setText(self.conversation.title)
        self.conversation.history.system_prompt = self.settings.system_prompt
        self.conversation.history.add_user(text)
        key = self.backend_key()
        self.conversation.model = key.model or self.model()
        self.conversation.mode = self.settings.mode
        self._save()  # the question survives whatever happens to the reply
        self.refresh_list()
        self.input.clear()
        self.reply_text = ""
        self.last_error = ""
        self.replying = True
        s = self.settings
        request = Request(history=ChatHistory.from_dict(self.conversation.history.to_dict()),
                          max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                          conversation_id=self.conversation.id)
        self._update_subtitle()
        self.service.send(key, request)
        self._update_buttons()
        self.render()
        self.settingsChanged.emit()

    def stop(self) -> None:
        if self.replying:
            self.status_label.setText("stopping…")
            self.service.stop()

    def _update_buttons(self) -> None:
        self.send_button.setEnabled(not self.replying)
        self.stop_button.setEnabled(self.replying)
        self.new_button.setEnabled(not self.replying)
        self.delete_button.setEnabled(not self.replying)

    # ---- worker events ---------------------------------------------------------------------------------------------
    def _on_started(self) -> None:
        self.status_label.setText("starting…")

    def _on_status(self, words: str) -> None:
        if words == self.service.placement:
            self.placement_label.setText(f"Placement: {words}")
        else:
            self.status_label.setText(words)

    def _on_kernels(self, words: str) -> None:
        if words and not self.replying:  # a reply's own status says the same while it waits for the compile
            self.status_label.setText(words)

    def showEvent(self, event) -> None:
        super().showEvent(event)
        self.service.prepare_kernels()  # the first reply then starts without the compile's wait (once per app run)

    def _on_piece(self, text: str) -> None:
        if not self.reply_text:
            self.status_label.setText("writing…")
        self.reply_text += text
        if not self._render_timer.isActive():
            self._render_timer.start()

    def _finish_reply(self, stats: dict) -> None:
        self.replying = False
        if self.conversation is not None and (self.reply_text or stats.get("finish_reason") != "error"):
            self.conversation.history.add_assistant(self.reply_text)
            index = len(self.conversation.history.messages) - 1
            keep = ("new_tokens", "tokens_per_s", "time_to_first_token_s", "decode_s", "finish_reason")
            self.conversation.reply_stats[index] = {k: stats.get(k) for k in keep}
            self.conversation.reply_stats[index]["model"] = self.conversation.model
            self._save()
        self.reply_text = ""
        self._update_buttons()
        self.render()

    def _on_finished(self, stats: dict) -> None:
        self.last_stats = stats
        self.status_label.setText(reply_note(stats))
        tps = stats.get("tokens_per_s")
        if tps:
            self.replyMeasured.emit(float(tps), 1000.0 / float(tps))
        self._finish_reply(stats)

    def _on_error(self, message: str) -> None:
        self.last_error = message
        self.status_label.setText("")
        self._finish_reply({"finish_reason": "error", "new_tokens": 0})

    # ---- drawing ---------------------------------------------------------------------------------------------------
    def render(self) -> None:
        parts = []
        if self.conversation is not None:
            history = self.conversation.history
            if history.system_prompt:
                parts.append(f"<p style='color:{MUTED}; font-size:11px'>System: "
                             f"{html.escape(history.system_prompt)}</p>")
            for index, message in enumerate(history.messages):
                stats = self.conversation.reply_stats.get(index)
                parts.append(_bubble(message["role"], message["content"], reply_note(stats) if stats else ""))
                parts.append("<div style='height:6px'></div>")
        if self.replying:
            parts.append(_bubble("assistant", self.reply_text, "…"))
        if self.last_error:
            parts.append(f"<p style='color:{BAD}'>{html.escape(self.last_error)}</p>")
        if not parts:
            parts.append(f"<p style='color:{MUTED}'>Ask something. Replies stream here; Stop ends one early. "
                         "Conversations are saved as you go.</p>")
        self.transcript.setHtml("".join(parts))
        self.transcript.moveCursor(QTextCursor.MoveOperation.End)

    def transcript_text(self) -> str:
        return self.transcript.toPlainText()

    def shutdown(self) -> None:
        if self.finetune_panel is not None:
            self.finetune_panel.shutdown()
        self.api_switch.shutdown()
        self.service.shutdown()
