"""Weight files written with the permissions of every other file of the folder.

safetensors' `save_file` (0.8) creates its file with mode 0600 whatever the umask, while config.json and
the tokenizer files beside it get the usual 0644 (0666 less a umask of 022); transformers' `save_pretrained`
writes its weights through it too. A saved model
is meant to be read by others (a shared cluster folder, a server process under another user):
`save_safetensors` gives its files the mode `open()` would have, 0666 less the process's umask.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch


def process_umask() -> int:
    """The process's umask, read without changing it where Linux reports it (/proc), else set and put back."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    umask = os.umask(0o077)  # the strictest value for the instant it is in force
    os.umask(umask)
    return umask


def give_usual_mode(*paths: Path | str) -> None:
    """Set each file to the mode a file the process creates gets: 0666 less the umask."""
    mode = 0o666 & ~process_umask()
    for path in paths:
        os.chmod(path, mode)


PT_METADATA = {"format": "pt"}  # what transformers expects of a model's weight file


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path | str, metadata: dict | None = PT_METADATA) -> None:
    """safetensors' `save_file`, then the usual mode."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    give_usual_mode(path)
