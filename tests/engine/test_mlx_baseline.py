"""The mlx-lm baseline follows ``mlx_lm.server``'s default path (cli/bench/mlx_baseline.py): its
segments equal the server's own split, and on tiny models it saves and reuses what the
server would (the system prompt's checkpoint on a hybrid, the user segment's for a
regenerate), with replies equal to a cold run."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from mlx_lm.server import ResponseGenerator
from tierchat.cli.bench.mlx_baseline import LRUBaseline, Segment, drop_cached, segments
from tierchat.cli.common import start_engine
from tierchat.config.settings import Settings
from tierchat.core.api import Finished, GenerateRequest
from tierchat.core.sampling_params import SamplingParams

SYSTEM = "You answer briefly. " * 6
CHAT = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "What is a prefix cache?"},
    {"role": "assistant", "content": "It keeps computed keys."},
    {"role": "user", "content": "And on a hybrid model?"},
]


def server_split(tokenizer, messages):
    """``mlx_lm.server``'s own ``_tokenize`` on a chat request, with its defaults."""
    provider = SimpleNamespace(processor=None, cli_args=SimpleNamespace(chat_template_args={}))
    request = SimpleNamespace(
        request_type="chat", messages=[dict(m) for m in messages], tools=None, role_mapping=None
    )
    args = SimpleNamespace(chat_template_kwargs=None)
    me = SimpleNamespace(model_provider=provider)
    prompt, parts, kinds, _, _ = ResponseGenerator._tokenize(me, tokenizer, request, args)
    return list(prompt), [Segment(k, list(p)) for k, p in zip(kinds, parts, strict=True)]


class Thinking:
    """A tiny tokenizer whose generation prompt ends in an opened thinking block (the
    character ``@``), like Qwen3's templates."""

    def __init__(self, tokenizer):
        self.inner = tokenizer
        self.think = tokenizer.encode("@", add_special_tokens=False)[0]
        self.has_chat_template = True
        self.has_thinking = True
        self.response_initial_state = None

    def apply_chat_template(self, messages, add_generation_prompt=False, **kw):
        ids = list(
            self.inner.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, **kw
            )
        )
        return ids + [self.think] if add_generation_prompt else ids

    def _rfind(self, tokens, start=None, end=None):
        lo = max(0, start or 0)
        hi = len(tokens) if end is None else end
        return next((i for i in range(hi - 1, lo - 1, -1) if tokens[i] == self.think), -1)

    rfind_think_start = _rfind

    def rfind_think_end(self, tokens, start=None, end=None):
        return -1


def settings(tmp_path, models_dir, model: str) -> Settings:
    return Settings(
        model=model,
        models_dir=models_dir,
        cache_dir=tmp_path / "kv",
        data_dir=tmp_path / "data",
        block_size=16,
        hot_bytes=256 << 20,
    )


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory, models_dir):
    engine = start_engine(settings(tmp_path_factory.mktemp("t"), models_dir, "tiny:qwen2"))
    try:
        yield engine.tokenizer
    finally:
        engine.close()


@pytest.mark.parametrize("n", [2, 4])  # a first turn; a later turn
def test_segments_equal_the_servers_split(tiny_tokenizer, n):
    for tok in (tiny_tokenizer, Thinking(tiny_tokenizer)):
        prompt, theirs = server_split(tok, CHAT[:n])
        ours = segments(tok, CHAT[:n], prompt)
        assert ours == theirs
        assert [s.kind for s in ours] == (
            ["system", "user", "assistant"] if tok is not tiny_tokenizer else ["system", "user"]
        )
        assert sum((s.tokens for s in ours), []) == prompt


def test_segments_without_a_user_message_last_or_a_chat(tiny_tokenizer):
    prompt, theirs = server_split(tiny_tokenizer, CHAT[:3])
    assert segments(tiny_tokenizer, CHAT[:3], prompt) == theirs == [Segment("assistant", prompt)]
    assert segments(tiny_tokenizer, None, [5, 6, 7]) == [Segment("assistant", [5, 6, 7])]
    no_system = [{"role": "user", "content": "hi"}]
    prompt, theirs = server_split(tiny_tokenizer, no_system)
    assert segments(tiny_tokenizer, no_system, prompt) == theirs == [Segment("user", prompt)]


def test_drop_cached_keeps_the_rest_of_each_segment():
    parts = [Segment("system", [1, 2, 3]), Segment("user", [4, 5]), Segment("assistant", [6])]
    assert drop_cached(parts, 0) == parts
    assert drop_cached(parts, 2) == [Segment("system", [3]), *parts[1:]]
    assert drop_cached(parts, 3) == parts[1:]
    assert drop_cached(parts, 4) == [Segment("user", [5]), parts[2]]
    assert drop_cached(parts, 6) == []


def chat_prompt(tokenizer, messages) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))


@pytest.mark.parametrize("model", ["tiny:qwen3_5", "tiny:qwen2"])  # hybrid, dense
def test_system_and_user_checkpoints_are_reused(tmp_path, models_dir, model):
    engine = start_engine(settings(tmp_path, models_dir, model), quiet=True)
    try:
        tok = engine.tokenizer
        lru = LRUBaseline(engine, model)
        assert lru.batched  # every cache kind of these models merges: the batched path
        a = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "First one?"}]
        b = [a[0], {"role": "user", "content": "Quite another question."}]
        pa, pb = chat_prompt(tok, a), chat_prompt(tok, b)
        sys_end = len(segments(tok, a, pa)[0].tokens)
        assert 0 < sys_end < len(pa)
        assert segments(tok, b, pb)[0].tokens == pa[:sys_end]
        got = {}
        for name, prompt, messages in (("a", pa, a), ("b", pb, b), ("again", pb, b)):
            got[name] = lru.generate(prompt, 6, messages)
            cold = engine.submit(
                GenerateRequest(
                    sampling=SamplingParams(max_tokens=6), prompt_ids=tuple(prompt), use_cache=False
                )
            ).wait(300)
            assert isinstance(cold, Finished)
            assert got[name].tokens == list(cold.token_ids), name
        assert got["a"].counts["cached_tokens"] == 0
        common = next(i for i, (x, y) in enumerate(zip(pa, pb, strict=False)) if x != y)
        if model == "tiny:qwen3_5":
            # a hybrid cannot cut a longer entry back: the system prompt's checkpoint
            # serves the new conversation, the user segment's the regenerate
            assert got["b"].counts["cached_tokens"] == sys_end
            assert got["again"].counts["cached_tokens"] == len(pb) - 1
        else:  # dense: the longer entry is cut back to the common prefix
            assert got["b"].counts["cached_tokens"] == common
            assert got["again"].counts["cached_tokens"] == len(pb) - 1
    finally:
        engine.close()
