"""Settings: typed defaults < TOML config file < ``TIERCHAT_*`` env vars < CLI flags.

The config file is ``config.toml`` in the platformdirs user config dir, or the file named by
env ``TIERCHAT_CONFIG`` or the ``config_path`` argument. It holds the keys of
:class:`Settings` at top level (``block_size = 512``, ``hot_bytes = "6GB"``) and a
``[keymap]`` table (binding id -> key). Env vars are ``TIERCHAT_<KEY>`` in upper case
(``TIERCHAT_HOT_BYTES=6GB``; ``TIERCHAT_KEYMAP="quit=ctrl+q,regenerate=r"``). Every value
is validated; a bad one raises :class:`SettingsError` naming the key and where it came from.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import platformdirs
from tierchat.core.chat.conversation_settings import SWIPE_TEMPERATURE
from tierchat.core.sampling_params import FIELDS as SAMPLING_KEYS
from tierchat.core.sampling_params import SamplingError, SamplingParams

APP_NAME = "tierchat"
ENV_PREFIX = "TIERCHAT_"
CONFIG_ENV = "TIERCHAT_CONFIG"
DB_FILENAME = "conversations.sqlite"
GiB = 1 << 30


class SettingsError(ValueError):
    """An invalid setting; the message names the key, the value and its source."""


def physical_ram_bytes() -> int:
    """Physical RAM in bytes (sysconf); 8 GiB when the platform does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return 8 * GiB


def default_hot_bytes() -> int:
    """25% of physical RAM, in bytes."""
    return physical_ram_bytes() // 4


def user_cache_dir() -> Path:
    return Path(platformdirs.user_cache_dir(APP_NAME))


def user_data_dir() -> Path:
    return Path(platformdirs.user_data_dir(APP_NAME))


def default_config_path() -> Path:
    return Path(platformdirs.user_config_dir(APP_NAME)) / "config.toml"


