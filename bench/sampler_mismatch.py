"""How far the sampler's log-probs are from the trainer's, and which part of the arithmetic makes the gap.

GRPO samples completions with the engine (`make_sampler(...).generate`, which returns the log-prob
of each token it drew, after temperature) and then scores the same tokens with the trainer's forward
(`cohort_grpo.update.logprobs.rollout_logprobs`, log π_old). In exact arithmetic the two are equal; in
bfloat16 they are not (KV-cache decode kernels vs one full forward, different GEMM shapes, the
shared-prompt layout), and TRL corrects vLLM's version of this gap with truncated importance weights.
This script measures the gap on a real model:

- SmolLM2-135M-Instruct (the Q4_1 GGUF that ../shared/models/smollm2-135m-instruct/get.sh fetches),
  loaded by `load_policy(..., dtype="bfloat16")`, and again in float32 (the same dequantised weights);
- 32 GSM8K test questions (the task's chat prompt) × 8 completions of up to 256 tokens at
  temperature 1, sampled by the engine; then `rollout_logprobs` over the same tokens.

For each comparison "a vs b" it reports, over the completion tokens, Δ = log p_a − log p_b: |Δ| mean,
p50, p99 and max, the share of tokens with Δ ≠ 0, and the sequence-level ratio exp(Σ_t Δ) min / mean / max:

| comparison | what it isolates |
| --- | --- |
| trainer_bf16 vs sampler_bf16 | the mismatch itself (exp(ΣΔ) = the sequence-level IS ratio π_train/π_sample) |
| trainer_fp32 vs sampler_fp32 | the same in float32: what is left without bf16 (≈ 0) |
| trainer_bf16 vs trainer_fp32 | bf16 arithmetic in the trainer, float32 arithmetic on the same weights and tokens |
| sampler_bf16 vs trainer_fp32 | bf16 arithmetic in the sampler, the same reference |
| trainer_bf16_padded vs trainer_bf16 | the trainer's layout: one padded row per completion vs each prompt once |
| head_fp32 vs head_bf16 | on the same bf16 final hidden states: the LM head in float32 vs in bf16 |
| head_bf16 vs trainer_fp32 | bf16 body + bf16 head (a plain padded forward) |
| head_fp32 vs trainer_fp32 | bf16 body + float32 head: what the body alone contributes |
| exact_trainer_bf16 vs exact_sampler_bf16 | with `--numerics fast,exact`: the same mismatch under rollout_numerics=exact (0 by construction) |
| exact_trainer_bf16_padded vs exact_sampler_bf16 | ... the trainer in its other layout (a padded row per completion, smaller micro-batches) |

(the bf16 rows score the bf16 rollout's tokens, the fp32 row the fp32 rollout's). It also reports the
weights TRL's `vllm_importance_sampling_mode="token_truncate"` would give (w = min(exp(log π_train −
log π_sample), 3), `vllm_importance_sampling_clip_max` = 3): the fraction of tokens clipped, the mean
weight, the largest raw ratio. Writes `sampler_mismatch.json` into $OUT (else runs/sampler_mismatch/)
and prints a markdown table.

    python bench/sampler_mismatch.py --smoke      # CPU, seconds: a tiny random model, made-up prompts (CI)
    python bench/sampler_mismatch.py --model FILE.gguf|DIR --data test.jsonl     # on a GPU

    python bench/sampler_mismatch.py --numerics fast,exact ...   # rollout_numerics=exact beside the default

Options: --numerics (fast; fast,exact adds the exact rows), --questions (32), --generations (8),
--max_new_tokens (256), --temperature (1), --seed,
--max_rows (rows per trainer forward), --device (auto: cuda when there is one). Without --model it
looks for the GGUF in .models/smollm2-135m-instruct/ (get.sh's default folder) and
~/.cache/cohort/smollm2-135m-instruct/ (where the tests keep it); without --data it reads
../shared/data/gsm8k/test.jsonl.

On the GPU machine (no network): fetch the GGUF here (`bash ../shared/models/smollm2-135m-instruct/
get.sh DIR`; 98,362,432 bytes, sha256
b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53) and carry it with the GSM8K test file in an
ignored folder of the checkout. It is larger than one call carries (64 MiB): split it in two halves,
carry one half per call while the machine is warm (copy the first to /tmp there; ignored files also
stay between calls), `cat` them and check the sha256. The GGUF reader needs the `gguf` package,
which the GPU image lacks: carry its wheel (`pip download --no-deps gguf==0.19.0`, pure Python) and
install it as shared/notes/device.md installs wheels.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

if "--smoke" in sys.argv and "exact" in " ".join(sys.argv):  # the exact kernels on the CPU: Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cohort_grpo.models.exact_layers import use_exact_numerics  # noqa: E402
from cohort_grpo.run.policy import load_policy  # noqa: E402
from cohort_grpo.rollout import make_sampler  # noqa: E402
from cohort_grpo.rollout.layout import PADDED, Layout  # noqa: E402
from cohort_grpo.rollout.sampler import SamplingParams  # noqa: E402
from cohort_grpo.update.logprobs import rollout_logprobs  # noqa: E402

SHARED = Layout(shared=True)  # each prompt once per group, the trainer's default

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODELS = [Path(".models/smollm2-135m-instruct") / GGUF_NAME,  # get.sh's default folder
                  Path.home() / ".cache/cohort/smollm2-135m-instruct" / GGUF_NAME]  # where the tests keep it
DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared/data/gsm8k/test.jsonl"
IS_CLIP_MAX = 3.0  # TRL's vllm_importance_sampling_clip_max default
SMOKE_PROMPTS = ["12+7=? Reply <answer>N</answer>\n", "3*4=? Reply <answer>N</answer>\n",
                 "What is 9-5?\n", "Add 20 and 22.\n"]


def token_stats(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> dict:
    """Δ = a − b over the tokens where mask = 1: |Δ| mean / p50 / p99 / max, the signed mean, and the
    per-sequence ratio exp(Σ_t Δ) min / mean / max (sequences with at least one token)."""
    keep = mask.bool()
    delta = (a.double() - b.double()) * keep
    flat = delta[keep].abs()
    sums = delta.sum(dim=1)[keep.any(dim=1)]
    ratios = sums.exp()
    return {"tokens": int(keep.sum()), "sequences": int(sums.numel()),
            "fraction_nonzero": (flat > 0).double().mean().item(), "abs_mean": flat.mean().item(), "abs_p50": flat.quantile(0.5).item(),
            "abs_p99": flat.quantile(0.99).item(), "abs_max": flat.max().item(),
            "signed_mean": delta[keep].mean().item(),
            "seq_ratio_min": ratios.min().item(), "seq_ratio_mean": ratios.mean().item(),
            "seq_ratio_max": ratios.max().item(), "seq_log_ratio_abs_max": sums.abs().max().item()}


def token_truncate_weights(trainer: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor) -> dict:
    """TRL's token_truncate importance weights w = min(exp(log π_train − log π_sample), clip max)."""
    keep = mask.bool()
    raw = (trainer.double() - sampler.double())[keep].exp()
    weights = raw.clamp(max=IS_CLIP_MAX)
    return {"mode": "token_truncate", "clip_max": IS_CLIP_MAX, "tokens": int(keep.sum()),
            "fraction_clipped": (raw > IS_CLIP_MAX).double().mean().item(),
            "weight_mean": weights.mean().item(), "weight_min": weights.min().item(),
            "raw_ratio_max": raw.max().item(), "fraction_off_by_1pct": ((raw - 1).abs() > 0.01).double().mean().item()}


