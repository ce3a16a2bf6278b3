"""English-like prose, lists, code and tables from the demo's word lists and templates.

All randomness comes from the one ``rng`` the generator is given, so the same seed gives the same text.
"""

from __future__ import annotations

import json
import random

from hsx_dagster.core.inputs import THINK_CLOSE, THINK_OPEN
from hsx_dagster.demo.words import (
    ADJECTIVES,
    ADVERBS,
    CONNECTIVES,
    LANGUAGES,
    NAMES,
    NOUNS,
    PREPOSITIONS,
    UNICODE_WORDS,
    VERBS,
    a,
    gerund,
    plural,
    third_person,
)

# Lognormal word-count parameters per message kind: (mu, sigma, cap).  Tuned so
# the templated conversations average a few hundred demo-tokenizer tokens with a thin tail
# past 2,000 tokens (the measured figures are in data/README.md).
USER_WORDS = (2.5, 1.0, 900)
ASSISTANT_WORDS = (3.05, 1.4, 3600)
REASONING_WORDS = (3.3, 0.7, 900)
# Chance that a user turn pastes a long document/code listing to ask about.
PASTE_RATE = 0.025
PASTE_WORDS = (5.0, 0.8, 2600)


class TextGenerator:
    """Template-based text generator; all randomness comes from the one ``rng``."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    # -- words -------------------------------------------------------------------------
    def noun(self) -> str:
        return self.rng.choice(NOUNS)

    def nouns(self) -> str:
        return plural(self.noun())

    def verb(self) -> str:
        return self.rng.choice(VERBS)

    def adj(self) -> str:
        if self.rng.random() < 0.01:
            return self.rng.choice(UNICODE_WORDS)
        return self.rng.choice(ADJECTIVES)

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
                f"The {self.adj()} {n1} {third_person(self.verb())} the {n2} {r.choice(PREPOSITIONS)} "
                f"the {self.adj()} {self.noun()}."
            )
        if kind == 1:
            return (
                f"{r.choice(CONNECTIVES)}, you can {self.verb()} each {n1} before the {n2} {third_person(self.verb())}."
            )
        if kind == 2:
            return f"If the {n1} is {self.adj()}, {self.verb()} it {r.choice(PREPOSITIONS)} {a(self.adj())} {n2}."
        if kind == 3:
            return (
                f"We {r.choice(ADVERBS)} {self.verb()} {r.randint(2, 64)} {plural(n1)} per {n2}, "
                f"which keeps the {self.noun()} {self.adj()}."
            )
        if kind == 4:
            return (
                f"This {third_person(self.verb())} because the {n1} {r.choice(ADVERBS)} "
                f"{third_person(self.verb())} the {plural(n2)}."
            )
        if kind == 5:
            return (
                f"{gerund(self.verb()).capitalize()} the {n1} is {self.adj()}, but "
                f"{gerund(self.verb())} the {n2} is {r.choice(ADVERBS)} {self.adj()}."
            )
        if kind == 6:
            return f"Make sure the `{self.ident()}` {n1} returns {a(self.adj())} {n2}."
        if kind == 7:
            return (
                f"{r.choice(NAMES)} said the {n1} took about {r.randint(1, 900)} ms "
                f"{r.choice(PREPOSITIONS)} the {self.adj()} {n2}."
            )
        if kind == 8:
            return f"Do you want the {self.adj()} {n1} or the {self.adj()} {n2}?"
        return (
            f"{a(self.adj()).capitalize()} {n1} and {a(self.adj())} {n2} should {self.verb()} the same {self.noun()}."
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
            body.append(f"def {fn}({plural(arg)}, limit={r.randint(1, 512)}):")
            body.append(f'    """{self.sentence()}"""')
            body.append("    result = []")
            while len(body) < lines:
                var = self.noun()
                body.append(f"    for {var} in {plural(arg)}[:limit]:")
                body.append(f"        if {var}.{r.choice(ADJECTIVES)}_{self.noun()} > {r.randint(0, 99)}:")
                body.append(f"            result.append({self.ident()}({var}))")
            body.append("    return result")
        elif lang == "bash":
            while len(body) < lines:
                body.append(
                    f"{r.choice(('git', 'docker', 'kubectl', 'python -m', 'make'))} {self.verb()} "
                    f"--{self.noun()}={r.choice(ADJECTIVES)} ./{self.noun()}/{self.noun()}.txt"
                )
        elif lang == "json":
            items = [
                f'  "{self.noun()}_{i}": {json.dumps(r.choice((r.randint(0, 9999), self.adj(), True, None)))}'
                for i in range(max(2, lines))
            ]
            body = ["{", ",\n".join(items), "}"]
        else:
            body.append(f"SELECT {self.noun()}, COUNT(*) AS n")
            body.append(f"FROM {plural(self.noun())}")
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
                f"You are {a(self.adj())} assistant that helps engineers with {r.choice(LANGUAGES)}. "
                f"Keep answers {self.adj()} and {self.adj()}.",
                f"You are {r.choice(NAMES)}, a support agent for {a(self.noun())} {self.noun()} service. "
                f"{self.sentence()}",
                f"Answer as {a(self.adj())} tutor. {self.paragraph(r.randint(1, 3))}",
            )
        )

    def user_message(self) -> str:
        r = self.rng
        lang = r.choice(LANGUAGES)
        question = r.choice(
            (
                f"How do I {self.verb()} {a(self.adj())} {self.noun()} in {lang}?",
                f"Can you explain why my {self.noun()} keeps failing to {self.verb()} the {self.noun()}?",
                f"What is the difference between {a(self.noun())} and {a(self.noun())}?",
                f"Write a short {lang} function that can {self.verb()} {self.nouns()}.",
                f"Give me a list of ways to {self.verb()} the {self.noun()}.",
                f"Is it safe to {self.verb()} the {self.noun()} while the {self.noun()} is running?",
                f"Summarize the following {self.noun()} for me.",
                f"Thanks! And what about the {self.adj()} {self.noun()}?",
            )
        )
        extra = self.lognormal_words(USER_WORDS)
        parts = [question]
        if extra > 12:
            parts.append(self.paragraph(extra // 12))
        if r.random() < PASTE_RATE:
            parts.append(self.document(self.lognormal_words(PASTE_WORDS)))
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
        words = self.lognormal_words(REASONING_WORDS)
        while sum(len(s.split()) for s in steps) < words:
            lead = r.choice(("First,", "Then", "Wait,", "Actually,", "Also,", "So", "But"))
            sentence = self.sentence()
            if not sentence.startswith(NAMES):
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
        answer = self.document(self.lognormal_words(ASSISTANT_WORDS))
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
