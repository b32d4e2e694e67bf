"""Store writes and prompt building run off the UI loop, on the background writer's one
thread, in the order asked (docs/DESIGN.md §16); an error there is a notification."""

from __future__ import annotations

import threading

import pytest
from tierchat.tui.services.background import BackgroundWriter
from tui_kit import SIZE, chat_screen, send, settle

pytestmark = pytest.mark.anyio


async def test_a_send_writes_and_builds_its_prompt_on_the_writer_thread(make_app, store):
    app = make_app()
    seen: list[tuple[str, str]] = []
    add_node = store.add_node

    def recording_add_node(*args, **kwargs):
        seen.append((args[2] if len(args) > 2 else kwargs["role"], threading.current_thread().name))
        return add_node(*args, **kwargs)

    store.add_node = recording_add_node
    async with app.run_test(size=SIZE) as pilot:
        build = app.session.build_prompt
        built: list[str] = []

        def recording_build(*args, **kwargs):
            built.append(threading.current_thread().name)
            return build(*args, **kwargs)

        app.session.build_prompt = recording_build
        await send(pilot, "hello")
        ui = threading.main_thread().name
        user_writes = [name for role, name in seen if role == "user"]
        assert user_writes and all(n.startswith("tierchat-store") for n in user_writes)
        assert ui not in user_writes
        # the send's prompt on the writer; the input's context count (after the turn) on a
        # worker thread of its own; neither on the UI thread
        assert built and built[0].startswith("tierchat-store") and ui not in built
        # the reply is stored by the session on the engine's thread, never the UI's
        assert [role for role, _ in seen] == ["user", "assistant"]
        assert seen[-1][1] != ui


async def test_a_failed_write_is_a_notification_and_the_app_goes_on(make_app, store):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "first")
        assert chat_screen(app).conversation_id is not None

        def broken(*_args, **_kwargs):
            raise RuntimeError("disk full")

        store.rename = broken
        ok, value = await app.in_background("Rename failed", lambda: store.rename(1, "x"))
        assert (ok, value) == (False, None)
        await settle(pilot)
        assert any(
            n.title == "Rename failed" and "disk full" in n.message for n in app._notifications
        )
        assert app.is_running


async def test_the_writer_keeps_the_order_of_calls(make_app):
    app = make_app()
    order: list[int] = []
    gate = threading.Event()

    def first() -> int:
        gate.wait(30)  # the second call is asked for while the first still runs
        order.append(1)
        return 1

    def second() -> int:
        order.append(2)
        return 2

    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        screen = chat_screen(app)
        writer = BackgroundWriter()
        try:
            a = screen.run_worker(writer.run(screen, first))
            b = screen.run_worker(writer.run(screen, second))
            await pilot.pause()
            gate.set()
            assert (await a.wait(), await b.wait()) == (1, 2)
            assert order == [1, 2]
        finally:
            writer.close()