@torch.inference_mode()
def head_logprobs(model, prompts: list[list[int]], completion_ids: torch.Tensor, mask: torch.Tensor, pad_id: int,
                  fp32_head: bool, rows_per_forward: int, temperature: float = 1.0) -> torch.Tensor:
    """[B, T] log-probs of the completions from a plain padded forward's final hidden states
    (`return_hidden=True`) and the LM head `model.lm_head.weight`, applied in bf16 (the model's dtype,
    logits rounded to it, as the trainer's chunked head does) or in float32 (hidden states and weight
    upcast, float32 GEMM); the logits are divided by `temperature` in float32, as everywhere else."""
    device = next(model.parameters()).device
    weight = model.lm_head.weight.float() if fp32_head else model.lm_head.weight
    out = torch.zeros(completion_ids.shape, dtype=torch.float32)
    lengths = mask.sum(dim=1).tolist()
    for start in range(0, len(prompts), rows_per_forward):
        rows = range(start, min(start + rows_per_forward, len(prompts)))
        sequences = [prompts[r] + completion_ids[r, : int(lengths[r])].tolist() for r in rows]
        width = max(map(len, sequences))
        ids = torch.tensor([s + [pad_id] * (width - len(s)) for s in sequences], device=device)
        attention = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences], device=device)
        hidden = model(ids, attention_mask=attention, return_hidden=True)
        for i, r in enumerate(rows):
            n, p = int(lengths[r]), len(prompts[r])
            if n == 0:
                continue
            h = hidden[i, p - 1 : p - 1 + n]  # position t predicts token t + 1
            logits = h.float() @ weight.T if fp32_head else (h @ weight.T).float()
            tokens = completion_ids[r, :n].to(device)
            out[r, :n] = torch.log_softmax(logits / temperature, dim=-1).gather(-1, tokens[:, None]).squeeze(-1).cpu()
    return out


