"""Rollout throughput on one GPU: cohort's `Engine` against Hugging Face `generate`.

Random-initialised Qwen2.5-0.5B- and 1.5B-shaped models in bfloat16 (no weights are downloaded).
Both samplers run the same weights: the cohort model is built on the transformers model's own
tensors. Prompts are random 128-token sequences and EOS is ignored (random weights rarely emit
it), so every completion runs to --new-tokens: the figures are pure decode throughput, as in
../shared/bench/hf_generate_baseline.py.

For each run it prints tokens/s, milliseconds per decode step (wall time / new tokens, prefill
included, for both samplers), the speed-up over HF, and the fraction of the memory-bandwidth
floor: one decode step must read every weight once plus the KV cache of every sequence; that
byte count divided by the copy bandwidth measured here on the same device is the floor.

    python bench/rollout.py                      # default: both models, 64/256/1024 seqs (< 8 min on an H100)
    python bench/rollout.py --quick              # 0.5B only, 64/256 seqs, 128 new tokens
    python bench/rollout.py --check              # correctness of the CUDA path in bf16, then exit
    python bench/rollout.py --models 0.5b --sizes 256 --skip-hf-above 0

Writes $OUT/rollout.json when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from cohort_grpo.rollout import Engine# noqa: E402
from cohort_grpo.rollout.sampler import SamplingParams# noqa: E402

SHAPES = {  # Qwen2.5 shapes (their config.json), random weights
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2),
}
COMMON = dict(vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6, tie_word_embeddings=True)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=1000, tie_word_embeddings=True)  # `--models tiny --device cpu`: a smoke test of this script
DEVICE = "cuda"


def synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def empty_cache() -> None:
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def log(record: dict) -> None:
    print(json.dumps(record), flush=True)


def build_models(name: str):
    """(transformers Qwen2ForCausalLM, cohort CausalLM) sharing the same bf16 CUDA tensors."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from cohort_grpo.models import ModelConfig
    from cohort_grpo.models.loading import build_model

    config = Qwen2Config(**TINY) if name == "tiny" else Qwen2Config(**SHAPES[name], **COMMON)
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # initialise on the GPU in bf16: fast, and no fp32 copy
    try:
        with torch.device(DEVICE):
            hf_model = Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(default_dtype)
    hf_model = hf_model.to(device=DEVICE, dtype=torch.bfloat16).eval()
    ours = build_model(ModelConfig.from_hf_dict(config.to_dict()), dict(hf_model.state_dict()), torch.bfloat16,
                       torch.device(DEVICE), f"qwen2.5-{name}-shape")
    return hf_model, ours.eval()


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())  # a tied matrix counts once


def kv_bytes_per_token(model) -> int:
    config = model.config
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 2  # k and v, bf16


def copy_bandwidth() -> float:
    """Device memory bandwidth in bytes/s from a 1 GiB tensor copy (read + write)."""
    elements = 2**29 if DEVICE == "cuda" else 2**24
    source = torch.empty(elements, dtype=torch.bfloat16, device=DEVICE)
    target = torch.empty_like(source)
    for _ in range(3):
        target.copy_(source)
    synchronize()
    start, repeats = time.perf_counter(), 20
    for _ in range(repeats):
        target.copy_(source)
    synchronize()
    seconds = time.perf_counter() - start
    del source, target
    empty_cache()
    return 2 * 2 * elements * repeats / seconds


def time_hf(hf_model, prompts: torch.Tensor, new_tokens: int) -> dict:
    from transformers import GenerationConfig

    def config(tokens):
        return GenerationConfig(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=tokens,
                                min_new_tokens=tokens, pad_token_id=0, eos_token_id=None)

    mask = torch.ones_like(prompts)
    with torch.no_grad():
        hf_model.generate(input_ids=prompts, attention_mask=mask, generation_config=config(8))  # warm-up
        synchronize()
        start = time.perf_counter()
        out = hf_model.generate(input_ids=prompts, attention_mask=mask, generation_config=config(new_tokens))
        synchronize()
    seconds = time.perf_counter() - start
    return dict(seconds=seconds, tokens=(out.shape[1] - prompts.shape[1]) * prompts.shape[0])


def time_engine(model, prompts: torch.Tensor, new_tokens: int, max_batch: int, check_interval: int,
                compile_kernels: bool | None = None) -> dict:
    engine = Engine(model, max_batch_size=max_batch, check_interval=check_interval, compile_kernels=compile_kernels)
    prompt_list = prompts.tolist()
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, eos_token_ids=[], seed=0)
    captured = engine.capture_graphs(len(prompt_list), prompts.shape[1] + new_tokens, new_tokens)
    engine.generate(prompt_list, 1, SamplingParams(max_new_tokens=8, eos_token_ids=[], seed=1))  # warm-up
    synchronize()
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    rollout = engine.generate(prompt_list, 1, params)
    synchronize()
    seconds = time.perf_counter() - start
    stats = dict(engine.stats, graphs_precaptured=captured, compiled=engine.compile_kernels)
    engine.release()
    peak = torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else 0.0
    return dict(seconds=seconds, tokens=int(rollout.completion_mask.sum()), peak_gib=peak, stats=stats)


