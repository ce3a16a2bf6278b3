"""The acceptance target's text: the Python standard library's own documentation and the public ShareGPT sample,
as chat conversations, split into training and held-out items by source item.

Nobody on the project wrote either text and every machine has both offline: the docstrings come with the
interpreter (``inspect`` over a fixed list of modules), the ShareGPT sample from ../shared/data beside the
checkout (skipped, and recorded as absent, where it is missing). A documented function becomes, by a hash of its
name, one of two conversations: a question about it answered from memory (its signature and docstring), or its
documentation pasted into the prompt with a request to summarise it, answered by its name and first paragraph
quoted from the prompt, as assistants answer over a pasted document or retrieved context. The second kind is
what separates a drafter that reads the target's states from one that reads tokens alone: quoting needs an
induction circuit (find the current token earlier in the prompt, emit the one after it), which a one-layer
drafter cannot build from token embeddings but can read off the target's states. A module becomes a question
about what it is for. Each item goes to the held-out side by a hash of its name (a function, a module, a ShareGPT
id), so no held-out function or topic is ever trained on, by the target or by a drafter.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import re
import subprocess
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import REPO

SHAREGPT_SAMPLE = REPO.parent / "shared" / "data" / "sharegpt_dummy_conversation.json"
# The workspace the project runs in also keeps it at this fixed place (checkouts there are two folders deep).
SHAREGPT_FALLBACK = Path("/work/shared/data/sharegpt_dummy_conversation.json")

# Modules that import without side effects on every platform CPython supports; the order fixes the corpus.
STDLIB_MODULES = [
    "abc",
    "argparse",
    "array",
    "ast",
    "asyncio",
    "base64",
    "bisect",
    "builtins",
    "bz2",
    "calendar",
    "cmath",
    "codecs",
    "collections",
    "collections.abc",
    "colorsys",
    "concurrent.futures",
    "configparser",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "dis",
    "email",
    "enum",
    "filecmp",
    "fnmatch",
    "fractions",
    "functools",
    "gc",
    "getopt",
    "gettext",
    "glob",
    "graphlib",
    "gzip",
    "hashlib",
    "heapq",
    "hmac",
    "html",
    "html.parser",
    "http.client",
    "http.server",
    "imaplib",
    "importlib",
    "inspect",
    "io",
    "ipaddress",
    "itertools",
    "json",
    "keyword",
    "linecache",
    "locale",
    "logging",
    "logging.handlers",
    "lzma",
    "mailbox",
    "math",
    "mimetypes",
    "multiprocessing",
    "numbers",
    "operator",
    "optparse",
    "os",
    "os.path",
    "pathlib",
    "pickle",
    "pkgutil",
    "platform",
    "plistlib",
    "poplib",
    "pprint",
    "queue",
    "quopri",
    "random",
    "re",
    "reprlib",
    "sched",
    "secrets",
    "select",
    "selectors",
    "shelve",
    "shlex",
    "shutil",
    "signal",
    "smtplib",
    "socket",
    "socketserver",
    "sqlite3",
    "ssl",
    "stat",
    "statistics",
    "string",
    "struct",
    "subprocess",
    "symtable",
    "sys",
    "sysconfig",
    "tabnanny",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "time",
    "timeit",
    "token",
    "tokenize",
    "tomllib",
    "trace",
    "traceback",
    "types",
    "typing",
    "unicodedata",
    "unittest",
    "urllib.parse",
    "urllib.request",
    "uuid",
    "warnings",
    "weakref",
    "wsgiref.util",
    "xml.dom.minidom",
    "xml.etree.ElementTree",
    "zipfile",
    "zipimport",
    "zlib",
    "zoneinfo",
]

ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
ANSWER_CHARS = 700  # a docstring's first paragraphs up to about this long: answers of a few dozen tokens
HELD_OUT_PER_MILLE = 60  # of the items (by name hash) never trained on
QUESTIONS = (
    "What does `{name}` do?",
    "Explain `{name}`.",
    "How do I use `{name}`?",
    "Tell me about `{name}` in Python.",
)
MODULE_QUESTIONS = ("What is the `{name}` module for?", "What does Python's `{name}` module provide?")
SUMMARY_REQUESTS = (
    "Summarise the documentation of `{name}`:\n\n{doc}",
    "Here is the docstring of `{name}`.\n\n{doc}\n\nWhat does it do?",
    "{doc}\n\nIn short, what does `{name}` do according to this?",
)
PASTED_PER_MILLE = 500  # of the documented names whose item pastes the documentation into the prompt
PASTED_CHARS = 400  # the pasted paragraphs: a prompt and its quoted answer fit one of the target's training windows


@dataclass(frozen=True)
class Item:
    """One source item: its key (what the split hashes) and its conversation (OpenAI messages)."""

    key: str
    messages: list[dict[str, str]]

    @property
    def held_out(self) -> bool:
        return _hash(self.key) % 1000 < HELD_OUT_PER_MILLE

    def record(self) -> dict[str, Any]:
        return {"id": self.key, "messages": self.messages}


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "big")


def _first_paragraphs(doc: str, limit: int = ANSWER_CHARS) -> list[str]:
    """Whole paragraphs from the start of ``doc`` while they fit ``limit`` characters (always the first, cut at
    twice the limit)."""
    kept: list[str] = []
    for paragraph in doc.strip().split("\n\n"):
        if kept and sum(len(p) + 2 for p in kept) + len(paragraph) > limit:
            break
        kept.append(paragraph.strip("\n").rstrip())
    return [kept[0][: 2 * limit], *kept[1:]]  # only a first paragraph alone can pass the limit


def _signature(name: str, member: Any) -> str:
    try:
        signature = str(inspect.signature(member))
    except (TypeError, ValueError):  # builtins without text signatures
        return f"`{name}`"
    # a sentinel default prints as `<object object at 0x7f...>`: its address changes from one process to the next
    return f"`{name}{ADDRESS.sub('', signature)}`"


def _documented(module: Any) -> Iterator[tuple[str, Any, str]]:
    """(qualified name, object, docstring) of the module's public functions, classes and their methods."""
    # dir() names the lazily imported members too (concurrent.futures' executors), which vars() lists only once
    # some other import has loaded them: the corpus must not depend on what else the process imported
    for attr in sorted(dir(module)):
        if attr.startswith("_"):
            continue
        member = getattr(module, attr)
        if not (inspect.isroutine(member) or inspect.isclass(member)):
            continue
        if getattr(member, "__module__", None) not in (module.__name__, None):
            continue  # re-exported from elsewhere: documented under its own module
        doc = inspect.getdoc(member)
        if doc and len(doc) >= 40:
            yield f"{module.__name__}.{attr}", member, doc
        if inspect.isclass(member):
            for method_name in sorted(vars(member)):
                method = vars(member)[method_name]
                if method_name.startswith("_") or not inspect.isroutine(method):
                    continue
                method_doc = inspect.getdoc(method)
                if method_doc and len(method_doc) >= 40:
                    yield f"{module.__name__}.{attr}.{method_name}", method, method_doc


