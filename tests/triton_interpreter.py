"""Import a Triton kernel module so that its kernels can run on this machine: compiled on CUDA,
else through Triton's interpreter on CPU tensors (TRITON_INTERPRET=1).

The interpreter is chosen when a kernel is decorated, at the module's import, and torch imports
triton early; another test module may also have imported the kernel module already. So the
variable is set first, and the module is reloaded if its kernel was decorated without it."""

import importlib
import os

import torch

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"


def kernel_module(name: str, kernel: str):
    """The module `name`, its @triton.jit function `kernel` runnable here (interpreted without CUDA)."""
    if not ON_CUDA:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    module = importlib.import_module(name)
    if (getattr(module, "triton", None) is not None and not ON_CUDA
            and type(getattr(module, kernel)).__name__ != "InterpretedFunction"):
        module = importlib.reload(module)
    return module
