"""Sampling speed of the generic path (transformers' own modules in cohort's engine) on one GPU.

For each model shape (random weights in bfloat16, the sizes of the named checkpoints' config.json; nothing is
downloaded) it times, on the same weights and the same random 128-token prompts with EOS ignored (every completion
runs to --new-tokens, as in bench/rollout.py):
- `generic`: `TransformersCausalLM` (cohort_grpo/models/generic.py) sampled by cohort's `Engine`, its defaults
  (CUDA graphs checked against an eager step, the flash-decoding kernel where the head width allows);
- `generic_eager`: the same without CUDA graphs (what the path did before graphs);
- `generic_unfused` (with --unfused): the same graphs without the sampling path's fused norms, MLPs and q/k/v
  GEMMs (cohort_grpo/models/generic_fusion.py), to measure what they gain;
- `native`: cohort's own implementation, for the families it has (Qwen2.5 shapes);
- `hf`: transformers' `generate` on the unwrapped model.
Prints one JSON line per model with tokens/s and the ratios generic/native and generic/hf, then a markdown table.

    python bench/generic_decode.py                                  # every shape, 256 sequences
    python bench/generic_decode.py --models qwen2.5-0.5b --sequences 64
    python bench/generic_decode.py --models tiny --device cpu       # a smoke test of this script
    python bench/generic_decode.py --unfused --skip-hf              # what the fused sampling forwards gain

Writes $OUT/generic_decode.json when OUT is set.
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

from cohort_grpo.models.generic import TransformersCausalLM  # noqa: E402
from cohort_grpo.rollout import Engine, make_sampler  # noqa: E402
from cohort_grpo.rollout.sampler import SamplingParams  # noqa: E402

QWEN = dict(vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6, tie_word_embeddings=True)
# model name: (transformers config class name, its arguments)
SHAPES = {
    "qwen2.5-0.5b": ("Qwen2Config", dict(QWEN, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                         num_attention_heads=14, num_key_value_heads=2)),
    "qwen2.5-1.5b": ("Qwen2Config", dict(QWEN, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                         num_attention_heads=12, num_key_value_heads=2)),
    "gemma-3-1b": ("Gemma3TextConfig", dict(hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                                            num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                                            sliding_window=512, query_pre_attn_scalar=256, vocab_size=262144,
                                            max_position_embeddings=32768)),
    "phi-4-mini": ("Phi3Config", dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                                      num_attention_heads=24, num_key_value_heads=8, vocab_size=200064,
                                      partial_rotary_factor=0.75, tie_word_embeddings=True,
                                      max_position_embeddings=32768)),
    "olmo-2-1b": ("Olmo2Config", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                      num_attention_heads=16, num_key_value_heads=16, vocab_size=100352,
                                      max_position_embeddings=4096)),
    "smollm3-3b": ("SmolLM3Config", dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                                         num_attention_heads=16, num_key_value_heads=4, vocab_size=128256,
                                         max_position_embeddings=32768, tie_word_embeddings=True)),
    "tiny": ("Qwen2Config", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=True)),
}
NATIVE = {"qwen2.5-0.5b", "qwen2.5-1.5b", "tiny"}  # shapes of a family cohort implements itself


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def build(name: str, device: str):
    """transformers' model of shape `name`: random bf16 weights (float32 on the CPU), eval mode."""
    import transformers

    class_name, arguments = SHAPES[name]
    config = getattr(transformers, class_name)(**arguments, pad_token_id=0)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(default)
    return model.to(device=device, dtype=dtype).eval()


def native_model(hf_model):
    from cohort_grpo.models import ModelConfig
    from cohort_grpo.models.loading import build_model

    weights = dict(hf_model.state_dict())
    config = ModelConfig.from_hf_dict(hf_model.config.to_dict())
    return build_model(config, weights, hf_model.dtype, hf_model.device, "native").eval()


def time_engine(engine: Engine, prompts: list[list[int]], new_tokens: int, device: str) -> dict:
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, eos_token_ids=[], seed=0)
    engine.generate(prompts, 1, SamplingParams(max_new_tokens=new_tokens, eos_token_ids=[], seed=1))  # warm-up
    synchronize(device)
    start = time.perf_counter()
    rollout = engine.generate(prompts, 1, params)
    synchronize(device)
    seconds = time.perf_counter() - start
    stats = {key: engine.stats.get(key) for key in ("graph_captures",)}
    graphs_on = engine.graphs.enabled
    engine.release()
    return dict(tok_s=int(rollout.completion_mask.sum()) / seconds, graphs=graphs_on, **stats)


