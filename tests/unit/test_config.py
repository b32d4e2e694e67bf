"""Settings: precedence (defaults < file < env < CLI), size parsing and every error path."""

from __future__ import annotations

from pathlib import Path

import pytest
from tierchat.config import Settings, SettingsError, explain, load_settings, parse_size
from tierchat.config.settings import GiB, physical_ram_bytes
from tierchat.core.sampling_params import SamplingParams


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(text)
    return path


def load(tmp_path: Path, toml: str = "", env: dict | None = None, cli: dict | None = None):
    return load_settings(cli, env=env or {}, config_path=write(tmp_path, toml))


def test_defaults(tmp_path):
    s = load_settings(env={}, config_path=write(tmp_path, ""))
    assert s.model == "demo"
    assert s.block_size == 256
    assert s.ssd_bytes is None  # auto: sized at load from the model (core/engine/runtime.py)
    assert s.hot_bytes == physical_ram_bytes() // 4
    assert s.cache_dir.name == "kv" and s.models_dir.name == "models"
    assert s.db_path == s.data_dir / "conversations.sqlite"
    assert (s.kv_bits, s.memory_limit, s.keymap) == (None, None, {})
    assert (s.tail_entries, s.checkpoint_entries, s.writer_queue) == (64, 32, 4096)
    assert (s.pin_system, s.no_cache, s.kv_group_size) == (True, False, 64)
    assert s.sampling == SamplingParams()  # the one set of sampling defaults
    assert (s.sampling.max_tokens, s.sampling.seed, s.sampling.temperature) == (512, None, 0.0)
    assert (s.memory_soft_fraction, s.memory_hard_fraction) == (0.80, 0.92)
    assert all(src == "default" for _, _, src in explain(s))


def test_missing_default_file_is_fine(tmp_path, monkeypatch):
    monkeypatch.setattr(
        "tierchat.config.settings.default_config_path", lambda: tmp_path / "absent.toml"
    )
    assert load_settings(env={}).block_size == 256


def test_precedence_file_env_cli(tmp_path):
    path = write(
        tmp_path,
        'block_size = 512\nhot_bytes = "6GB"\nmodel = "tiny:llama"\nseed = 3\n'
        '[keymap]\nquit = "ctrl+q"\nregenerate = "r"\n',
    )
    env = {"TIERCHAT_BLOCK_SIZE": "128", "TIERCHAT_SEED": "4", "TIERCHAT_KEYMAP": "quit=ctrl+x"}
    s = load_settings({"block_size": 64, "max-tokens": 32, "seed": None}, env=env, config_path=path)
    assert s.block_size == 64
    assert s.hot_bytes == 6 * 10**9
    assert s.model == "tiny:llama"
    assert s.sampling.seed == 4
    assert s.sampling.max_tokens == 32
    assert s.keymap == {"quit": "ctrl+x", "regenerate": "r"}
    rows = {k: (v, src) for k, v, src in explain(s)}
    assert rows["block_size"] == (64, "cli --block-size")
    assert rows["hot_bytes"] == (6 * 10**9, f"file {path}")
    assert rows["seed"] == (4, "env TIERCHAT_SEED")
    assert rows["max_tokens"] == (32, "cli --max-tokens")
    assert rows["keymap.quit"] == ("ctrl+x", "env TIERCHAT_KEYMAP")
    assert rows["keymap.regenerate"] == ("r", f"file {path}")
    assert rows["ssd_bytes"][1] == "default"


def test_config_shows_an_automatic_setting_as_auto(tmp_path):
    """An automatic setting left to the engine reads "auto" (and "auto" parses back), an
    unset optional one "none"."""
    from tierchat.config.settings import shown

    s = load(tmp_path, env={"TIERCHAT_MEMORY_LIMIT": "auto", "TIERCHAT_SSD_BYTES": "auto"})
    assert s.memory_limit is None and s.ssd_bytes is None
    assert shown("memory_limit", s.memory_limit) == shown("ssd_bytes", None) == "auto"
    assert shown("kv_bits", None) == "none" and shown("block_size", 64) == 64


def test_config_path_from_env(tmp_path):
    path = write(tmp_path, "tail_entries = 2\n")
    s = load_settings(env={"TIERCHAT_CONFIG": str(path)})
    assert s.tail_entries == 2


