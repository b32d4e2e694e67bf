"""The chat screen's model loading: the picker (F4), a load on the engine thread with
its progress in the activity bar, and what the result says (a warning, another model's
replies in the conversation). Composed into ``ChatScreen`` (``screen.models``), whose
actions and message handlers call it; the engine's events become messages in
``tui/services/model_load.py`` (docs/DESIGN.md §16). No MLX here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tierchat.tui.messages import ModelLoadAdvanced, ModelLoadFailed, ModelLoadFinished
from tierchat.tui.models import model_choices
from tierchat.tui.screens.model_picker import ModelPickerScreen
from tierchat.tui.services.model_load import load_events, path_problem
from tierchat.tui.widgets.activity import ActivityBar
from tierchat.tui.widgets.transcript import Transcript

if TYPE_CHECKING:
    from tierchat.tui.screens.chat import ChatScreen


class ModelLoads:
    """Model loads for one chat screen (``loading_model`` there says which one runs)."""

    def __init__(self, chat: ChatScreen) -> None:
        self.chat = chat

    def pick(self) -> None:
        """The model picker; the model chosen is loaded."""
        chat = self.chat
        app = chat.tierchat
        choices = model_choices(getattr(app.settings, "models_dir", None))

        def done(spec: str | None) -> None:
            if spec:
                self.load(spec)

        chat.app.push_screen(ModelPickerScreen(choices, app.engine.model_name), done)

    def load(self, spec: str) -> None:
        """Ask the engine to load ``spec``; progress and the result arrive as messages."""
        chat = self.chat
        problem = path_problem(spec)
        if problem:
            chat.notify(problem, title=f"Cannot load {spec}", severity="error")
            return
        on_event = load_events(spec, chat.post_message)
        chat.loading_model = spec
        chat.query_one(ActivityBar).show_loading(spec, 0, 0, "")
        chat._update_titles()
        ok, _ = chat.attempt(
            f"Cannot load {spec}", lambda: chat.tierchat.engine.load_model(spec, on_event=on_event)
        )
        if not ok:
            self._load_ended()

    def _load_ended(self) -> None:
        chat = self.chat
        chat.loading_model = ""
        chat.query_one(ActivityBar).hide()
        chat._update_titles()

    def advanced(self, event: ModelLoadAdvanced) -> None:
        chat = self.chat
        if event.model == chat.loading_model:
            bar = chat.query_one(ActivityBar)
            bar.show_loading(event.model, event.done, event.total, event.note)

    def finished(self, event: ModelLoadFinished) -> None:
        chat = self.chat
        self._load_ended()
        chat.query_one(Transcript).set_welcome(chat._welcome_text())
        if event.warning:
            chat.notify(event.warning, title=f"Loaded {event.model}", severity="warning")
        else:
            chat.notify(f"{event.model} is ready.", title="Model loaded")
        others = sorted(
            {i.model for i in chat.path_infos() if i.role == "assistant" and i.model}
            - {event.model}
        )
        if others:
            chat.notify(
                f"This conversation holds replies of {', '.join(others)}; {event.model} reads "
                "them as its own. Ctrl+R regenerates the last reply, Ctrl+N starts afresh.",
                title="Another model's replies",
                severity="warning",
                timeout=8,
            )
        chat.refresh_bindings()
        chat.poll_stats()

    def failed(self, event: ModelLoadFailed) -> None:
        chat = self.chat
        self._load_ended()
        chat.notify(event.message, title=f"Cannot load {event.model}", severity="error", timeout=10)
        chat.poll_stats()
