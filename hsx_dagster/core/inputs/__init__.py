"""Inputs: conversation files -> chat-template rendering with loss masks -> token ids, balanced into shards."""

from typing import TYPE_CHECKING

from hsx_dagster.core.public_api import lazy_exports

if TYPE_CHECKING:
    from hsx_dagster.core.inputs.chat_template import (
        THINK_CLOSE as THINK_CLOSE,
        THINK_OPEN as THINK_OPEN,
        SampleRejected as SampleRejected,
        TemplateError as TemplateError,
        TemplateMarkers as TemplateMarkers,
        render as render,
        strip_reasoning as strip_reasoning,
        tokenize_rendered as tokenize_rendered,
    )
    from hsx_dagster.core.inputs.conversations import iter_records as iter_records
    from hsx_dagster.core.inputs.readers import check_input_file as check_input_file
    from hsx_dagster.core.inputs.records import (
        Conversation as Conversation,
        InputFileError as InputFileError,
        Message as Message,
        Reject as Reject,
        RejectReason as RejectReason,
    )
    from hsx_dagster.core.inputs.sharding import (
        assign_shards as assign_shards,
        imbalance as imbalance,
        shard_loads as shard_loads,
    )
    from hsx_dagster.core.inputs.tokenization import tokenize_dataset as tokenize_dataset
    from hsx_dagster.core.inputs.tokenized import (
        LengthBucket as LengthBucket,
        ShardLoad as ShardLoad,
        TokenizedDataError as TokenizedDataError,
        TokenizedSummary as TokenizedSummary,
        read_tokenized_shard as read_tokenized_shard,
        shard_digests as shard_digests,
        tokenized_digest as tokenized_digest,
        tokenized_shard_keys as tokenized_shard_keys,
    )
    from hsx_dagster.core.inputs.tokenized_checks import check_tokenized as check_tokenized

EXPORTS = {
    "chat_template": [
        "SampleRejected",
        "THINK_CLOSE",
        "THINK_OPEN",
        "TemplateError",
        "TemplateMarkers",
        "render",
        "strip_reasoning",
        "tokenize_rendered",
    ],
    "conversations": ["iter_records"],
    "readers": ["check_input_file"],
    "records": ["Conversation", "InputFileError", "Message", "Reject", "RejectReason"],
    "sharding": ["assign_shards", "imbalance", "shard_loads"],
    "tokenization": ["tokenize_dataset"],
    "tokenized": [
        "LengthBucket",
        "ShardLoad",
        "TokenizedDataError",
        "TokenizedSummary",
        "read_tokenized_shard",
        "shard_digests",
        "tokenized_digest",
        "tokenized_shard_keys",
    ],
    "tokenized_checks": ["check_tokenized"],
}
if not TYPE_CHECKING:  # for mypy, the imports above are the package's names
    __all__, __getattr__, __dir__ = lazy_exports(__name__, EXPORTS)