def run_benchmark(args) -> list[dict]:
    bandwidth = copy_bandwidth()
    log(dict(copy_bandwidth_gb_s=round(bandwidth / 1e9, 1)))
    results = []
    for name in args.models:
        hf_model, model = build_models(name)
        for size in args.sizes:
            generator = torch.Generator().manual_seed(size)
            vocab = model.config.vocab_size
            prompts = torch.randint(0, vocab, (size, args.prompt_len), generator=generator).to(DEVICE)
            row = dict(model=f"qwen2.5-{name}-shape", sequences=size, prompt_len=args.prompt_len,
                       new_tokens=args.new_tokens)
            mean_context = args.prompt_len + (args.new_tokens + 1) / 2
            floor_bytes = weight_bytes(model) + kv_bytes_per_token(model) * size * mean_context
            row["floor_ms_per_step"] = 1000 * floor_bytes / bandwidth
            if args.compile in ("off", "both"):  # the engine without torch.compile: graphs of the plain step
                try:
                    plain = time_engine(model, prompts, args.new_tokens, min(size, args.max_batch),
                                        args.check_interval, compile_kernels=False)
                    row.update(plain_tok_s=plain["tokens"] / plain["seconds"],
                               plain_ms_per_step=1000 * plain["seconds"] / args.new_tokens)
                except Exception as error:  # noqa: BLE001
                    row["plain_error"] = f"{type(error).__name__}: {error}"[:300]
                empty_cache()
            try:
                if args.compile == "off":
                    raise RuntimeError("skipped (--compile off)")
                engine = time_engine(model, prompts, args.new_tokens, min(size, args.max_batch), args.check_interval,
                                     compile_kernels=True)
                row.update(engine_tok_s=engine["tokens"] / engine["seconds"],
                           engine_ms_per_step=1000 * engine["seconds"] / args.new_tokens,
                           engine_peak_gib=engine["peak_gib"], engine_stats=engine["stats"])
                row["engine_floor_fraction"] = row["floor_ms_per_step"] / row["engine_ms_per_step"]
            except Exception as error:  # noqa: BLE001 - record and go on with the other runs
                row["engine_error"] = f"{type(error).__name__}: {error}"[:300]
            empty_cache()
            if size <= args.skip_hf_above:
                try:
                    hf = time_hf(hf_model, prompts, args.new_tokens)
                    row.update(hf_tok_s=hf["tokens"] / hf["seconds"], hf_ms_per_step=1000 * hf["seconds"] / args.new_tokens)
                    if "engine_tok_s" in row:
                        row["speedup"] = row["engine_tok_s"] / row["hf_tok_s"]
                    if "plain_tok_s" in row:
                        row["plain_speedup"] = row["plain_tok_s"] / row["hf_tok_s"]
                except Exception as error:  # noqa: BLE001
                    row["hf_error"] = f"{type(error).__name__}: {error}"[:300]
                empty_cache()
            log(row)
            results.append(row)
        del hf_model, model
        empty_cache()
    return results


