"""Write the shipped chat workloads of ``tierchat bench --workload`` (cli/workloads/).

    python scripts/make_workload.py     # rewrites cli/workloads/chat.jsonl.gz, chat-ci.jsonl

The system prompt is ``Lib/json/encoder.py`` of the Python that runs this script (CPython's
standard library, Python Software Foundation License Version 2: a permissive license that
allows copying and redistribution), wrapped in a short instruction: ~3.6K tokens on the
Qwen2.5 tokenizer. The shipped files were written from CPython 3.11.7; the bench reads the
JSONL, never this script, so every machine replays the same bytes. ``chat`` holds its system
prompt eight times (the replay format has one per ``new``), so it is gzipped (7 KB, not
140 KB); ``gunzip -k`` gives the plain script for ``tierchat replay``.

Each conversation (8 in ``chat``, 2 in ``chat-ci``) has the op mix of issue 19: a new
conversation with the shared system prompt, two user turns, a regenerate, an edit of the
first turn, another turn, a restart and a last turn; every reply greedy, ``chat`` 40 tokens,
``chat-ci`` 8. ``chat-ci`` takes a short system prompt (the file's two Python string encoders).
The user turns were written for this workload: coding-assistant questions about the file.
"""

from __future__ import annotations

import gzip
import json
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "cli" / "workloads"
SOURCE = "json/encoder.py"

# per conversation: first turn, second turn, the edit of the first turn, third turn, last turn
CONVERSATIONS = [
    (
        "How does py_encode_basestring_ascii handle characters outside the Basic "
        "Multilingual Plane?",
        "Why does the module keep both a C and a Python version of these functions?",
        "Walk me through py_encode_basestring_ascii line by line, including the replace callback.",
        "Write a unittest that checks that a surrogate pair is escaped as two \\u sequences.",
        "Could ESCAPE_DCT be replaced by str.translate? What would change for speed?",
    ),
    (
        "What does allow_nan=False do when the encoder meets float('inf')?",
        "Where exactly is the ValueError raised, and what does its message say?",
        "Explain the floatstr helper inside iterencode and why it takes _repr and _inf "
        "as default arguments.",
        "How would I make NaN encode as null instead of raising, without patching the module?",
        "Is float.__repr__ guaranteed to round-trip here? Cite the part of the code that "
        "relies on it.",
    ),
    (
        "What is check_circular for, and what does the markers dict hold?",
        "Why is id(o) used as the key instead of the object itself?",
        "Show me how a list that contains itself is detected, step by step through "
        "_iterencode_list.",
        "What happens with check_circular=False and a self-referencing dict? Will it "
        "overflow the stack?",
        "Write a small example that triggers 'Circular reference detected' from a custom "
        "default() method.",
    ),
    (
        "How do indent and separators interact when I pass indent=2?",
        "Why does the default item separator change from ', ' to ',' when indent is set?",
        "Explain how _current_indent_level and newline_indent build the output of a nested list.",
        "Can indent be a string such as a tab? Which line converts an integer indent?",
        "How would I get compact output with no spaces at all, like a minifier?",
    ),
    (
        "How are dictionary keys that are not strings handled by _iterencode_dict?",
        "What does skipkeys=True change for a tuple used as a key?",
        "List every key type _iterencode_dict accepts and what string each one becomes.",
        "Why are True, False and None keys checked before int keys in that chain?",
        "With sort_keys=True and mixed int and str keys, what error do I get and why?",
    ),
    (
        "How do I subclass JSONEncoder to support datetime objects?",
        "When exactly is default() called, and what must it return?",
        "Explain the contract of JSONEncoder.default and show an encoder for sets and Decimal.",
        "Why does the base default() raise TypeError instead of returning a string?",
        "Can default() return another unsupported object? What happens then?",
    ),
    (
        "What is the difference between encode() and iterencode()?",
        "What does the _one_shot flag change in iterencode?",
        "Explain why encode() special-cases str before calling iterencode.",
        "How would I stream a large list to a file chunk by chunk with iterencode?",
        "Does json.dump use iterencode? What does that mean for memory use?",
    ),
    (
        "When is c_make_encoder used instead of _make_iterencode?",
        "Which arguments does c_make_encoder take, and in what order?",
        "Explain the condition in iterencode that chooses between the C and Python encoders.",
        "Why does passing indent force the pure Python path?",
        "How could I measure the speed difference between the two paths with timeit?",
    ),
]


def system_prompt(source: str, version: str) -> str:
    return (
        "You are a careful coding assistant. The user is reading the file below, "
        f"Lib/json/encoder.py from CPython {version} (Python Software Foundation License "
        "Version 2). Answer questions about it precisely and briefly, quoting the code where "
        f"it helps.\n\n```python\n{source}```\n"
    )


def conversation(system: str, turns: tuple[str, ...], max_tokens: int) -> list[dict]:
    first, second, edited, third, last = turns
    return [
        {"op": "new", "system": system},
        {"op": "user", "text": first, "max_tokens": max_tokens},
        {"op": "user", "text": second, "max_tokens": max_tokens},
        {"op": "regenerate", "max_tokens": max_tokens},
        {"op": "edit", "turn": 0, "text": edited, "max_tokens": max_tokens},
        {"op": "user", "text": third, "max_tokens": max_tokens},
        {"op": "restart"},
        {"op": "user", "text": last, "max_tokens": max_tokens},
    ]


def write(path: Path, ops: list[dict]) -> None:
    data = "".join(json.dumps(op, ensure_ascii=False) + "\n" for op in ops).encode("utf-8")
    if path.suffix == ".gz":  # mtime 0: the same bytes every time
        data = gzip.compress(data, compresslevel=9, mtime=0)
    path.write_bytes(data)
    print(f"{path.relative_to(ROOT)}: {len(ops)} ops, {path.stat().st_size} bytes")


def main() -> int:
    source = (Path(sysconfig.get_paths()["stdlib"]) / SOURCE).read_text()
    version = ".".join(map(str, sys.version_info[:3]))
    OUT.mkdir(parents=True, exist_ok=True)
    system = system_prompt(source, version)
    write(OUT / "chat.jsonl.gz", [op for c in CONVERSATIONS for op in conversation(system, c, 40)])
    # the CI-sized one: the two string encoders of the same file as its system prompt
    start = source.find("def py_encode_basestring(s):")
    end = source.find("class JSONEncoder")
    if start < 0 or end < start:
        raise SystemExit(f"py_encode_basestring(_ascii) not found in {SOURCE}")
    short = system_prompt(source[start:end].rstrip("\n") + "\n", version)
    write(
        OUT / "chat-ci.jsonl", [op for c in CONVERSATIONS[:2] for op in conversation(short, c, 8)]
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
