"""Where the tests find the repository and the shared material beside it."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# the real public ShareGPT sample beside the checkout (../shared/data/); tests that read it skip where it is absent
SHARED_SAMPLE = REPO.parent / "shared" / "data" / "sharegpt_dummy_conversation.json"