def time_generate(hf_model, prompts: torch.Tensor, new_tokens: int, device: str) -> float:
    from transformers import GenerationConfig

    def config(tokens):
        return GenerationConfig(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=tokens,
                                min_new_tokens=tokens, pad_token_id=0, eos_token_id=None)

    mask = torch.ones_like(prompts)
    with torch.no_grad():
        hf_model.generate(input_ids=prompts, attention_mask=mask, generation_config=config(8))
        synchronize(device)
        start = time.perf_counter()
        out = hf_model.generate(input_ids=prompts, attention_mask=mask, generation_config=config(new_tokens))
        synchronize(device)
    return (out.shape[1] - prompts.shape[1]) * prompts.shape[0] / (time.perf_counter() - start)


def measure(name: str, args) -> dict:
    hf_model = build(name, args.device)
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, hf_model.config.vocab_size, (args.sequences, args.prompt_len), generator=generator)
    prompt_list = prompts.tolist()
    row = dict(model=name, sequences=args.sequences, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
               device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu")
    if not args.skip_hf:
        row["hf_tok_s"] = time_generate(hf_model, prompts.to(args.device), args.new_tokens, args.device)
    generic = TransformersCausalLM.wrap(hf_model)  # the same tensors (its attention from now on cohort's)
    engine = make_sampler(generic, max_batch_size=args.sequences)
    row["generic"] = time_engine(engine, prompt_list, args.new_tokens, args.device)
    row["fusions"] = dict(norms=generic.fusions.norms, mlps=generic.fusions.mlps,
                          attentions=generic.fusions.attentions)
    if args.unfused:
        generic.fusions.on = False  # a new engine: its graphs are captured without them
        row["generic_unfused"] = time_engine(make_sampler(generic, max_batch_size=args.sequences), prompt_list,
                                             args.new_tokens, args.device)
        generic.fusions.on = True
        row["fusion_gain"] = row["generic"]["tok_s"] / row["generic_unfused"]["tok_s"]
    if args.device == "cuda":
        eager = Engine(generic, max_batch_size=args.sequences, use_cuda_graph=False)
        row["generic_eager"] = time_engine(eager, prompt_list, args.new_tokens, args.device)
    if name in NATIVE:
        native = native_model(hf_model)
        row["native"] = time_engine(make_sampler(native, max_batch_size=args.sequences), prompt_list,
                                    args.new_tokens, args.device)
        row["generic_over_native"] = row["generic"]["tok_s"] / row["native"]["tok_s"]
        del native
    if "hf_tok_s" in row:
        row["generic_over_hf"] = row["generic"]["tok_s"] / row["hf_tok_s"]
    del hf_model, generic, engine
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return row


def markdown(rows: list[dict]) -> str:
    lines = ["| model | generic tok/s | unfused tok/s | eager tok/s | native tok/s | generate tok/s | generic / native | "
             "generic / generate |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        def value(key, inner=None, spec=",.0f"):
            item = row.get(key)
            item = item.get(inner) if isinstance(item, dict) and inner else item
            return "—" if item is None else format(item, spec)
        lines.append(f"| {row['model']} | {value('generic', 'tok_s')} | {value('generic_unfused', 'tok_s')} | "
                     f"{value('generic_eager', 'tok_s')} | "
                     f"{value('native', 'tok_s')} | {value('hf_tok_s')} | {value('generic_over_native', spec='.2f')} | "
                     f"{value('generic_over_hf', spec='.1f')}× |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="qwen2.5-0.5b,qwen2.5-1.5b,gemma-3-1b,phi-4-mini,olmo-2-1b,smollm3-3b")
    parser.add_argument("--sequences", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--unfused", action="store_true",
                        help="also time the generic path without its fused norms, MLPs and q/k/v GEMMs")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    rows = []
    for name in args.models.split(","):
        try:
            row = measure(name, args)
        except Exception as error:  # noqa: BLE001 - record it, go on with the other shapes
            row = dict(model=name, error=f"{type(error).__name__}: {error}"[:400])
        print(json.dumps(row), flush=True)
        rows.append(row)
    print(markdown(rows))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "generic_decode.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
