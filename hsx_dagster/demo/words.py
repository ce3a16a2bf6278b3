"""The demo's vocabulary and the few English inflections its templates need.

The word lists are data files beside this module (``words/<name>.txt``, one entry a line, UTF-8), shipped
as package data; their order matters, since the generator draws from them with one seeded
:class:`random.Random` and the demo must reproduce byte for byte.
"""

from __future__ import annotations

from importlib.resources import files


def word_list(name: str) -> tuple[str, ...]:
    """The entries of ``words/<name>.txt`` in file order."""
    text = files("hsx_dagster.demo").joinpath(f"words/{name}.txt").read_text(encoding="utf-8")
    return tuple(line for line in text.split("\n") if line)


NOUNS = word_list("nouns")
VERBS = word_list("verbs")
ADJECTIVES = word_list("adjectives")
ADVERBS = word_list("adverbs")
PREPOSITIONS = word_list("prepositions")
CONNECTIVES = word_list("connectives")
LANGUAGES = word_list("languages")
UNICODE_WORDS = word_list("unicode")  # a sprinkle of non-ASCII so byte-level round-trips meet real data
DOUBLED_FINAL = word_list("doubled_final")  # verbs that double their last letter before -ing
NAMES = word_list("names")


def plural(noun: str) -> str:
    if noun.endswith(("s", "x", "sh", "ch")):
        return noun + "es"
    if noun.endswith("y") and noun[-2] not in "aeiou":
        return noun[:-1] + "ies"
    return noun + "s"


def a(word: str) -> str:
    """Prefix the indefinite article ("a cache", "an index")."""
    return ("an " if word[0] in "aeiouAEIOU" else "a ") + word


def third_person(verb: str) -> str:
    """ "fix" -> "fixes", "copy" -> "copies": same spelling rules as plurals."""
    return plural(verb)


def gerund(verb: str) -> str:
    if verb in DOUBLED_FINAL:
        return verb + verb[-1] + "ing"
    if verb.endswith("e") and not verb.endswith("ee"):
        return verb[:-1] + "ing"
    return verb + "ing"
