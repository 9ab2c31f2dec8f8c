"""The Chat page at the screenshots' 1280x800 (issue 14's new-user pass, session 9): a long model path shows its
beginning, the API switch's label is not cut, and a long conversation title wraps instead of being cut."""

from __future__ import annotations

from hivekeeper.gui.settings import Settings


def test_the_chat_page_shows_a_long_model_from_its_start_and_the_whole_api_switch(make_window, tmp_path):
    settings = Settings()
    settings.chat.model = str(tmp_path / "a-folder-with-a-long-name" / "another-long-folder" / "model-q4_1.gguf")
    window = make_window(settings)
    window.resize(1280, 800)
    window.show_page("Chat")
    page = window.chat_page
    assert page.model_edit.text() == settings.chat.model and page.model_edit.cursorPosition() == 0
    checkbox = page.api_switch.checkbox
    assert checkbox.isVisible() and checkbox.width() >= checkbox.sizeHint().width()  # the whole label shows
    assert page.title.wordWrap()  # a conversation's title (its first question) wraps in the header
