"""The model picker's list: built-ins, then local MLX directories (no converted built-ins)."""

from __future__ import annotations

from pathlib import Path

from tierchat.tui.models import BUILTIN_MODELS, local_model_dirs, model_choices


def make_model_dir(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"")
    return path


def test_local_dirs_are_found_and_builtins_are_not_repeated(tmp_path: Path):
    mine = make_model_dir(tmp_path / "mlx-community" / "Llama-3.2-1B-4bit")
    make_model_dir(tmp_path / "demo")
    make_model_dir(tmp_path / "tiny-llama-0")
    (tmp_path / "not-a-model").mkdir()
    assert local_model_dirs(tmp_path) == [mine]
    specs = [c.spec for c in model_choices(tmp_path, test_models=True)]
    assert specs[: len(BUILTIN_MODELS)] == [s for s, _ in BUILTIN_MODELS]
    assert specs[len(BUILTIN_MODELS) :] == [str(mine)]


def test_missing_models_dir_gives_the_builtins():
    assert len(model_choices(Path("/no/such/dir"), test_models=True)) == len(BUILTIN_MODELS)


def test_random_weight_models_are_not_offered_by_default(tmp_path: Path):
    specs = [c.spec for c in model_choices(tmp_path)]
    assert specs == ["demo", "demo-gemma"]
