"""Regenerate the assistant turns of the input conversations with the target model (optional step).

`run.regenerate` drives one resumable run; `openai_backend` talks to OpenAI-compatible servers,
`local_backend` generates in-process; `turns` decides which turns and with what history; `store`
commits the results in parts; `regenerated_checks` proves every input is accounted for exactly once.
"""

from typing import TYPE_CHECKING

from hsx_dagster.core.public_api import lazy_exports

if TYPE_CHECKING:
    from hsx_dagster.core.regenerate.backends import build_backend as build_backend
    from hsx_dagster.core.regenerate.local_backend import LocalBackend as LocalBackend
    from hsx_dagster.core.regenerate.openai_backend import OpenAIBackend as OpenAIBackend
    from hsx_dagster.core.regenerate.regenerated_checks import check_regenerated as check_regenerated
    from hsx_dagster.core.regenerate.run import RegenerationError as RegenerationError, regenerate as regenerate
    from hsx_dagster.core.regenerate.store import (
        COMMITS_FILE as COMMITS_FILE,
        RegenStore as RegenStore,
        part_file as part_file,
        read_jsonl as read_jsonl,
        regenerated_input as regenerated_input,
    )
    from hsx_dagster.core.regenerate.turns import (
        ConversationJob as ConversationJob,
        FailureReason as FailureReason,
        Generated as Generated,
        SourceConversation as SourceConversation,
        conversation_id as conversation_id,
        iter_inputs as iter_inputs,
        split_reasoning as split_reasoning,
    )

EXPORTS = {
    "backends": ["build_backend"],
    "local_backend": ["LocalBackend"],
    "openai_backend": ["OpenAIBackend"],
    "regenerated_checks": ["check_regenerated"],
    "run": ["RegenerationError", "regenerate"],
    "store": ["COMMITS_FILE", "RegenStore", "part_file", "read_jsonl", "regenerated_input"],
    "turns": [
        "ConversationJob",
        "FailureReason",
        "Generated",
        "SourceConversation",
        "conversation_id",
        "iter_inputs",
        "split_reasoning",
    ],
}
if not TYPE_CHECKING:  # for mypy, the imports above are the package's names
    __all__, __getattr__, __dir__ = lazy_exports(__name__, EXPORTS)
