"""Review (issue 14, a new user's pass): the pages read as they are named and counted: the Models and Settings pages
open with their names as the navigation rail has them (Models had no title, Settings was "Step aside for me"), and
counts read as English (the Swarm page's node said "1 open sessions": the screenshots' chat held one session open;
planner/words.py's `counted`, tests/planner/test_words.py)."""

from __future__ import annotations


def test_the_models_and_settings_pages_open_with_their_names_as_in_the_navigation(app_window):
    from PySide6.QtWidgets import QLabel

    from hivekeeper.gui.main_window import PAGES

    for name in ("Hardware", "Models", "Settings"):  # the Plan's and the Chat's titles are the plan's and the chat's
        assert name in PAGES
        app_window.show_page(name)
        page = getattr(app_window, f"{name.lower()}_page")
        titles = [widget for widget in page.findChildren(QLabel) if widget.objectName() == "title"]
        assert titles and titles[0].text() == name and titles[0].isVisible(), (name, [t.text() for t in titles])