def stdlib_items() -> list[Item]:
    """A question and its documented answer for every documented public name of ``STDLIB_MODULES``."""
    items: list[Item] = []
    seen_docs: set[str] = set()
    for module_name in STDLIB_MODULES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                module = importlib.import_module(module_name)
            except ImportError:  # a module this platform's build lacks (e.g. no _ssl): left out, as on that machine
                continue
        module_doc = inspect.getdoc(module)
        if module_doc:
            question = MODULE_QUESTIONS[_hash(module_name) % len(MODULE_QUESTIONS)].format(name=module_name)
            items.append(Item(f"module:{module_name}", _chat(question, "\n\n".join(_first_paragraphs(module_doc)))))
        for name, member, doc in _documented(module):
            if doc in seen_docs:  # aliases and inherited copies: one item per text
                continue
            seen_docs.add(doc)
            if _hash(f"pasted:{name}") % 1000 < PASTED_PER_MILLE:
                items.append(Item(f"python:{name}", _summary_chat(name, doc)))
                continue
            question = QUESTIONS[_hash(name) % len(QUESTIONS)].format(name=name)
            answer = "\n\n".join([_signature(name.rsplit(".", 1)[-1], member), *_first_paragraphs(doc)])
            items.append(Item(f"python:{name}", _chat(question, answer)))
    return items


