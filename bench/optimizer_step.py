"""The fp32-master AdamW step (`cohort_grpo/optim/precision.py`) against torch's fused AdamW, on a Qwen2.5 shape.

`MasterWeightAdamW` walks the parameters in chunks: per chunk it converts the bf16 gradients to fp32,
rebuilds the fp32 masters from the bf16 weights and their 16 low bits, runs torch's fused AdamW, and
splits the masters again. The baseline is what that replaces: `torch.optim.AdamW(fused=True)` over
whole fp32 masters with whole fp32 gradients (4 + 4 bytes a parameter more), then the bf16 copy-back.
The step is timed twice: with fp32 moments, and with the bf16 moments that are the default on a GPU
(widened per chunk, narrowed by stochastic rounding). `--compare FILE` times another version of precision.py as well (say, the previous commit's:
`git show HEAD~1:cohort_grpo/optim/precision.py > /tmp/old_precision.py`), in the same process.

    python bench/optimizer_step.py --models 0.5b,1.5b --steps 10 --compare /tmp/old_precision.py

Prints, per model, milliseconds per step (CUDA events, after two warm-up steps) and the ratios.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.grpo_step_worker import SHAPES  # noqa: E402
from cohort_grpo.optim.precision import MasterWeightAdamW  # noqa: E402

KWARGS = dict(lr=1e-6, weight_decay=0.0, betas=(0.9, 0.999))


def parameter_shapes(shape: dict) -> list[tuple[int, ...]]:
    """The trainable tensors of a Qwen2.5 model of this shape, projections fused as cohort's models hold them."""
    h, inner, heads, kv = shape["hidden_size"], shape["intermediate_size"], shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim = shape.get("head_dim", h // heads)
    layer = [(h,), ((heads + 2 * kv) * head_dim, h), ((heads + 2 * kv) * head_dim,), (h, heads * head_dim), (h,),
             (2 * inner, h), (h, inner)]
    shapes = [(shape["vocab_size"], h)] + layer * shape["num_hidden_layers"] + [(h,)]
    if not shape["tie_word_embeddings"]:
        shapes.append((shape["vocab_size"], h))
    return shapes


def time_steps(step, set_grads, steps: int) -> float:
    """Milliseconds per `step()`, the gradients set before each (not timed), after two warm-up steps."""
    for _ in range(2):
        set_grads()
        step()
    total = 0.0
    for _ in range(steps):
        set_grads()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        total += start.elapsed_time(end)
    return total / steps


def measure(shapes, optimizer_class, steps: int, **options) -> float:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, device="cuda").to(torch.bfloat16) * 0.02) for s in shapes]
    grads = [torch.randn_like(p) * 1e-3 for p in params]
    optimizer = optimizer_class(params, **KWARGS, **options)

    def set_grads():
        for p, g in zip(params, grads):
            p.grad = g.clone()

    return time_steps(optimizer.step, set_grads, steps)


def measure_fused_fp32(shapes, steps: int) -> float:
    """The baseline: whole fp32 masters and gradients, torch's fused AdamW, then the bf16 copy-back."""
    torch.manual_seed(0)
    weights = [(torch.randn(s, device="cuda") * 0.02).to(torch.bfloat16) for s in shapes]
    masters = [torch.nn.Parameter(w.float()) for w in weights]
    grads = [torch.randn(s, device="cuda") * 1e-3 for s in shapes]
    optimizer = torch.optim.AdamW(masters, fused=True, **KWARGS)

    def set_grads():
        for m, g in zip(masters, grads):
            m.grad = g.clone()

    def step():
        optimizer.step()
        torch._foreach_copy_(weights, masters)

    return time_steps(step, set_grads, steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="0.5b,1.5b")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--compare", help="another precision.py to time too (its MasterWeightAdamW)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/optimizer_step.py needs a CUDA GPU")
    other = None
    if args.compare:
        spec = importlib.util.spec_from_file_location("compared_precision", args.compare)
        module = importlib.util.module_from_spec(spec)
        sys.modules["compared_precision"] = module
        spec.loader.exec_module(module)
        other = module.MasterWeightAdamW
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| model | parameters | fused AdamW, fp32 masters ms | MasterWeightAdamW, fp32 moments ms | ratio "
          "| bf16 moments ms | ratio |" + (" compared ms | this / compared |" if other else ""))
    print("| --- | --- | --- | --- | --- | --- | --- |" + (" --- | --- |" if other else ""))
    for name in args.models.split(","):
        shapes = parameter_shapes(SHAPES[name])
        count = sum(torch.Size(s).numel() for s in shapes)
        baseline = measure_fused_fp32(shapes, args.steps)
        torch.cuda.empty_cache()  # each run's tensors are gone with its function
        ours = measure(shapes, MasterWeightAdamW, args.steps)
        torch.cuda.empty_cache()
        narrow = measure(shapes, MasterWeightAdamW, args.steps, state_dtype=torch.bfloat16)
        torch.cuda.empty_cache()
        row = (f"| {name} | {count / 1e9:.2f} B | {baseline:.1f} | {ours:.1f} | {ours / baseline:.2f}× "
               f"| {narrow:.1f} | {narrow / baseline:.2f}× |")
        if other is not None:
            theirs = measure(shapes, other, args.steps)
            row += f" {theirs:.1f} | {ours / theirs:.2f}× |"
        print(row, flush=True)


if __name__ == "__main__":
    main()
