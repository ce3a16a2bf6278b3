"""Synthetic chat conversations for the demo, plus writers for the two raw input formats.

The demo must run offline and reproduce byte for byte, so instead of shipping a
real corpus we generate English-like prose, lists and code from a fixed word list
and templates driven by one seeded :class:`random.Random`.  The shape of the data
is what matters for the pipeline: multi-turn chats, optional system prompts,
``<think>`` reasoning that a Qwen3 template strips from earlier turns, the odd tool
response, and a long-tailed length distribution (lognormal message lengths) so
that batching, bucketing and truncation all get exercised.

The writers also append a handful of deliberately malformed records so the demo
shows the pipeline's reject handling (see ``data/README.md``).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

from hsx_dagster.core.inputs.chat_template import THINK_CLOSE, THINK_OPEN

T = TypeVar("T")
Message = dict[str, str]
Conversation = list[Message]

# OpenAI role -> ShareGPT "from" value.
SHAREGPT_ROLE = {"system": "system", "user": "human", "assistant": "gpt"}

# Fraction of conversations with each feature.
SYSTEM_RATE = 0.30
REASONING_RATE = 0.30
TOOL_RATE = 0.02

# Lognormal word-count parameters per message kind: (mu, sigma, cap).  Tuned so
# the templated conversations average ~335 demo-tokenizer tokens with a thin tail
# past 2,000 tokens (numbers measured are in data/README.md).
_USER_WORDS = (2.5, 1.0, 900)
_ASSISTANT_WORDS = (3.05, 1.4, 3600)
_REASONING_WORDS = (3.3, 0.7, 900)
# Chance that a user turn pastes a long document/code listing to ask about.
_PASTE_RATE = 0.025
_PASTE_WORDS = (5.0, 0.8, 2600)

_NOUNS = (
    "account",
    "action",
    "address",
    "agent",
    "algorithm",
    "answer",
    "archive",
    "array",
    "artifact",
    "asset",
    "attempt",
    "backend",
    "balance",
    "batch",
    "benchmark",
    "block",
    "bottle",
    "boundary",
    "branch",
    "bridge",
    "bucket",
    "buffer",
    "budget",
    "bug",
    "cache",
    "camera",
    "candidate",
    "channel",
    "chapter",
    "checkpoint",
    "circle",
    "client",
    "cluster",
    "column",
    "comment",
    "commit",
    "compiler",
    "component",
    "condition",
    "config",
    "connection",
    "container",
    "context",
    "contract",
    "counter",
    "customer",
    "cycle",
    "dashboard",
    "database",
    "dataset",
    "deadline",
    "decision",
    "default",
    "dependency",
    "deployment",
    "device",
    "diagram",
    "dictionary",
    "directory",
    "document",
    "domain",
    "draft",
    "driver",
    "edge",
    "editor",
    "element",
    "engine",
    "entry",
    "environment",
    "error",
    "event",
    "example",
    "exception",
    "experiment",
    "factor",
    "feature",
    "field",
    "file",
    "filter",
    "folder",
    "format",
    "formula",
    "frame",
    "function",
    "garden",
    "gateway",
    "graph",
    "group",
    "handler",
    "header",
    "helper",
    "history",
    "host",
    "image",
    "index",
    "input",
    "instance",
    "interface",
    "invoice",
    "issue",
    "item",
    "job",
    "kernel",
    "key",
    "kitchen",
    "label",
    "layer",
    "layout",
    "library",
    "limit",
    "line",
    "list",
    "loader",
    "lock",
    "log",
    "loop",
    "machine",
    "manager",
    "map",
    "market",
    "matrix",
    "memory",
    "message",
    "method",
    "metric",
    "model",
    "module",
    "monitor",
    "network",
    "node",
    "note",
    "number",
    "object",
    "offset",
    "operator",
    "option",
    "order",
    "output",
    "owner",
    "package",
    "page",
    "parameter",
    "parser",
    "partition",
    "path",
    "pattern",
    "payload",
    "pipeline",
    "plan",
    "platform",
    "pointer",
    "policy",
    "pool",
    "port",
    "process",
    "product",
    "profile",
    "project",
    "prompt",
    "property",
    "protocol",
    "query",
    "queue",
    "range",
    "rate",
    "reader",
    "record",
    "recipe",
    "region",
    "registry",
    "release",
    "report",
    "request",
    "resource",
    "response",
    "result",
    "river",
    "role",
    "router",
    "row",
    "rule",
    "sample",
    "scheduler",
    "schema",
    "score",
    "script",
    "section",
    "sensor",
    "server",
    "service",
    "session",
    "setting",
    "shard",
    "signal",
    "snapshot",
    "socket",
    "source",
    "stack",
    "stage",
    "state",
    "step",
    "storage",
    "stream",
    "string",
    "structure",
    "student",
    "summary",
    "system",
    "table",
    "target",
    "task",
    "teacher",
    "template",
    "tensor",
    "test",
    "thread",
    "ticket",
    "token",
    "tool",
    "topic",
    "trace",
    "tree",
    "type",
    "update",
    "user",
    "value",
    "variable",
    "vector",
    "version",
    "volume",
    "window",
    "worker",
    "workflow",
    "writer",
)
_VERBS = (
    "accept",
    "adjust",
    "allocate",
    "append",
    "apply",
    "archive",
    "assign",
    "avoid",
    "build",
    "cache",
    "call",
    "check",
    "clean",
    "clear",
    "collect",
    "combine",
    "compare",
    "compile",
    "compute",
    "configure",
    "convert",
    "copy",
    "count",
    "create",
    "debug",
    "decode",
    "define",
    "delete",
    "deploy",
    "describe",
    "detect",
    "display",
    "download",
    "encode",
    "enable",
    "evaluate",
    "expand",
    "export",
    "extract",
    "fetch",
    "filter",
    "find",
    "fix",
    "format",
    "generate",
    "group",
    "handle",
    "import",
    "improve",
    "include",
    "index",
    "inspect",
    "install",
    "limit",
    "load",
    "lock",
    "log",
    "measure",
    "merge",
    "monitor",
    "move",
    "normalize",
    "open",
    "parse",
    "patch",
    "pause",
    "print",
    "process",
    "read",
    "record",
    "reduce",
    "refresh",
    "register",
    "release",
    "remove",
    "rename",
    "render",
    "repair",
    "replace",
    "report",
    "request",
    "reset",
    "resolve",
    "restart",
    "restore",
    "return",
    "review",
    "rotate",
    "route",
    "run",
    "sample",
    "save",
    "scale",
    "schedule",
    "search",
    "select",
    "send",
    "sort",
    "split",
    "start",
    "stop",
    "store",
    "stream",
    "support",
    "test",
    "track",
    "train",
    "transform",
    "trigger",
    "update",
    "upload",
    "validate",
    "verify",
    "wrap",
    "write",
)
_ADJECTIVES = (
    "active",
    "basic",
    "brief",
    "broken",
    "careful",
    "central",
    "clean",
    "clear",
    "common",
    "complex",
    "correct",
    "current",
    "custom",
    "daily",
    "dedicated",
    "deep",
    "default",
    "detailed",
    "different",
    "direct",
    "dynamic",
    "early",
    "easy",
    "efficient",
    "empty",
    "entire",
    "exact",
    "existing",
    "expensive",
    "explicit",
    "external",
    "extra",
    "fast",
    "final",
    "first",
    "fixed",
    "flat",
    "flexible",
    "full",
    "general",
    "global",
    "good",
    "heavy",
    "hidden",
    "high",
    "important",
    "initial",
    "internal",
    "large",
    "last",
    "late",
    "lazy",
    "legacy",
    "light",
    "linear",
    "local",
    "long",
    "low",
    "main",
    "manual",
    "minimal",
    "missing",
    "modern",
    "narrow",
    "native",
    "nested",
    "new",
    "next",
    "normal",
    "old",
    "open",
    "optional",
    "original",
    "partial",
    "previous",
    "primary",
    "private",
    "public",
    "quick",
    "random",
    "raw",
    "readable",
    "recent",
    "regular",
    "remote",
    "safe",
    "secure",
    "separate",
    "serial",
    "shared",
    "short",
    "simple",
    "single",
    "slow",
    "small",
    "smooth",
    "specific",
    "stable",
    "standard",
    "static",
    "strict",
    "strong",
    "temporary",
    "tiny",
    "typical",
    "unique",
    "useful",
    "valid",
    "visible",
    "warm",
    "weekly",
    "wide",
)
_ADVERBS = (
    "actually",
    "again",
    "already",
    "always",
    "carefully",
    "clearly",
    "directly",
    "easily",
    "eventually",
    "finally",
    "first",
    "generally",
    "immediately",
    "instead",
    "later",
    "mostly",
    "normally",
    "often",
    "only",
    "quickly",
    "rarely",
    "really",
    "safely",
    "simply",
    "slowly",
    "sometimes",
    "still",
    "then",
    "typically",
    "usually",
)
_PREPOSITIONS = (
    "about",
    "across",
    "after",
    "against",
    "around",
    "before",
    "behind",
    "between",
    "by",
    "during",
    "for",
    "from",
    "in",
    "inside",
    "into",
    "near",
    "of",
    "on",
    "over",
    "through",
    "under",
    "with",
    "within",
    "without",
)
_CONNECTIVES = (
    "However",
    "In practice",
    "For example",
    "As a result",
    "In that case",
    "Otherwise",
    "On the other hand",
    "By default",
    "In short",
    "Note that",
    "Also",
    "Meanwhile",
    "Usually",
    "At this point",
    "To be safe",
)
_LANGUAGES = ("Python", "Rust", "Go", "TypeScript", "SQL", "Bash", "C++", "Java", "Kotlin")
# A sprinkle of non-ASCII so byte-level round-trips are exercised by real data.
_UNICODE_WORDS = (
    "café",
    "naïve",
    "über",
    "façade",
    "résumé",
    "jalapeño",
    "Zürich",
    "São Paulo",
    "Ærø",
    "déjà vu",
    "piñata",
    "Kraków",
    "→",
    "✓",
    "—",
    "±",
    "µs",
    "°C",
    "€",
    "日本語",
    "你好",
    "Привет",
    "🙂",
    "🚀",
)
_DOUBLED_FINAL = ("debug", "log", "run", "stop", "wrap")
_NAMES = ("Alice", "Bob", "Carmen", "Dmitri", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jonas")


def _plural(noun: str) -> str:
    if noun.endswith(("s", "x", "sh", "ch")):
        return noun + "es"
    if noun.endswith("y") and noun[-2] not in "aeiou":
        return noun[:-1] + "ies"
    return noun + "s"


def _a(word: str) -> str:
    """Prefix the indefinite article ("a cache", "an index")."""
    return ("an " if word[0] in "aeiouAEIOU" else "a ") + word


def _third_person(verb: str) -> str:
    """ "fix" -> "fixes", "copy" -> "copies": same spelling rules as plurals."""
    return _plural(verb)


def _gerund(verb: str) -> str:
    if verb in _DOUBLED_FINAL:
        return verb + verb[-1] + "ing"
    if verb.endswith("e") and not verb.endswith("ee"):
        return verb[:-1] + "ing"
    return verb + "ing"


class _TextGenerator:
    """Template-based text generator; all randomness comes from the one ``rng``."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    # -- words -------------------------------------------------------------------------
    def noun(self) -> str:
        return self.rng.choice(_NOUNS)

    def nouns(self) -> str:
        return _plural(self.noun())

    def verb(self) -> str:
        return self.rng.choice(_VERBS)

    def adj(self) -> str:
        if self.rng.random() < 0.01:
            return self.rng.choice(_UNICODE_WORDS)
        return self.rng.choice(_ADJECTIVES)

    def ident(self) -> str:
        return f"{self.verb()}_{self.noun()}"

    def lognormal_words(self, params: tuple[float, float, int]) -> int:
        mu, sigma, cap = params
        return max(1, min(cap, int(self.rng.lognormvariate(mu, sigma))))

    # -- prose -------------------------------------------------------------------------
    def sentence(self) -> str:
        r = self.rng
        kind = r.randrange(10)
        n1, n2 = self.noun(), self.noun()
        if kind == 0:
            return (
                f"The {self.adj()} {n1} {_third_person(self.verb())} the {n2} {r.choice(_PREPOSITIONS)} "
                f"the {self.adj()} {self.noun()}."
            )
        if kind == 1:
            return (
                f"{r.choice(_CONNECTIVES)}, you can {self.verb()} each {n1} before the {n2} "
                f"{_third_person(self.verb())}."
            )
        if kind == 2:
            return f"If the {n1} is {self.adj()}, {self.verb()} it {r.choice(_PREPOSITIONS)} {_a(self.adj())} {n2}."
        if kind == 3:
            return (
                f"We {r.choice(_ADVERBS)} {self.verb()} {r.randint(2, 64)} {_plural(n1)} per {n2}, "
                f"which keeps the {self.noun()} {self.adj()}."
            )
        if kind == 4:
            return (
                f"This {_third_person(self.verb())} because the {n1} {r.choice(_ADVERBS)} "
                f"{_third_person(self.verb())} the {_plural(n2)}."
            )
        if kind == 5:
            return (
                f"{_gerund(self.verb()).capitalize()} the {n1} is {self.adj()}, but "
                f"{_gerund(self.verb())} the {n2} is {r.choice(_ADVERBS)} {self.adj()}."
            )
        if kind == 6:
            return f"Make sure the `{self.ident()}` {n1} returns {_a(self.adj())} {n2}."
        if kind == 7:
            return (
                f"{r.choice(_NAMES)} said the {n1} took about {r.randint(1, 900)} ms "
                f"{r.choice(_PREPOSITIONS)} the {self.adj()} {n2}."
            )
        if kind == 8:
            return f"Do you want the {self.adj()} {n1} or the {self.adj()} {n2}?"
        return (
            f"{_a(self.adj()).capitalize()} {n1} and {_a(self.adj())} {n2} should {self.verb()} the same {self.noun()}."
        )

    def paragraph(self, sentences: int) -> str:
        return " ".join(self.sentence() for _ in range(max(1, sentences)))

    def bullet_list(self, items: int, numbered: bool) -> str:
        lines = []
        for i in range(max(2, items)):
            marker = f"{i + 1}." if numbered else self.rng.choice(("-", "*"))
            body = (
                f"**{self.verb().capitalize()} the {self.noun()}**: {self.sentence()}"
                if self.rng.random() < 0.4
                else self.sentence()
            )
            lines.append(f"{marker} {body}")
        return "\n".join(lines)

    def code_block(self, lines: int) -> str:
        r = self.rng
        lang = r.choice(("python", "python", "bash", "json", "sql"))
        body: list[str] = []
        if lang == "python":
            fn, arg = self.ident(), self.noun()
            body.append(f"def {fn}({_plural(arg)}, limit={r.randint(1, 512)}):")
            body.append(f'    """{self.sentence()}"""')
            body.append("    result = []")
            while len(body) < lines:
                var = self.noun()
                body.append(f"    for {var} in {_plural(arg)}[:limit]:")
                body.append(f"        if {var}.{r.choice(_ADJECTIVES)}_{self.noun()} > {r.randint(0, 99)}:")
                body.append(f"            result.append({self.ident()}({var}))")
            body.append("    return result")
        elif lang == "bash":
            while len(body) < lines:
                body.append(
                    f"{r.choice(('git', 'docker', 'kubectl', 'python -m', 'make'))} {self.verb()} "
                    f"--{self.noun()}={r.choice(_ADJECTIVES)} ./{self.noun()}/{self.noun()}.txt"
                )
        elif lang == "json":
            items = [
                f'  "{self.noun()}_{i}": {json.dumps(r.choice((r.randint(0, 9999), self.adj(), True, None)))}'
                for i in range(max(2, lines))
            ]
            body = ["{", ",\n".join(items), "}"]
        else:
            body.append(f"SELECT {self.noun()}, COUNT(*) AS n")
            body.append(f"FROM {_plural(self.noun())}")
            while len(body) < lines:
                body.append(f"  AND {self.noun()}_id = {r.randint(1, 9999)}")
            body.insert(2, f"WHERE {self.noun()} IS NOT NULL")
            body.append(f"GROUP BY {self.noun()} ORDER BY n DESC;")
        return f"```{lang}\n" + "\n".join(body) + "\n```"

    def table(self, rows: int) -> str:
        cols = [self.noun().capitalize() for _ in range(3)]
        out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for _ in range(max(1, rows)):
            out.append(f"| {self.adj()} | {self.rng.randint(0, 999)} | {self.verb()} |")
        return "\n".join(out)

    def document(self, words: int) -> str:
        """Markdown-ish text of roughly ``words`` words made of mixed blocks."""
        r = self.rng
        blocks: list[str] = []
        used = 0
        while used < words:
            remaining = words - used
            kind = r.random()
            if remaining < 25 or kind < 0.55:
                block = self.paragraph(min(6, max(1, remaining // 12)))
            elif kind < 0.75:
                block = self.bullet_list(r.randint(2, 6), numbered=r.random() < 0.5)
            elif kind < 0.92:
                block = self.code_block(r.randint(3, 14))
            else:
                block = self.table(r.randint(2, 6))
            if r.random() < 0.15:
                block = f"{'#' * r.randint(2, 3)} {self.verb().capitalize()} the {self.noun()}\n\n" + block
            blocks.append(block)
            used += len(block.split())
        return "\n\n".join(blocks)

    # -- message kinds -----------------------------------------------------------------
    def system_prompt(self) -> str:
        r = self.rng
        return r.choice(
            (
                "You are a helpful assistant.",
                f"You are {_a(self.adj())} assistant that helps engineers with {r.choice(_LANGUAGES)}. "
                f"Keep answers {self.adj()} and {self.adj()}.",
                f"You are {r.choice(_NAMES)}, a support agent for {_a(self.noun())} {self.noun()} service. "
                f"{self.sentence()}",
                f"Answer as {_a(self.adj())} tutor. {self.paragraph(r.randint(1, 3))}",
            )
        )

    def user_message(self) -> str:
        r = self.rng
        lang = r.choice(_LANGUAGES)
        question = r.choice(
            (
                f"How do I {self.verb()} {_a(self.adj())} {self.noun()} in {lang}?",
                f"Can you explain why my {self.noun()} keeps failing to {self.verb()} the {self.noun()}?",
                f"What is the difference between {_a(self.noun())} and {_a(self.noun())}?",
                f"Write a short {lang} function that can {self.verb()} {self.nouns()}.",
                f"Give me a list of ways to {self.verb()} the {self.noun()}.",
                f"Is it safe to {self.verb()} the {self.noun()} while the {self.noun()} is running?",
                f"Summarize the following {self.noun()} for me.",
                f"Thanks! And what about the {self.adj()} {self.noun()}?",
            )
        )
        extra = self.lognormal_words(_USER_WORDS)
        parts = [question]
        if extra > 12:
            parts.append(self.paragraph(extra // 12))
        if r.random() < _PASTE_RATE:
            parts.append(self.document(self.lognormal_words(_PASTE_WORDS)))
        if r.random() < 0.3:
            parts.reverse()  # context first, question last
        return "\n\n".join(parts)

    def reasoning(self) -> str:
        r = self.rng
        opener = r.choice(
            (
                f"Okay, the user wants to {self.verb()} the {self.noun()}.",
                f"Let me think about how the {self.noun()} interacts with the {self.noun()}.",
                "Hmm, first I need to understand what is being asked.",
                f"So the question is really about the {self.adj()} {self.noun()}.",
            )
        )
        steps = [opener]
        words = self.lognormal_words(_REASONING_WORDS)
        while sum(len(s.split()) for s in steps) < words:
            lead = r.choice(("First,", "Then", "Wait,", "Actually,", "Also,", "So", "But"))
            sentence = self.sentence()
            if not sentence.startswith(_NAMES):
                sentence = sentence[0].lower() + sentence[1:]
            steps.append(f"{lead} {sentence}")
        steps.append(r.choice(("I think that covers it.", "Let me write the answer.", "That should work.")))
        # Reasoning is often split into short paragraphs.
        paras: list[str] = []
        while steps:
            take = r.randint(1, 4)
            paras.append(" ".join(steps[:take]))
            steps = steps[take:]
        return "\n\n".join(paras)

    def assistant_message(self, with_reasoning: bool) -> str:
        answer = self.document(self.lognormal_words(_ASSISTANT_WORDS))
        if self.rng.random() < 0.5:
            answer = self.rng.choice(("Sure!", "Good question.", "Here is how.", "Certainly.")) + "\n\n" + answer
        if with_reasoning:
            return f"{THINK_OPEN}\n{self.reasoning()}\n{THINK_CLOSE}\n\n{answer}"
        return answer

    def tool_call_message(self, with_reasoning: bool) -> str:
        text = f"Let me {self.verb()} the {self.noun()} with the `{self.ident()}` tool first."
        if with_reasoning:
            return f"{THINK_OPEN}\n{self.reasoning()}\n{THINK_CLOSE}\n\n{text}"
        return text

    def tool_output(self) -> str:
        r = self.rng
        payload = {
            "status": r.choice(("ok", "ok", "partial")),
            self.noun(): [r.randint(0, 1000) for _ in range(r.randint(1, 6))],
            "note": self.sentence(),
        }
        return json.dumps(payload, ensure_ascii=False)


def generate_conversations(n: int, seed: int, *, tool_rate: float = TOOL_RATE) -> list[Conversation]:
    """Generate ``n`` synthetic chats as OpenAI-style message lists.

    Each chat has 1..6 user/assistant exchanges (short chats dominate), a system
    prompt with probability ``SYSTEM_RATE``, ``<think>`` reasoning in every
    assistant turn with probability ``REASONING_RATE``, and (with probability
    ``tool_rate``) one assistant -> tool -> assistant hop.  Pass ``tool_rate=0`` for
    formats without a tool role (ShareGPT).
    """
    rng = random.Random(seed)
    gen = _TextGenerator(rng)
    exchange_weights = (40, 24, 15, 10, 6, 5)
    conversations: list[Conversation] = []
    for _ in range(n):
        messages: Conversation = []
        if rng.random() < SYSTEM_RATE:
            messages.append({"role": "system", "content": gen.system_prompt()})
        reasoning = rng.random() < REASONING_RATE
        exchanges = rng.choices(range(1, 7), weights=exchange_weights)[0]
        tool_turn = rng.randrange(exchanges) if rng.random() < tool_rate else -1
        for turn in range(exchanges):
            messages.append({"role": "user", "content": gen.user_message()})
            if turn == tool_turn:
                messages.append({"role": "assistant", "content": gen.tool_call_message(reasoning)})
                messages.append({"role": "tool", "content": gen.tool_output()})
            messages.append({"role": "assistant", "content": gen.assistant_message(reasoning)})
        conversations.append(messages)
    return conversations


def to_sharegpt(conversation_id: str, messages: Sequence[Message]) -> dict[str, Any]:
    """Convert one OpenAI-style chat into a ShareGPT record (no tool role there)."""
    return {
        "id": conversation_id,
        "conversations": [{"from": SHAREGPT_ROLE[m["role"]], "value": m["content"]} for m in messages],
    }


# Malformed records mixed in on purpose so the demo exercises reject handling.
SHAREGPT_FLAWED: tuple[dict[str, Any], ...] = (
    {"id": "flawed-empty", "conversations": []},
    {"id": "flawed-no-reply", "conversations": [{"from": "human", "value": "Is anyone there?"}]},
    {
        "id": "flawed-unknown-role",
        "conversations": [
            {"from": "human", "value": "Tell me a story."},
            {"from": "narrator", "value": "Once upon a time, a cache missed."},
            {"from": "gpt", "value": "The end."},
        ],
    },
)
OPENAI_FLAWED_LINES: tuple[str, ...] = (
    '{"id": "flawed-invalid-json", "messages": [',
    json.dumps(
        {
            "id": "flawed-non-string-content",
            "messages": [
                {"role": "user", "content": {"text": "x"}},
                {"role": "assistant", "content": "ok"},
            ],
        }
    ),
)


def _with_flawed(valid: Sequence[T], flawed: Sequence[T], seed: int) -> list[T]:
    """Spread the flawed items through the valid ones so rejects are not all at the end."""
    positions = set(random.Random(seed).sample(range(len(valid) + len(flawed)), len(flawed)))
    valid_iter, flawed_iter = iter(valid), iter(flawed)
    return [next(flawed_iter) if i in positions else next(valid_iter) for i in range(len(valid) + len(flawed))]


def write_sharegpt(path: Path, conversations: Sequence[Conversation], *, seed: int) -> int:
    """Write a ShareGPT JSON array (valid records + ``SHAREGPT_FLAWED``); return the record count."""
    valid = [to_sharegpt(f"sharegpt-{i:05d}", c) for i, c in enumerate(conversations)]
    records = _with_flawed(valid, SHAREGPT_FLAWED, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8", newline="\n") as f:
        json.dump(records, f, ensure_ascii=False, indent=1)
        f.write("\n")
    return len(records)


def write_openai_jsonl(path: Path, conversations: Sequence[Conversation], *, seed: int) -> int:
    """Write OpenAI-style JSON Lines (valid records + ``OPENAI_FLAWED_LINES``); return the line count."""
    valid = [
        json.dumps({"id": f"openai-{i:05d}", "messages": c}, ensure_ascii=False) for i, c in enumerate(conversations)
    ]
    lines = _with_flawed(valid, OPENAI_FLAWED_LINES, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8", newline="\n") as f:
        f.write("\n".join(lines) + "\n")
    return len(lines)


def training_texts(conversations: Sequence[Conversation]) -> list[str]:
    """The corpus the demo tokenizer is trained on, in a fixed order.

    Each text is one message as it appears between ChatML control tokens once
    templated (role name, newline, content; tool output wrapped in
    ``<tool_response>``), so role headers get single tokens as in real chat tokenizers.
    """
    texts = []
    for conversation in conversations:
        for m in conversation:
            if m["role"] == "tool":
                texts.append(f"<tool_response>\n{m['content']}\n</tool_response>")
            else:
                texts.append(f"{m['role']}\n{m['content']}")
    return texts


def length_stats(lengths: Sequence[int]) -> dict[str, float]:
    """Summary statistics for a list of per-conversation token counts."""
    ordered = sorted(lengths)
    n = len(ordered)
    return {
        "count": n,
        "mean": round(sum(ordered) / n, 1),
        "median": ordered[n // 2],
        "p99": ordered[min(n - 1, math.ceil(0.99 * n) - 1)],
        "max": ordered[-1],
        "over_2000": sum(1 for x in ordered if x > 2000),
    }


# --- agentic conversations: tools, tool calls, tool responses, reasoning in both forms ------------------

# Tool schemas in the OpenAI form (what `tools=` of apply_chat_template takes).
DEMO_TOOLS: tuple[dict[str, Any], ...] = tuple(
    {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {key: {"type": kind, "description": text} for key, kind, text in params},
                "required": [params[0][0]],
            },
        },
    }
    for name, description, params in (
        (
            "search_files",
            "Search the repository for files matching a query.",
            [("query", "string", "What to find"), ("limit", "integer", "Most results")],
        ),
        ("read_file", "Read a file of the repository.", [("path", "string", "Path of the file")]),
        (
            "run_sql",
            "Run a read-only SQL query on the warehouse.",
            [("query", "string", "The SQL"), ("timeout_s", "number", "Seconds")],
        ),
        (
            "get_weather",
            "Current weather for a city.",
            [("city", "string", "City name"), ("unit", "string", "celsius or fahrenheit")],
        ),
    )
)
AGENTIC_RATE_LIST_CONTENT = 0.1  # user turns given as a list of text parts


def _tool_arguments(gen: _TextGenerator, tool: dict[str, Any]) -> dict[str, Any]:
    r = gen.rng
    out: dict[str, Any] = {}
    for key, spec in tool["function"]["parameters"]["properties"].items():
        if key != tool["function"]["parameters"]["required"][0] and r.random() < 0.4:
            continue
        if spec["type"] == "integer":
            out[key] = r.randint(1, 50)
        elif spec["type"] == "number":
            out[key] = round(r.uniform(0.5, 30.0), 1)
        elif key == "path":
            out[key] = f"src/{gen.noun()}/{gen.ident()}.py"
        elif key == "city":
            out[key] = r.choice(("Zürich", "Kraków", "Lisbon", "東京", "Austin"))
        elif key == "unit":
            out[key] = r.choice(("celsius", "fahrenheit"))
        elif key == "query" and tool["function"]["name"] == "run_sql":
            out[key] = f"SELECT {gen.noun()}, COUNT(*) FROM {_plural(gen.noun())} GROUP BY 1"
        else:
            out[key] = f"{gen.adj()} {gen.noun()}"
    return out


def generate_agentic_conversations(n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` agentic records in the OpenAI form: ``{"id", "messages", "tools"}``.

    Every record has tool schemas and at least one assistant turn that calls tools; across the set:
    tool calls with arguments as an object and as a JSON string, ``content: null`` on calling turns,
    several calls in one turn (so several tool responses in a row, with ``tool_call_id`` and ``name``),
    reasoning as ``reasoning_content`` (sometimes under the key ``reasoning``) or inline ``<think>``,
    multi-turn chats whose earlier turns carry reasoning, and user turns given as lists of text parts.
    """
    rng = random.Random(seed)
    gen = _TextGenerator(rng)
    records = []
    for number in range(n):
        tools = rng.sample(DEMO_TOOLS, rng.randint(1, len(DEMO_TOOLS)))
        reasoning_form = rng.choice(("field", "field", "inline", "none"))
        reasoning_key = "reasoning" if rng.random() < 0.15 else "reasoning_content"
        messages: list[dict[str, Any]] = []
        if rng.random() < SYSTEM_RATE:
            messages.append({"role": "system", "content": gen.system_prompt()})

        def assistant(
            text: str | None,
            tool_calls: list[dict[str, Any]] | None = None,
            reasoning_form: str = reasoning_form,
            reasoning_key: str = reasoning_key,
        ) -> dict[str, Any]:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if reasoning_form == "field":
                message[reasoning_key] = gen.reasoning()
            elif reasoning_form == "inline":
                message["content"] = f"<think>\n{gen.reasoning()}\n</think>\n\n{text or ''}"
            if tool_calls:
                message["tool_calls"] = tool_calls
            return message

        exchanges = rng.choices((1, 2, 3), weights=(50, 35, 15))[0]
        for _ in range(exchanges):
            question = gen.user_message()
            if rng.random() < AGENTIC_RATE_LIST_CONTENT:
                head, _, tail = question.partition(" ")
                messages.append(
                    {"role": "user", "content": [{"type": "text", "text": head + " "}, {"type": "text", "text": tail}]}
                )
            else:
                messages.append({"role": "user", "content": question})
            for _ in range(rng.choices((0, 1, 2), weights=(15, 60, 25))[0] if messages[-1]["role"] == "user" else 0):
                calls: list[dict[str, Any]] = []
                for _ in range(rng.choices((1, 2, 3), weights=(55, 30, 15))[0]):
                    tool = rng.choice(tools)
                    arguments: Any = _tool_arguments(gen, tool)
                    if rng.random() < 0.5:
                        # As OpenAI sends them: a JSON string, written by the template exactly as given.
                        arguments = json.dumps(arguments, ensure_ascii=rng.random() < 0.5)
                    call_id = f"call_{rng.getrandbits(40):010x}"
                    calls.append(
                        {
                            "id": call_id,
                            "type": "function",
                            "function": {"name": tool["function"]["name"], "arguments": arguments},
                        }
                    )
                preamble = None if rng.random() < 0.5 else gen.tool_call_message(False)
                messages.append(assistant(preamble, calls))
                for call in calls:
                    messages.append(
                        {
                            "role": "tool",
                            "tool_call_id": call["id"],
                            "name": call["function"]["name"],
                            "content": gen.tool_output(),
                        }
                    )
            messages.append(assistant(gen.assistant_message(False)))
        if not any(m.get("tool_calls") for m in messages):  # every record calls a tool at least once
            tool = rng.choice(tools)
            call = {
                "id": "call_last",
                "type": "function",
                "function": {"name": tool["function"]["name"], "arguments": _tool_arguments(gen, tool)},
            }
            messages[-1:] = [
                assistant(None, [call]),
                {"role": "tool", "tool_call_id": "call_last", "content": gen.tool_output()},
                messages[-1],
            ]
        records.append({"id": f"agentic-{number:05d}", "tools": tools, "messages": messages})
    return records


def to_sharegpt_tool_use(record: dict[str, Any], tools_as_string: bool) -> dict[str, Any]:
    """An agentic record in ShareGPT's tool-use variant (LLaMA-Factory's form): ``function_call`` turns
    (one per call, value ``{"name", "arguments"}`` as JSON), ``observation`` turns, ``tools`` as a JSON
    string or a list, the system prompt in ``system``; reasoning inline, as ShareGPT has no field for it."""
    turns: list[dict[str, str]] = []
    system = None
    for message in record["messages"]:
        role = message["role"]
        if role == "system":
            system = message["content"]
            continue
        if role == "user":
            content = message["content"]
            text = content if isinstance(content, str) else "".join(part["text"] for part in content)
            turns.append({"from": "human", "value": text})
        elif role == "tool":
            turns.append({"from": "observation", "value": message["content"]})
        elif message.get("tool_calls"):
            # LLaMA-Factory alternates strictly: one function_call turn holds every call of the turn.
            calls = [
                {"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in message["tool_calls"]
            ]
            turns.append({"from": "function_call", "value": json.dumps(calls if len(calls) > 1 else calls[0])})
        else:
            reasoning = message.get("reasoning_content") or message.get("reasoning")
            text = message["content"] or ""
            turns.append({"from": "gpt", "value": f"<think>\n{reasoning}\n</think>\n\n{text}" if reasoning else text})
    out: dict[str, Any] = {"id": record["id"], "conversations": turns}
    out["tools"] = json.dumps(record["tools"]) if tools_as_string else record["tools"]
    if system is not None:
        out["system"] = system
    return out


def write_agentic(
    openai_path: Path, sharegpt_path: Path, records: Sequence[dict[str, Any]], *, seed: int
) -> tuple[int, int]:
    """The agentic records as OpenAI JSON Lines, and (every other one) in ShareGPT's tool-use variant as a
    JSON array; return the two record counts."""
    openai_path.parent.mkdir(parents=True, exist_ok=True)
    with openai_path.open("w", encoding="utf-8", newline="\n") as f:
        f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    rng = random.Random(seed)
    sharegpt = [to_sharegpt_tool_use(r, tools_as_string=rng.random() < 0.5) for r in records[::2]]
    with sharegpt_path.open("w", encoding="utf-8", newline="\n") as f:
        json.dump(sharegpt, f, ensure_ascii=False, indent=1)
        f.write("\n")
    return len(records), len(sharegpt)
