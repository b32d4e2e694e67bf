"""tierchat.config: settings dataclasses, defaults, TOML/env/CLI loading. No MLX, no Textual."""

from tierchat.config.settings import (
    Settings,
    SettingsError,
    explain,
    load_settings,
    parse_size,
)

__all__ = ["Settings", "SettingsError", "explain", "load_settings", "parse_size"]