def test_env_types(tmp_path):
    env = {
        "TIERCHAT_NO_CACHE": "yes",
        "TIERCHAT_PIN_SYSTEM": "0",
        "TIERCHAT_KV_BITS": "4",
        "TIERCHAT_MEMORY_LIMIT": "12GiB",
        "TIERCHAT_TEMPERATURE": "0.7",
        "TIERCHAT_CACHE_DIR": "~/kvcache",
    }
    s = load(tmp_path, env=env)
    assert s.no_cache is True and s.pin_system is False
    assert s.kv_bits == 4 and s.memory_limit == 12 * GiB
    assert s.sampling.temperature == 0.7
    assert s.cache_dir == Path("~/kvcache").expanduser()
    s = load(tmp_path, env={"TIERCHAT_KV_BITS": "none", "TIERCHAT_MEMORY_LIMIT": ""})
    assert s.kv_bits is None and s.memory_limit is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", 0),
        ("1024", 1024),
        (4096, 4096),
        ("512MB", 512 * 10**6),
        ("6GB", 6 * 10**9),
        ("6 gb", 6 * 10**9),
        ("16GiB", 16 << 30),
        ("1.5GiB", 3 << 29),
        ("2k", 2048),
        ("3M", 3 << 20),
        ("10B", 10),
        ("1TB", 10**12),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GB", "-1", "6XB", "1.2.3GB", "six", -5, True])
def test_parse_size_rejects(text):
    with pytest.raises((ValueError, TypeError)):
        parse_size(text)


def test_error_message_names_key_value_and_source(tmp_path):
    with pytest.raises(SettingsError) as e:
        load(tmp_path, env={"TIERCHAT_BLOCK_SIZE": "-3"})
    assert str(e.value) == (
        "block_size = -3 (from env TIERCHAT_BLOCK_SIZE): must be a positive integer"
    )


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("model", ""),
        ("model", 3),
        ("cache_dir", ""),
        ("block_size", 0),
        ("block_size", "many"),
        ("block_size", True),
        ("hot_bytes", "lots"),
        ("ssd_bytes", -1),
        ("tail_entries", -1),
        ("checkpoint_entries", 1.5),
        ("pin_system", "maybe"),
        ("writer_queue", 0),
        ("no_cache", 2),
        ("max_tokens", -5),
        ("seed", -1),
        ("temperature", -0.1),
        ("temperature", "hot"),
        ("top_p", 0),
        ("top_p", 1.5),
        ("min_p", 1),
        ("repetition_penalty", 0),
        ("presence_penalty", 3),
        ("repetition_context_size", 0),
        ("stop", 5),
        ("kv_bits", 7),
        ("kv_group_size", 48),
        ("memory_limit", "0"),
        ("memory_soft_fraction", 0),
        ("memory_hard_fraction", 1.2),
        ("keymap", "quit"),
        ("keymap", 5),
    ],
)
def test_invalid_values_from_cli(tmp_path, key, value):
    with pytest.raises(SettingsError, match=rf"^{key} = .*\(from cli --{key.replace('_', '-')}\)"):
        load(tmp_path, cli={key: value})


def test_invalid_value_from_file(tmp_path):
    path = write(tmp_path, 'ssd_bytes = "huge"\n')
    with pytest.raises(SettingsError, match=rf"ssd_bytes = 'huge' \(from file {path}\): must be"):
        load_settings(env={}, config_path=path)


def test_invalid_keymap_entry_in_file(tmp_path):
    with pytest.raises(SettingsError, match=r"keymap = .*from file"):
        load(tmp_path, "[keymap]\nquit = 3\n")


def test_unknown_keys(tmp_path):
    with pytest.raises(SettingsError, match=r"blok_size \(from file .*\): unknown setting"):
        load(tmp_path, "blok_size = 3\n")
    with pytest.raises(SettingsError, match=r"colour \(from cli --colour\): unknown setting"):
        load(tmp_path, cli={"colour": "red"})
    # unrelated TIERCHAT_* env vars are not settings and are ignored
    assert load(tmp_path, env={"TIERCHAT_NO_OPENBLAS": "1"}).block_size == 256


