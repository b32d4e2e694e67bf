"""tui/widgets/footer.py: ``KeyFooter`` shows the same keys as Textual's ``Footer``, with the
same classes and text in either style, and its rebuilds restyle no key."""

from __future__ import annotations

import pytest
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.widgets import Footer
from textual.widgets._footer import FooterKey
from tierchat.tui.widgets.footer import KeyFooter
from tui_kit import SIZE, chat_screen, settle

pytestmark = pytest.mark.anyio


class Both(App):
    BINDINGS = [Binding("f2", "bell", "Panels"), Binding("ctrl+n", "bell", "New chat")]

    def __init__(self, footer: type[Footer], compact: bool) -> None:
        super().__init__()
        self.footer, self.compact = footer, compact

    def compose(self) -> ComposeResult:
        yield self.footer(compact=self.compact)


async def keys_of(footer_type: type[Footer], compact: bool) -> list[tuple]:
    app = Both(footer_type, compact)
    async with app.run_test(size=(80, 4)) as pilot:
        await pilot.pause()
        footer = app.query_one(footer_type)
        keys = list(footer.query(FooterKey))
        assert keys, "the footer shows no key"
        return [
            (k.key, k.description, k.compact, sorted(k.classes), str(k.render()), k.region)
            for k in keys
        ]


@pytest.mark.parametrize("compact", [False, True])
async def test_the_keys_are_textuals_in_either_style(compact):
    ours = await keys_of(KeyFooter, compact)
    assert ours == await keys_of(Footer, compact)
    bound = [(c, classes) for _, _, c, classes, *_ in ours if "-command-palette" not in classes]
    assert bound and all(c == compact and ("-compact" in classes) == compact for c, classes in bound)


async def test_a_rebuild_restyles_no_key(make_app, monkeypatch):
    """Each focus change rebuilds the footer's keys; Textual's own ``Footer`` restyled each
    new key twice (``-compact`` added, then removed by the data bind). The command
    palette's key, unbound, still gets its ``-compact`` once, as in Textual."""
    restyled: list[str] = []
    original = FooterKey.update_node_styles

    def counting(self, animate: bool = True) -> None:
        if not self.has_class("-command-palette"):
            restyled.append(self.key)
        original(self, animate)

    monkeypatch.setattr(FooterKey, "update_node_styles", counting)
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        footer = chat_screen(app).query_one(KeyFooter)
        before = list(footer.query(FooterKey))
        await pilot.press("ctrl+n")  # ... the bindings change with the focus
        await pilot.press("escape")
        await settle(pilot)
        after = list(footer.query(FooterKey))
        assert after and not set(map(id, after)) & set(map(id, before))  # rebuilt
        assert restyled == []