def run_check(args) -> list[dict]:
    """Greedy tokens of the engine (CUDA graphs, bf16) against the same model's full forward
    (no cache) on the engine's own sequences, graph vs eager decoding, and the log-prob gap."""
    results = []
    for name in args.models:
        _, model = build_models(name)
        generator = torch.Generator().manual_seed(0)
        lengths = torch.randint(16, 129, (16,), generator=generator).tolist()
        prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=generator).tolist() for n in lengths]
        report = dict(model=f"qwen2.5-{name}-shape", prompts=len(prompts), new_tokens=64)
        compiled = args.compile != "off"
        graphs = Engine(model, max_batch_size=8, check_interval=8, verify_graphs=True,  # 32 sequences: 4 waves
                        compile_kernels=compiled)
        eager = Engine(model, max_batch_size=8, check_interval=8, use_cuda_graph=False, compile_kernels=compiled)
        eager.bucketed = True  # the same step shapes as the graphs, so the same kernels: equal tokens expected
        report["compiled"] = compiled
        for label, temperature in (("greedy", 0.0), ("sampled", 1.0)):
            params = SamplingParams(max_new_tokens=64, temperature=temperature, eos_token_ids=[], seed=5)
            try:
                rollout = graphs.generate(prompts, 2, params)
            except RuntimeError as error:  # the graph self-check raises on a mismatch
                report[f"{label}_error"] = str(error)[:300]
                continue
            reference = eager.generate(prompts, 2, params)
            report[f"{label}_graph_equals_eager"] = bool(torch.equal(rollout.completion_ids, reference.completion_ids))
            matches, positions, worst_gap, lp_gaps = 0, 0, 0.0, []
            for row, ids in enumerate(rollout.completion_ids):
                prompt = prompts[row // 2]
                with torch.inference_mode():
                    logits = model(torch.tensor([prompt + ids.tolist()], device=DEVICE))[0].float()
                logits = logits[len(prompt) - 1: -1] / (temperature or 1.0)
                ids = ids.to(DEVICE)
                full_logprobs = torch.log_softmax(logits, -1).gather(-1, ids[:, None]).squeeze(-1)
                lp_gaps.append((full_logprobs.cpu() - rollout.logprobs[row]).abs())
                if label == "greedy":
                    argmax = logits.argmax(-1)
                    matches += int((argmax == ids).sum())
                    positions += ids.numel()
                    gap = logits.max(-1).values - logits.gather(-1, ids[:, None]).squeeze(-1)
                    worst_gap = max(worst_gap, float(gap.max()))
            lp_gaps = torch.cat(lp_gaps)
            report[f"{label}_logprob_gap_max"] = float(lp_gaps.max())
            report[f"{label}_logprob_gap_mean"] = float(lp_gaps.mean())
            if label == "greedy":
                report["greedy_argmax_match"] = matches / positions
                report["greedy_mismatch_worst_logit_gap"] = worst_gap  # near 0: bf16 near-ties, not a bug
        report["graph_verify_max_rel_error"] = graphs.graphs.max_verify_error
        report["graphs_captured"] = graphs.graphs.captures
        log(report)
        results.append(report)
        del model, graphs, eager
        empty_cache()
    return results


def markdown(results: list[dict]) -> str:
    def fmt(row, key, spec):
        return format(row[key], spec) if key in row else "-"

    lines = ["| model | seqs | HF tok/s | HF ms/step | uncompiled engine ms/step (speed-up) | engine tok/s "
             "| engine ms/step | speed-up | floor ms/step | % of floor | engine peak GiB |", "|" + " --- |" * 11]
    for row in results:
        plain = (f"{row['plain_ms_per_step']:.2f} ({row['plain_speedup']:.1f}×)" if "plain_speedup" in row
                 else fmt(row, "plain_ms_per_step", ".2f"))
        lines.append("| " + " | ".join([
            row["model"], str(row["sequences"]), fmt(row, "hf_tok_s", ",.0f"), fmt(row, "hf_ms_per_step", ".1f"), plain,
            fmt(row, "engine_tok_s", ",.0f"), fmt(row, "engine_ms_per_step", ".2f"), fmt(row, "speedup", ".1f"),
            fmt(row, "floor_ms_per_step", ".2f"),
            format(100 * row["engine_floor_fraction"], ".0f") if "engine_floor_fraction" in row else "-",
            fmt(row, "engine_peak_gib", ".1f")]) + " |")
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="0.5b,1.5b", help="comma list of: " + ", ".join(SHAPES))
    parser.add_argument("--sizes", default="64,256,1024", help="comma list of sequence counts")
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--skip-hf-above", type=int, default=256,
                        help="skip HF generate for more sequences than this (it is slow at 1024)")
    parser.add_argument("--max-batch", type=int, default=1024, help="Engine max_batch_size cap")
    parser.add_argument("--check-interval", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="0.5B only, 64 and 256 sequences, 128 new tokens")
    parser.add_argument("--check", action="store_true", help="correctness of the CUDA path, no timing")
    parser.add_argument("--device", default="cuda", help="cpu only to smoke-test this script with --models tiny")
    parser.add_argument("--compile", choices=("on", "off", "both"), default="both",
                        help="engine with a torch.compile'd decode step, without, or both (default)")
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.sizes, args.new_tokens = "0.5b", "64,256", 128
    args.models = [m.strip().lower() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in args.models if m not in SHAPES and m != "tiny"]
    if unknown:
        parser.error(f"unknown --models {unknown}; choose from {list(SHAPES)}")
    args.sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    return args


def main(argv=None) -> None:
    global DEVICE
    args = parse_args(argv)
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/rollout.py needs a CUDA device")
    import transformers

    device_name = torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE
    log(dict(torch=torch.__version__, transformers=transformers.__version__, device=device_name))
    started = time.perf_counter()
    results = run_check(args) if args.check else run_benchmark(args)
    if not args.check:
        print("\n" + markdown(results) + "\n", flush=True)
    print(f"total {time.perf_counter() - started:.0f} s", flush=True)
    if os.environ.get("OUT"):
        out = Path(os.environ["OUT"])
        out.mkdir(parents=True, exist_ok=True)
        (out / ("rollout_check.json" if args.check else "rollout.json")).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