def _summary_chat(name: str, doc: str) -> list[dict[str, str]]:
    """The documentation pasted into the prompt and its first paragraph quoted back, under the name."""
    paragraphs = _first_paragraphs(doc, PASTED_CHARS)
    request = SUMMARY_REQUESTS[_hash(f"request:{name}") % len(SUMMARY_REQUESTS)]
    return _chat(request.format(name=name, doc="\n\n".join(paragraphs)), f"`{name}`: {paragraphs[0]}")


def _chat(question: str, answer: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


def sharegpt_sample_path() -> Path | None:
    for path in (SHAREGPT_SAMPLE, SHAREGPT_FALLBACK):
        if path.is_file():
            return path
    return None


def sharegpt_items(path: Path) -> list[Item]:
    """The sample's conversations (human/gpt turns, in order) as items keyed by their ids."""
    roles = {"human": "user", "gpt": "assistant"}
    items = []
    for record in json.loads(path.read_text(encoding="utf-8")):
        turns = [{"role": roles[t["from"]], "content": t["value"]} for t in record["conversations"]]
        if turns and turns[0]["role"] == "user" and turns[-1]["role"] == "assistant":
            items.append(Item(f"sharegpt:{record['id']}", turns))
    return items


def build_items() -> tuple[list[Item], dict[str, Any]]:
    """Every item, in a fixed order, and where they came from (for the report), read in a child interpreter that
    imports nothing but the standard library: libraries patch it (transformers adds methods to logging.Logger, torch
    replaces inspect.getfile), and the corpus must not depend on what the calling process imported."""
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.acceptance.corpus"], cwd=REPO, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"python -m benchmarks.acceptance.corpus failed (exit {done.returncode}):\n{done.stderr[-2000:]}"
        )
    payload = json.loads(done.stdout)
    return [Item(key, messages) for key, messages in payload["items"]], payload["sources"]


def _items_of_this_process() -> tuple[list[Item], dict[str, Any]]:
    items = stdlib_items()
    stdlib_count = len(items)
    sample = sharegpt_sample_path()
    if sample is not None:
        items += sharegpt_items(sample)
    return items, {"stdlib_items": stdlib_count, "sharegpt_items": len(items) - stdlib_count, "sharegpt": str(sample)}


def write_jsonl(path: Path, items: list[Item]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as out:
        for item in items:
            out.write(json.dumps(item.record(), ensure_ascii=False) + "\n")


def held_out_prompts(items: list[Item]) -> list[dict[str, Any]]:
    """The held-out conversations as prompts: every turn up to the last user turn, the reference answer beside."""
    prompts = []
    for item in items:
        last_user = max(i for i, m in enumerate(item.messages) if m["role"] == "user")
        prompts.append(
            {
                "id": item.key,
                "messages": item.messages[: last_user + 1],
                "reference": item.messages[last_user + 1]["content"] if last_user + 1 < len(item.messages) else None,
            }
        )
    return prompts


if __name__ == "__main__":  # what build_items runs: the items as JSON on stdout
    corpus, sources = _items_of_this_process()
    json.dump({"items": [[item.key, item.messages] for item in corpus], "sources": sources}, sys.stdout)
