"""Issue 40: exports are owner-only (0600 files in a 0700 folder) and the Markdown
export's title line renders the title as typed."""

from __future__ import annotations

import stat

import pytest
from test_palette import run_command
from tui_kit import SIZE, chat_screen, send

pytestmark = pytest.mark.anyio


async def test_exports_are_owner_only_and_the_title_is_escaped(make_app, store, settings):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "hello")
        cid = chat_screen(app).conversation_id
        store.rename(cid, "*bold* [link](x) <b>")
        await run_command(pilot, "Export: active path as Markdown")
        await run_command(pilot, "Export: whole tree as JSON")
    folder = settings.data_dir / "exports"
    files = sorted(folder.iterdir(), key=lambda p: p.suffix)
    assert [p.suffix for p in files] == [".json", ".md"]
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    for path in files:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    title = files[1].read_text().splitlines()[0]
    assert title == r"# \*bold\* \[link\](x) \<b\>"
