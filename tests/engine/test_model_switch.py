"""The first reply after a model switch decodes with the new model (core/engine/
scheduler.py): the decode batch was made once and kept the first model, so after
``demo`` → ``demo-gemma`` the first reply ran the old layers on the new caches, failed
with a concatenate error, and the TUI gave the message back to the input."""

from __future__ import annotations

from engine_kit import generate, make_engine, random_prompt

PROMPT = random_prompt(40, seed=3)


def test_the_first_reply_after_a_switch_equals_a_fresh_engines(tmp_path, models_dir):
    fresh = make_engine("tiny:gemma3", tmp_path / "fresh", models_dir, no_cache=True)
    try:
        want, _ = generate(fresh, PROMPT, max_tokens=6)
    finally:
        fresh.close()
    e = make_engine("tiny:llama", tmp_path, models_dir)
    try:
        generate(e, PROMPT, max_tokens=6)  # the decode batch is made for tiny:llama
        loaded = e.load_model("tiny:gemma3").wait(120)
        assert not hasattr(loaded, "message"), loaded
        got, _ = generate(e, PROMPT, max_tokens=6)  # Finished, not an engine error
        assert got.token_ids == want.token_ids
    finally:
        e.close()