@dataclass
class Settings:
    """Every setting with its default. Sizes are bytes; ``block_size`` is tokens."""

    model: str = "demo"
    cache_dir: Path = field(default_factory=lambda: user_cache_dir() / "kv")
    models_dir: Path = field(default_factory=lambda: user_cache_dir() / "models")
    data_dir: Path = field(default_factory=user_data_dir)
    block_size: int = 256
    prefill_chunk: int = 2048
    # chunks are also cut at multiples of this many tokens, so a cancel or another
    # request waits at most one step (docs/DESIGN.md §20); 0: auto (on the CPU from the
    # model's size, 16 for demo; not cut on a GPU, where a 2048-token chunk takes a
    # fraction of a second)
    prefill_step: int = 0
    # attentions of at most this many query tokens run in plain MLX ops
    # (core/engine/attention.py): on CUDA prefill chunks, instead of cuDNN SDPA, which builds a
    # graph per new length; on the CPU every attention, with a softmax through pow;
    # None: auto (512 on CUDA, all on the CPU, off on Metal); 0: off
    chunk_attention: int | None = None
    # bit-identical to a cold run on every model: chunks end at message ends and N-1,
    # restores only there. Off: models without recurrent state fold the last prompt token
    # into the last chunk (one forward fewer a turn; on the CPU its last layer runs the
    # last token only) and restore the exact common prefix; outputs equal a cold run's within
    # float rounding (docs/DESIGN.md §7)
    bitwise: bool = False
    # per request, read the SSD tier or compute its tokens again, whichever the measured
    # disk and prefill rates say is faster (core/cache/rates.py); off: always read it
    choose_recompute: bool = True
    hot_bytes: int = field(default_factory=default_hot_bytes)
    # the SSD tier's cap; None: auto (room for one conversation at the model's whole
    # context, at least 16 GiB, at most half the free disk: core/engine/runtime.py)
    ssd_bytes: int | None = None
    # bytes the SSD tier may write in any 24 hours (0: no budget); entries that do not fit
    # are not written and are counted (docs/DESIGN.md §8.6)
    ssd_write_budget: int = 0
    # write an entry to the SSD tier when it is likely to be read again (reused, evicted
    # from RAM, or still needed at close); off: every committed entry at once, as a
    # write-through tier that a crash loses nothing of (docs/DESIGN.md §8.6)
    ssd_admission: bool = True
    # seconds an entry admission defers may wait before it is written (or found covered):
    # a crash loses at most this much of a session (docs/DESIGN.md §8.6)
    ssd_flush_idle_s: float = 5.0
    # the SSD writer runs while requests are held; off: it waits for no request held (or
    # backpressure). None: auto (off on CUDA, where its host reads of device memory slow
    # the decode steps after them; on elsewhere) (docs/DESIGN.md §8.6)
    ssd_write_while_busy: bool | None = None
    # MLX's CUDA graphs (MLX_USE_CUDA_GRAPHS, read once per process; the environment wins).
    # Off (unlike MLX's default): every prefill of a new shape (a group of requests, a join
    # to the batch) built and launched a graph of its own, 100-250 ms on an 8B model on an
    # H100, where a steady decode step gains ~10% from them (docs/DESIGN.md §20)
    cuda_graphs: bool = False
    tail_entries: int = 64
    checkpoint_entries: int = 32
    pin_system: bool = True
    # entries waiting for the SSD writer before put blocks (they are held in RAM anyway,
    # by the hot tier; the writer also stops at 1 GiB pending)
    writer_queue: int = 4096
    no_cache: bool = False
    # the sampling defaults of a new conversation (and serve's max_tokens); the file's keys
    # are its fields' names at top level (temperature = 0.7, max_tokens = 512), with their
    # defaults and ranges (core/sampling_params.py)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # a regenerate's temperature while the conversation's is 0 (a swipe that differs)
    swipe_temperature: float = SWIPE_TEMPERATURE
    kv_bits: int | None = None
    kv_group_size: int = 64
    memory_limit: int | None = None
    memory_soft_fraction: float = 0.80
    memory_hard_fraction: float = 0.92
    # how long one conversation-store operation waits for another process's lock
    # (seconds) before it is reported as failed and the next one runs
    store_busy_s: float = 10.0
    # MCP tools in the chat (docs/DESIGN.md §12.1): the servers' file (None: mcp.json next
    # to config.toml), the steps with tool calls one answer may take, one call's time
    # limit (seconds), and servers whose tools run without asking
    mcp_config: Path | None = None
    tool_rounds: int = 8
    tool_timeout_s: float = 120.0
    tools_auto_allow: list[str] = field(default_factory=list)
    keymap: dict[str, str] = field(default_factory=dict)
    # where each value came from: key (or "keymap.<id>") -> "default", "file PATH", ...
    sources: dict[str, str] = field(default_factory=dict, repr=False, compare=False)

    @property
    def mcp_path(self) -> Path:
        """The MCP servers' file: ``mcp_config``, else ``mcp.json`` in the config dir."""
        return self.mcp_config or default_config_path().parent / "mcp.json"

    @property
    def db_path(self) -> Path:
        """The SQLite conversation store: ``data_dir / "conversations.sqlite"``."""
        return self.data_dir / DB_FILENAME


# ---------------------------------------------------------------- value parsing

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "k": 1 << 10,
    "m": 1 << 20,
    "g": 1 << 30,
    "t": 1 << 40,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}


def parse_size(text: str | int) -> int:
    """A size in bytes from ``text``: a plain number of bytes or a number with a unit.

    Units (case-insensitive): B; KB, MB, GB, TB (powers of 1000); KiB, MiB, GiB, TiB and the
    bare K, M, G, T (powers of 1024). Fractions are allowed and rounded down
    (``"1.5GiB"``). Raises ``ValueError`` for anything else or a negative value,
    ``TypeError`` for a bool.
    """
    if isinstance(text, bool):
        raise TypeError(f"not a size: {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"negative size: {text}")
        return text
    if isinstance(text, float):
        if not text >= 0:  # negative or NaN
            raise ValueError(f"not a size: {text}")
        return int(text)
    m = _SIZE_RE.match(str(text))
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"not a size: {text!r} (use bytes or a unit: 512MB, 6GB, 16GiB)")
    number, unit = m.groups()
    mult = _SIZE_UNITS[unit.lower()]
    if "." in number:
        return int(float(number) * mult)
    return int(number) * mult


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_NONE = {"", "none", "null", "off"}


def _to_bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.strip().lower() in _TRUE | _FALSE:
        return v.strip().lower() in _TRUE
    raise ValueError("must be a boolean (true/false, 1/0, yes/no, on/off)")


