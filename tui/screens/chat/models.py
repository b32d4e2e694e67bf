"""The chat screen's model loading: the picker (F4), a load on the engine thread with
its progress in the activity bar, and what the result says (a warning, another model's
replies in the conversation). :class:`ModelLoads` does the work of the chat screen's
model actions and load messages, through :class:`ModelHost`; the engine's events become
messages in ``tui/services/model_load.py`` (docs/DESIGN.md §16). No MLX here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from textual.message import Message
from tierchat.tui.messages import ModelLoadAdvanced, ModelLoadFailed, ModelLoadFinished
from tierchat.tui.models import model_choices
from tierchat.tui.screens.model_picker import ModelPickerScreen
from tierchat.tui.services.model_load import load_events, path_problem
from tierchat.tui.widgets.activity import ActivityBar
from tierchat.tui.widgets.transcript import MessageInfo, Transcript

if TYPE_CHECKING:
    from tierchat.tui.app import TierchatApp


class ModelHost(Protocol):
    """What :class:`ModelLoads` needs of the chat screen."""

    loading_model: str
    """The model being loaded, "" when none (set here)."""

    def post_message(self, message: Message) -> bool:
        """Where the load's messages go (from the engine thread)."""

    def model_changed(self) -> None:
        """The model (or the one loading) changed: the titles and the keys follow."""

    def welcome_text(self) -> str:
        """The empty transcript's note, which names the model."""


class ModelLoads:
    """Model loads for one chat screen (``loading_model`` there says which one runs).

    Args:
        host: the screen (:class:`ModelHost`).
        app: the app (engine, settings, stats poll).
        activity: the activity bar showing the load's progress.
        transcript: the transcript (its welcome note; the replies of other models).
        path_infos: the active path shown.
    """

    def __init__(
        self,
        host: ModelHost,
        app: TierchatApp,
        activity: ActivityBar,
        transcript: Transcript,
        path_infos: Callable[[], list[MessageInfo]],
    ) -> None:
        self.host = host
        self.app = app
        self.activity = activity
        self.transcript = transcript
        self.path_infos = path_infos

    def pick(self) -> None:
        """The model picker; the model chosen is loaded."""
        app = self.app
        choices = model_choices(getattr(app.settings, "models_dir", None))

        def done(spec: str | None) -> None:
            if spec:
                self.load(spec)

        app.push_screen(ModelPickerScreen(choices, app.engine.model_name), done)

    def load(self, spec: str) -> None:
        """Ask the engine to load ``spec``; progress and the result arrive as messages."""
        app, host = self.app, self.host
        problem = path_problem(spec)
        if problem:
            app.notify(problem, title=f"Cannot load {spec}", severity="error")
            return
        on_event = load_events(spec, host.post_message)
        host.loading_model = spec
        self.activity.show_loading(spec, 0, 0, "")
        host.model_changed()
        ok, _ = app.attempt(
            f"Cannot load {spec}", lambda: app.engine.load_model(spec, on_event=on_event)
        )
        if not ok:
            self._load_ended()

    def _load_ended(self) -> None:
        self.host.loading_model = ""
        self.activity.hide()
        self.host.model_changed()

    def advanced(self, event: ModelLoadAdvanced) -> None:
        if event.model == self.host.loading_model:
            self.activity.show_loading(event.model, event.done, event.total, event.note)

    def finished(self, event: ModelLoadFinished) -> None:
        app = self.app
        self._load_ended()
        self.transcript.set_welcome(self.host.welcome_text())
        if event.warning:
            app.notify(event.warning, title=f"Loaded {event.model}", severity="warning")
        else:
            app.notify(f"{event.model} is ready.", title="Model loaded")
        others = sorted(
            {i.model for i in self.path_infos() if i.role == "assistant" and i.model}
            - {event.model}
        )
        if others:
            app.notify(
                f"This conversation holds replies of {', '.join(others)}; {event.model} reads "
                "them as its own. Ctrl+R regenerates the last reply, Ctrl+N starts afresh.",
                title="Another model's replies",
                severity="warning",
                timeout=8,
            )
        app.poll_stats()

    def failed(self, event: ModelLoadFailed) -> None:
        self._load_ended()
        self.app.notify(
            event.message, title=f"Cannot load {event.model}", severity="error", timeout=10
        )
        self.app.poll_stats()
