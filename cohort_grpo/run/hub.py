"""`push_to_hub`: a run's output folder uploaded to the Hugging Face Hub, as transformers' `Trainer.push_to_hub`.

The repository is `args.hub_model_id`, else output_dir's folder name (the Hub puts a bare name under the token's
user), created when missing (private per `args.hub_private_repo`); the token is `args.hub_token`, else the one
huggingface_hub finds (HF_TOKEN, `hf auth login`); the Hub is HF_ENDPOINT's where that is set. One commit uploads
the folder as it is: the policy, its tokenizer, metrics and summary, never the checkpoint-<step> folders nor
hidden or `_`-prefixed files (transformers leaves out the same).
"""

from __future__ import annotations

import os
from pathlib import Path

from cohort_grpo.errors import CohortError

IGNORED = ["_*", ".*", "checkpoint-*", "**/checkpoint-*"]


def hub_repo_name(args) -> str:
    """The repository `push_to_hub` creates: hub_model_id, else the output folder's name."""
    return args.hub_model_id or Path(args.output_dir).absolute().name


def push_to_hub(args, *, commit_message: str | None = "End of training", blocking: bool = True,
                token: str | None = None, revision: str | None = None, private: bool | None = None):
    """Create the repository (kept if it exists) and upload `args.output_dir` in one commit; huggingface_hub's
    `CommitInfo`, or with `blocking=False` a `Future` of it."""
    try:
        from huggingface_hub import HfApi
    except ImportError:
        raise CohortError("push_to_hub needs huggingface_hub: pip install huggingface_hub") from None
    api = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None, token=token or args.hub_token)
    private = args.hub_private_repo if private is None else private
    repo = api.create_repo(hub_repo_name(args), private=private, exist_ok=True)
    return api.upload_folder(repo_id=repo.repo_id, folder_path=str(args.output_dir), commit_message=commit_message,
                             revision=revision, run_as_future=not blocking, ignore_patterns=IGNORED)
