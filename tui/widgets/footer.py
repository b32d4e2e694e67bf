"""The key footer: Textual's ``Footer``, its keys made in the footer's own style.

Textual's ``FooterKey.compact`` defaults to True while ``Footer.compact`` defaults to
False, so every key of every footer rebuild (each focus change and ``refresh_bindings``)
had its CSS recomputed twice: once when its ``-compact`` class was added at mount, once
when the footer's data bind removed it. Each key bound to the footer's ``compact`` starts
here with the footer's value and class, already right at mount: no restyle, the same look
(the command palette's key, which Textual leaves unbound and compact, is left as it is).
"""

from __future__ import annotations

from textual.app import ComposeResult
from textual.widgets import Footer
from textual.widgets._footer import FooterKey


class KeyFooter(Footer):
    """``Footer`` whose keys are born with its ``compact`` value (see the module docstring)."""

    def compose(self) -> ComposeResult:
        for widget in super().compose():
            bound = getattr(widget, "_reactive_connect", None) or {}
            if isinstance(widget, FooterKey) and "compact" in bound:  # not the palette key
                widget.set_reactive(FooterKey.compact, self.compact)
                widget.set_class(self.compact, "-compact", update=False)
            yield widget