def sample_and_score(model, tokenizer, prompts: list[list[int]], args) -> dict:
    """The engine's rollout of `args.generations` completions per prompt and the trainer's log-probs
    of its tokens (each prompt once, as the trainer computes them by default)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    sampler = make_sampler(model, tokenizer)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            eos_token_ids=[tokenizer.eos_token_id], pad_token_id=pad, seed=args.seed)
    started = time.perf_counter()
    rollout = sampler.generate(prompts, args.generations, params)
    if rollout.logprobs is None:
        raise SystemExit(f"{type(model).__name__} is sampled without log-probs; this script needs cohort's own model")
    sample_seconds = time.perf_counter() - started
    rows = [p for p in prompts for _ in range(args.generations)]
    trainer = rollout_logprobs(model, rows, rollout.completion_ids, rollout.completion_mask, pad_id=pad,
                               max_rows=args.max_rows, temperature=args.temperature, layout=SHARED)
    release = getattr(sampler, "release", None)
    if release is not None:
        release()
    return {"rollout": rollout, "rows": rows, "pad": pad, "sampler": rollout.logprobs.float().cpu(),
            "trainer": trainer, "mask": rollout.completion_mask.cpu(), "sample_seconds": sample_seconds,
            "sampler_class": type(sampler).__name__}


def load_prompts(args, tokenizer) -> list[list[int]]:
    from cohort_grpo.tasks import get_task, prompt_text

    if args.smoke:
        texts = SMOKE_PROMPTS[: args.questions]
    else:
        rows = get_task("gsm8k").load("test", data_files=str(args.data))[: args.questions]
        texts = [prompt_text(tokenizer, row["prompt"]) for row in rows]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def smoke_model_dir(path: str) -> str:
    """A freshly initialised tiny Llama (cohort_grpo.models.tiny) saved as a Hugging Face folder in `path`."""
    from cohort_grpo.models.tiny import build_model, build_tokenizer

    tokenizer = build_tokenizer()
    build_model(tokenizer, seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def resolve_model(args, scratch: str) -> str:
    if args.smoke:
        return smoke_model_dir(scratch)
    if args.model:
        return args.model
    for candidate in DEFAULT_MODELS:
        if candidate.is_file():
            return str(candidate)
    raise SystemExit(f"no model: pass --model FILE.gguf|DIR (looked for {', '.join(map(str, DEFAULT_MODELS))}; "
                     "bash ../shared/models/smollm2-135m-instruct/get.sh fetches the GGUF)")


def markdown(results: dict) -> str:
    c = results["config"]
    lines = [f"Sampler vs trainer log-probs: {c['model_name']}, {c['device_name']}, {c['questions']} prompts × "
             f"{c['generations']} completions ≤ {c['max_new_tokens']} tokens at T={c['temperature']:g}; "
             "Δ = log p(first) − log p(second) per completion token", "",
             "| comparison | tokens | Δ ≠ 0 | mean abs Δ | p50 | p99 | max | exp(ΣΔ) min | mean | max |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, s in results["comparisons"].items():
        lines.append(f"| {name.replace('_vs_', ' vs ')} | {s['tokens']} | {100 * s['fraction_nonzero']:.2f}% | "
                     f"{s['abs_mean']:.2e} | {s['abs_p50']:.2e} | "
                     f"{s['abs_p99']:.2e} | {s['abs_max']:.2e} | {s['seq_ratio_min']:.4f} | "
                     f"{s['seq_ratio_mean']:.4f} | {s['seq_ratio_max']:.4f} |")
    lines += ["", "TRL token_truncate importance weights, "
              f"w = min(exp(log π_train − log π_sample), {IS_CLIP_MAX:g}):", "",
              "| precision | tokens | clipped (ratio > 3) | mean w | min w | max raw ratio | ratio off 1 by > 1% |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, w in results["importance_sampling"].items():
        lines.append(f"| {name} | {w['tokens']} | {100 * w['fraction_clipped']:.3f}% | {w['weight_mean']:.4f} | "
                     f"{w['weight_min']:.4f} | {w['raw_ratio_max']:.4f} | {100 * w['fraction_off_by_1pct']:.2f}% |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None,
                        help=".gguf file or Hugging Face folder (default: SmolLM2-135M-Instruct's GGUF)")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="GSM8K test .jsonl")
    parser.add_argument("--questions", type=int, default=None, help="prompts (default 32; smoke 4)")
    parser.add_argument("--generations", type=int, default=None, help="completions per prompt (default 8; smoke 4)")
    parser.add_argument("--max_new_tokens", type=int, default=None, help="(default 256; smoke 24)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max_rows", type=int, default=64, help="rows per trainer forward")
    parser.add_argument("--device", default="auto", help="auto (cuda when there is one), cuda or cpu")
    parser.add_argument("--smoke", action="store_true", help="a tiny random model on the CPU in seconds (CI)")
    parser.add_argument("--numerics", default="fast", choices=("fast", "fast,exact"),
                        help="fast,exact: also sample and score under rollout_numerics=exact (its rows: exact_*)")
    args = parser.parse_args(argv)
    smoke_defaults, full_defaults = dict(questions=4, generations=4, max_new_tokens=24), \
        dict(questions=32, generations=8, max_new_tokens=256)
    for key, value in (smoke_defaults if args.smoke else full_defaults).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.device == "auto":
        args.device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    if args.smoke:
        torch.set_num_threads(min(2, torch.get_num_threads()))
    if not args.smoke and not args.data.is_file():
        raise SystemExit(f"no GSM8K data at {args.data}: pass --data test.jsonl")
    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 (PyTorch's default, made sure of)
    with tempfile.TemporaryDirectory(prefix="sampler-mismatch-") as scratch:
        results = measure(args, resolve_model(args, scratch))
    root = Path(os.environ.get("OUT") or "runs/sampler_mismatch")
    root.mkdir(parents=True, exist_ok=True)
    out = root / "sampler_mismatch.json"
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(markdown(results))
    print(f"\n{out}  ({results['config']['seconds']:.1f}s)")
    return results


def measure(args, spec: str) -> dict:
    """Load, sample, score and compare (see the module docstring); the results as a dict."""
    started = time.perf_counter()
    quiet = lambda *_: None  # noqa: E731

    model16, tokenizer = load_policy(spec, device=args.device, dtype="bfloat16", log=quiet)
    model16.eval()
    prompts = load_prompts(args, tokenizer)
    bf16 = sample_and_score(model16, tokenizer, prompts, args)
    model32, _ = load_policy(spec, tokenizer, device=args.device, dtype="float32", log=quiet)
    model32.eval()
    fp32 = sample_and_score(model32, tokenizer, prompts, args)
    pad, rows, tokens, mask = bf16["pad"], bf16["rows"], bf16["rollout"].completion_ids.cpu(), bf16["mask"]
    trainer_fp32_on_bf16 = rollout_logprobs(model32, rows, tokens, mask, pad_id=pad, max_rows=args.max_rows,
                                            temperature=args.temperature, layout=SHARED)
    trainer_bf16_padded = rollout_logprobs(model16, rows, tokens, mask, pad_id=pad, max_rows=args.max_rows,
                                           temperature=args.temperature, layout=PADDED)
    forward_rows = 4 if args.device == "cuda" else 8
    head_bf16, head_fp32 = (head_logprobs(model16, rows, tokens, mask, pad, fp32_head=fp32_head,
                                          rows_per_forward=forward_rows, temperature=args.temperature)
                            for fp32_head in (False, True))

    comparisons = {
        "trainer_bf16_vs_sampler_bf16": token_stats(bf16["trainer"], bf16["sampler"], mask),
        "trainer_fp32_vs_sampler_fp32": token_stats(fp32["trainer"], fp32["sampler"], fp32["mask"]),
        "trainer_bf16_vs_trainer_fp32": token_stats(bf16["trainer"], trainer_fp32_on_bf16, mask),
        "sampler_bf16_vs_trainer_fp32": token_stats(bf16["sampler"], trainer_fp32_on_bf16, mask),
        "trainer_bf16_padded_vs_trainer_bf16": token_stats(trainer_bf16_padded, bf16["trainer"], mask),
        "head_fp32_vs_head_bf16": token_stats(head_fp32, head_bf16, mask),
        "head_bf16_vs_trainer_fp32": token_stats(head_bf16, trainer_fp32_on_bf16, mask),
        "head_fp32_vs_trainer_fp32": token_stats(head_fp32, trainer_fp32_on_bf16, mask),
    }
    importance = {"bf16": token_truncate_weights(bf16["trainer"], bf16["sampler"], mask),
                  "fp32": token_truncate_weights(fp32["trainer"], fp32["sampler"], fp32["mask"])}
    exact_config = {}
    if "exact" in args.numerics.split(","):
        del model32
        exact_config = measure_exact(args, spec, tokenizer, prompts, comparisons, importance)
    lengths = mask.sum(dim=1).float()
    results = {
        "config": {
            "model": spec if not args.smoke else "tiny random Llama (cohort_grpo.models.tiny), smoke",
            "model_name": Path(spec).name if not args.smoke else "tiny random Llama (smoke)",
            "smoke": args.smoke, "device": args.device,
            "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "CPU",
            "torch": torch.__version__, "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "cuda_matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
            "bf16_reduced_precision_reduction": torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
            "data": None if args.smoke else str(args.data),
            "questions": len(prompts), "generations": args.generations, "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature, "seed": args.seed, "max_rows": args.max_rows,
            "trainer_layout": "each prompt once per group (the shared-prompt layout, the trainer's default)",
            "sampler": bf16["sampler_class"],
            "completion_tokens_bf16": int(mask.sum()), "completion_tokens_fp32": int(fp32["mask"].sum()),
            "mean_completion_length_bf16": lengths.mean().item(),
            "finished_by_eos_bf16": sum(r == "stop" for r in bf16["rollout"].finish_reasons),
            "sample_seconds_bf16": round(bf16["sample_seconds"], 3),
            "sample_seconds_fp32": round(fp32["sample_seconds"], 3),
            **exact_config,
            "seconds": round(time.perf_counter() - started, 2),
        },
        "comparisons": comparisons,
        "importance_sampling": importance,
    }
    return results


def measure_exact(args, spec: str, tokenizer, prompts, comparisons: dict, importance: dict) -> dict:
    """The bf16 model under rollout_numerics=exact: its own rollout, scored by the trainer in the default
    layout (each prompt once) and in the other (a padded row per completion, a quarter of the rows per
    forward); adds the exact_* rows to `comparisons` and `importance`, returns its config fields."""
    model, _ = load_policy(spec, tokenizer, device=args.device, dtype="bfloat16", log=lambda *_: None)
    model.eval()
    use_exact_numerics(model, torch.device(args.device))
    run = sample_and_score(model, tokenizer, prompts, args)
    tokens, mask = run["rollout"].completion_ids.cpu(), run["mask"]
    padded = rollout_logprobs(model, run["rows"], tokens, mask, pad_id=run["pad"], max_rows=max(1, args.max_rows // 4),
                              temperature=args.temperature, layout=PADDED)
    comparisons["exact_trainer_bf16_vs_exact_sampler_bf16"] = token_stats(run["trainer"], run["sampler"], mask)
    comparisons["exact_trainer_bf16_padded_vs_exact_sampler_bf16"] = token_stats(padded, run["sampler"], mask)
    importance["bf16_exact"] = token_truncate_weights(run["trainer"], run["sampler"], mask)
    return {"numerics": args.numerics, "completion_tokens_bf16_exact": int(mask.sum()),
            "sample_seconds_bf16_exact": round(run["sample_seconds"], 3)}


if __name__ == "__main__":
    main()