def test_file_errors(tmp_path):
    with pytest.raises(SettingsError, match="does not exist"):
        load_settings(env={}, config_path=tmp_path / "nope.toml")
    with pytest.raises(SettingsError, match="does not exist"):
        load_settings(env={"TIERCHAT_CONFIG": str(tmp_path / "nope.toml")})
    with pytest.raises(SettingsError, match="not valid TOML"):
        load(tmp_path, "block_size = = 3\n")
    with pytest.raises(SettingsError, match="cannot be read"):
        load_settings(env={}, config_path=tmp_path)  # a directory


def test_soft_fraction_must_be_below_hard(tmp_path):
    with pytest.raises(SettingsError, match=r"memory_soft_fraction = 0.95 \(from env .*\) must"):
        load(tmp_path, env={"TIERCHAT_MEMORY_SOFT_FRACTION": "0.95"})


def test_explain_settings_built_directly():
    rows = explain(Settings(block_size=16, keymap={"quit": "q"}))
    assert ("block_size", 16, "default") in rows
    assert ("keymap.quit", "q", "default") in rows


def test_to_toml_reads_back_to_the_same_settings(tmp_path):
    """A config file written from settings (as the clients bench starts ``tierchat serve``
    with them) loads to the same values, odd characters and auto values included."""
    from tierchat.config.settings import KEYS, to_toml, value_of

    given = load(
        tmp_path,
        cli={
            "model": 'tiny:llama "quoted" \\ path',
            "cache_dir": str(tmp_path / "kv dir"),
            "hot_bytes": "1GB",
            "bitwise": True,
            "temperature": 0.7,
            "stop": "END|\\n\\n",
            "kv_bits": 8,
        },
    )
    path = tmp_path / "back.toml"
    path.write_text(to_toml(given))
    back = load_settings(env={}, config_path=path)
    for key in KEYS:
        if key != "keymap":
            assert value_of(back, key) == value_of(given, key), key
    assert back.ssd_write_while_busy is None and back.memory_limit is None  # auto stays auto


def test_cuda_graphs_setting_sets_mlx_variable_unless_the_environment_has_it(tmp_path, monkeypatch):
    """``cuda_graphs`` (default off) becomes ``MLX_USE_CUDA_GRAPHS`` before MLX's first CUDA
    work; a value already in the environment wins; a peer started from this process
    (``mlx_lm.server``) gets the environment without what tierchat set."""
    import os

    from tierchat.core import device

    monkeypatch.setenv("MLX_USE_CUDA_GRAPHS", "")  # restored (absent or not) after the test
    monkeypatch.delenv("MLX_USE_CUDA_GRAPHS")
    monkeypatch.setattr(device, "SET_ENV", {})
    assert load(tmp_path).cuda_graphs is False
    assert device.use_cuda_graphs(False) == {"MLX_USE_CUDA_GRAPHS": "0"}
    assert device.use_cuda_graphs(True) == {}  # already set: the environment wins
    assert os.environ["MLX_USE_CUDA_GRAPHS"] == "0"
    assert "MLX_USE_CUDA_GRAPHS" not in device.peer_env()
    assert load(tmp_path, cli={"cuda_graphs": "on"}).cuda_graphs is True


def test_the_sampling_keys_are_sampling_params_fields_with_their_ranges(tmp_path):
    """Every field of the one ``SamplingParams`` is a top-level key of the file (the old
    keys keep their names); a value out of its range is the ``SamplingParams`` check's,
    said with the key's source."""
    from tierchat.config.settings import KEYS
    from tierchat.core.sampling_params import FIELDS

    assert set(FIELDS) <= set(KEYS)
    path = write(
        tmp_path,
        'temperature = 0.7\nseed = 3\nmax_tokens = 64\nstop = ["END", "\\n\\n"]\n'
        "presence_penalty = 0.5\nrepetition_context_size = 64\n",
    )
    s = load_settings(env={}, config_path=path)
    assert s.sampling == SamplingParams(
        temperature=0.7,
        seed=3,
        max_tokens=64,
        stop=("END", "\n\n"),
        presence_penalty=0.5,
        repetition_context_size=64,
    )
    bad = write(tmp_path, "temperature = 9\n")
    with pytest.raises(
        SettingsError, match=r"^temperature = 9 \(from file .*\): must be in 0\.\.5"
    ):
        load_settings(env={}, config_path=bad)