def _to_int(v: Any) -> int:
    if isinstance(v, bool):
        raise TypeError("must be an integer")
    if isinstance(v, int):
        return v
    if isinstance(v, str):
        try:
            return int(v.strip())
        except ValueError:
            pass
    raise ValueError("must be an integer")


def _to_float(v: Any) -> float:
    if isinstance(v, bool):
        raise TypeError("must be a number")
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v.strip())
        except ValueError:
            pass
    raise ValueError("must be a number")


def _positive_int(v: Any) -> int:
    try:
        n = _to_int(v)
    except (ValueError, TypeError):
        n = 0
    if n <= 0:
        raise ValueError("must be a positive integer")
    return n


def _nonneg_int(v: Any) -> int:
    try:
        n = _to_int(v)
    except (ValueError, TypeError):
        n = -1
    if n < 0:
        raise ValueError("must be a non-negative integer")
    return n


def _size(v: Any) -> int:
    try:
        return parse_size(v)
    except (ValueError, TypeError):
        raise ValueError("must be a size in bytes or with a unit (512MB, 6GB, 16GiB)") from None


def _optional(parse: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def parse_optional(v: Any) -> Any:
        if v is None or (isinstance(v, str) and v.strip().lower() in _NONE):
            return None
        return parse(v)

    return parse_optional


def _auto(parse: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``parse``, with None, "auto" and "" read as None (the engine decides)."""

    def parse_auto(v: Any) -> Any:
        if v is None or (isinstance(v, str) and v.strip().lower() in ("auto", "")):
            return None
        return parse(v)

    return parse_auto


def _memory_limit(v: Any) -> int:
    n = _size(v)
    if n <= 0:
        raise ValueError("must be a positive size (or none)")
    return n


def _kv_bits(v: Any) -> int:
    n = _to_int(v) if not isinstance(v, bool) else 0
    if n not in (2, 3, 4, 5, 6, 8):
        raise ValueError("must be one of 2, 3, 4, 5, 6, 8 (or none)")
    return n


def _group_size(v: Any) -> int:
    n = _to_int(v) if not isinstance(v, bool) else 0
    if n not in (32, 64, 128):
        raise ValueError("must be one of 32, 64, 128")
    return n


def _model(v: Any) -> str:
    if not isinstance(v, str) or not v.strip():
        raise ValueError("must be a non-empty string")
    return v.strip()


def _path(v: Any) -> Path:
    if isinstance(v, Path):
        return v.expanduser()
    if not isinstance(v, str) or not v.strip():
        raise ValueError("must be a non-empty path")
    return Path(v.strip()).expanduser()


def _temperature(v: Any) -> float:
    x = _to_float(v)
    if not 0.0 <= x <= 5.0:
        raise ValueError("must be a number in 0..5")
    return x


def _positive_float(v: Any) -> float:
    x = _to_float(v)
    if not 0.0 < x <= 3600.0:
        raise ValueError("must be a number of seconds in (0, 3600]")
    return x


def _nonneg_float(v: Any) -> float:
    x = _to_float(v)
    if not 0.0 <= x <= 3600.0:
        raise ValueError("must be a number of seconds in [0, 3600]")
    return x


def _fraction(v: Any) -> float:
    x = _to_float(v)
    if not 0.0 < x <= 1.0:
        raise ValueError("must be a number in (0, 1]")
    return x


def _stop_strings(v: Any) -> tuple[str, ...]:
    if isinstance(v, str):  # env form: "a|b" (\\n: a line break)
        return tuple(p.replace("\\n", "\n") for p in v.split("|") if p)
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise ValueError("must be a list of strings")
    return tuple(v)


def _keymap(v: Any) -> dict[str, str]:
    if isinstance(v, str):  # env form: "id=key,id=key"
        out = {}
        for item in filter(None, (s.strip() for s in v.split(","))):
            bid, sep, key = item.partition("=")
            if not sep:
                raise ValueError("must be a list of id=key pairs separated by commas")
            out[bid.strip()] = key.strip()
        v = out
    if not isinstance(v, Mapping):
        raise TypeError("must be a table of binding id = key")
    for bid, key in v.items():
        if not isinstance(bid, str) or not bid or not isinstance(key, str) or not key.strip():
            raise ValueError(f"entry {bid!r} = {key!r}: binding id and key must be strings")
    return {bid: key.strip() for bid, key in v.items()}


def _names(v: Any) -> list[str]:
    if isinstance(v, str):  # env form: "a,b"
        v = [p.strip() for p in v.split(",") if p.strip()]
    if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
        raise TypeError("must be a list of names")
    return list(v)


def _chunk_attention(v: Any) -> int | None:
    if isinstance(v, str) and v.strip().lower() in ("auto", ""):
        return None
    if isinstance(v, str) and v.strip().lower() == "off":
        return 0
    return _nonneg_int(v)


PARSERS: dict[str, Callable[[Any], Any]] = {
    "model": _model,
    "cache_dir": _path,
    "models_dir": _path,
    "data_dir": _path,
    "block_size": _positive_int,
    "prefill_chunk": _positive_int,
    "prefill_step": _nonneg_int,
    "chunk_attention": _chunk_attention,
    "bitwise": _to_bool,
    "choose_recompute": _to_bool,
    "hot_bytes": _size,
    "ssd_bytes": _auto(_size),
    "ssd_write_budget": _size,
    "ssd_admission": _to_bool,
    "ssd_flush_idle_s": _nonneg_float,
    "ssd_write_while_busy": _auto(_to_bool),
    "cuda_graphs": _to_bool,
    "tail_entries": _nonneg_int,
    "checkpoint_entries": _nonneg_int,
    "pin_system": _to_bool,
    "writer_queue": _positive_int,
    "no_cache": _to_bool,
    # the sampling keys: the type here, the range where SamplingParams is made
    "temperature": _to_float,
    "top_p": _to_float,
    "top_k": _to_int,
    "min_p": _to_float,
    "repetition_penalty": _to_float,
    "repetition_context_size": _to_int,
    "presence_penalty": _to_float,
    "frequency_penalty": _to_float,
    "stop": _stop_strings,
    "max_tokens": _to_int,
    "seed": _optional(_to_int),
    "swipe_temperature": _temperature,
    "kv_bits": _optional(_kv_bits),
    "kv_group_size": _group_size,
    "memory_limit": _auto(_optional(_memory_limit)),
    "memory_soft_fraction": _fraction,
    "memory_hard_fraction": _fraction,
    "store_busy_s": _positive_float,
    "mcp_config": _optional(_path),
    "tool_rounds": _positive_int,
    "tool_timeout_s": _positive_float,
    "tools_auto_allow": _names,
    "keymap": _keymap,
}
KEYS: tuple[str, ...] = (
    *(f.name for f in fields(Settings) if f.name not in ("sources", "sampling")),
    *SAMPLING_KEYS,
)
assert set(KEYS) == set(PARSERS)


def value_of(settings: Settings, key: str) -> Any:
    """The value of config key ``key`` (a sampling key's from ``settings.sampling``)."""
    return getattr(settings.sampling if key in SAMPLING_KEYS else settings, key)


def to_toml(settings: Settings) -> str:
    """``settings`` as a config file's text (every key but ``keymap``; None, i.e. auto,
    left out), which :func:`load_settings` reads back to the same values: for starting
    another process with exactly these settings (``TIERCHAT_CONFIG``)."""
    lines = []
    for key in KEYS:
        value = value_of(settings, key)
        if key == "keymap" or value is None:
            continue
        if isinstance(value, tuple):  # stop strings: a TOML array of basic strings
            text = json.dumps(list(value))
        elif isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, list):
            text = json.dumps([str(v) for v in value])
        elif isinstance(value, int | float):
            text = repr(value)
        else:  # a TOML basic string (JSON's escapes are TOML's)
            text = json.dumps(str(value))
        lines.append(f"{key} = {text}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- loading


def _apply(settings: Settings, key: str, raw: Any, source: str) -> None:
    try:
        value = PARSERS[key](raw)
    except (ValueError, TypeError) as e:
        shown = raw if isinstance(raw, str) and source.startswith("env") else repr(raw)
        raise SettingsError(f"{key} = {shown} (from {source}): {e}") from None
    if key == "keymap":
        settings.keymap.update(value)
        for bid in value:
            settings.sources[f"keymap.{bid}"] = source
    elif key in SAMPLING_KEYS:
        try:
            settings.sampling = dataclasses.replace(settings.sampling, **{key: value})
        except SamplingError as e:
            shown = raw if isinstance(raw, str) and source.startswith("env") else repr(raw)
            raise SettingsError(f"{key} = {shown} (from {source}): {e.problem}") from None
        settings.sources[key] = source
    else:
        setattr(settings, key, value)
        settings.sources[key] = source


def _read_toml(path: Path, explicit: bool) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        if explicit:
            raise SettingsError(f"config file {path} does not exist") from None
        return {}
    except tomllib.TOMLDecodeError as e:
        raise SettingsError(f"config file {path} is not valid TOML: {e}") from None
    except UnicodeDecodeError as e:
        raise SettingsError(
            f"config file {path} is not UTF-8 text ({e.reason} at byte {e.start})"
        ) from None
    except OSError as e:
        raise SettingsError(f"config file {path} cannot be read: {e.strerror}") from None


def load_settings(
    cli_overrides: Mapping[str, Any] | None = None,
    env: Mapping[str, str] = os.environ,
    config_path: str | os.PathLike | None = None,
) -> Settings:
    """Effective settings: defaults < config file < env ``TIERCHAT_<KEY>`` < ``cli_overrides``.

    ``cli_overrides`` maps keys (``block_size`` or ``block-size``) to values; None values
    are skipped (argparse's "not given"). The config file is ``config_path``, else env
    ``TIERCHAT_CONFIG``, else ``config.toml`` in the user config dir (may be absent).

    Raises :class:`SettingsError` for an unknown key in the file or CLI, an invalid value,
    a missing explicitly named config file, malformed TOML, or
    ``memory_soft_fraction >= memory_hard_fraction``.
    """
    settings = Settings()
    settings.sources = dict.fromkeys(KEYS, "default")
    del settings.sources["keymap"]

    explicit = config_path is not None or bool(env.get(CONFIG_ENV))
    path = Path(config_path or env.get(CONFIG_ENV) or default_config_path()).expanduser()
    data = _read_toml(path, explicit)
    for key, raw in data.items():
        if key not in PARSERS:
            raise SettingsError(f"{key} (from file {path}): unknown setting")
        _apply(settings, key, raw, f"file {path}")

    for key in KEYS:
        name = ENV_PREFIX + key.upper()
        if name in env:
            _apply(settings, key, env[name], f"env {name}")

    for flag, raw in (cli_overrides or {}).items():
        key = flag.lstrip("-").replace("-", "_")
        if raw is None:
            continue
        if key not in PARSERS:
            raise SettingsError(f"{key} (from cli --{key.replace('_', '-')}): unknown setting")
        _apply(settings, key, raw, f"cli --{key.replace('_', '-')}")

    if settings.memory_soft_fraction >= settings.memory_hard_fraction:
        soft, hard = settings.memory_soft_fraction, settings.memory_hard_fraction
        raise SettingsError(
            f"memory_soft_fraction = {soft} (from {settings.sources['memory_soft_fraction']}) "
            f"must be below memory_hard_fraction = {hard} "
            f"(from {settings.sources['memory_hard_fraction']})"
        )
    return settings


# settings whose None means "decided at load" (`tierchat config` shows "auto"): the chunk
# attention plan, the SSD tier's cap, writes while busy, the memory limit (docs/DESIGN.md)
AUTO_KEYS = frozenset({"chunk_attention", "ssd_bytes", "ssd_write_while_busy", "memory_limit"})


def shown(key: str, value: Any) -> Any:
    """``value`` as ``tierchat config`` prints it: "auto" for an automatic setting left to
    the engine, "none" for another unset one."""
    if value is None:
        return "auto" if key in AUTO_KEYS else "none"
    return value


def explain(settings: Settings) -> list[tuple[str, Any, str]]:
    """``(key, value, source)`` for every setting, keymap entries as ``keymap.<id>``.

    Source is "default", "file PATH", "env NAME" or "cli --flag"; settings built directly
    (not by :func:`load_settings`) report "default" for values with no recorded source.
    """
    rows: list[tuple[str, Any, str]] = []
    for key in KEYS:
        if key == "keymap":
            for bid, k in sorted(settings.keymap.items()):
                rows.append((f"keymap.{bid}", k, settings.sources.get(f"keymap.{bid}", "default")))
        else:
            rows.append((key, value_of(settings, key), settings.sources.get(key, "default")))
    return rows
