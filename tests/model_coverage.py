"""Which of the installed transformers' text causal-LM types cohort serves, and how: the rows of docs/models.md.

`coverage_row(model_type)` builds a tiny random model of the type from its own config class (sizes shrunk by
field name, `SIZES`, plus a few per-type `OVERRIDES`; float32, seed 0) and records what happens: whether
`AutoModelForCausalLM.from_config` loads it, whether the generic path (cohort_grpo/models/generic.py) serves it or
the refusal's reason, whether its logits equal transformers' forward, whether the engine's greedy tokens equal
transformers' greedy `generate`, and whether two GRPO steps run on it. The six families cohort implements itself
are rows too (path `native`), not walked here (their own tests cover them), and so are the vision-language types
the vision-language path serves (path `vision`: tests/test_vision_language.py checks them with images).

    PYTHONPATH=$PWD python tests/model_coverage.py --write docs/models.md    # regenerate the page
    PYTHONPATH=$PWD python tests/model_coverage.py llama4_text olmo           # print rows

tests/test_model_coverage.py recomputes the rows and compares them with the committed page.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import inspect
import io
import multiprocessing
import os
import re
import sys
import tempfile
import warnings
from concurrent.futures import ProcessPoolExecutor

import torch
import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from cohort_grpo.models.config import SUPPORTED_MODEL_TYPES
from cohort_grpo.models.vision_families import FAMILIES as VISION_FAMILIES

VOCAB = 128  # above the built-in character tokenizer's 83 ids, so the training steps run on its tokenizer
WINDOW = 8  # sliding windows: shorter than the longer prompt below
LOGIT_TOLERANCE = 1e-4
PROMPTS = [[5, 9, 13], [11, 4, 8, 15, 16, 23, 42, 6, 10, 12, 14, 19]]
NEW_TOKENS = 4
# Size-like config fields, by name (transformers' own spellings differ by family), and their tiny values.
SIZES = {
    **dict.fromkeys(["hidden_size", "n_embd", "d_model", "dim", "embed_dim", "word_embed_proj_dim"], 64),
    **dict.fromkeys(["num_hidden_layers", "n_layer", "num_layers", "n_layers", "num_decoder_layers"], 2),
    **dict.fromkeys(["num_attention_heads", "n_head", "n_heads", "num_heads", "decoder_attention_heads"], 4),
    **dict.fromkeys(["num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num"], 2),
    **dict.fromkeys(["intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size", "decoder_ffn_dim",
                     "inner_hidden_size", "mlp_dim"], 128),
    **dict.fromkeys(["max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "seq_length",
                     "max_sequence_length", "original_max_position_embeddings"], 64),
    **dict.fromkeys(["sliding_window", "attention_window_size", "window_size"], WINDOW),
    **dict.fromkeys(["head_dim", "kv_channels", "attention_head_dim"], 16),
    **dict.fromkeys(["num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts"],
                    4),
    **dict.fromkeys(["num_experts_per_tok", "moe_k", "top_k", "moe_topk", "num_selected_experts"], 2),
    **dict.fromkeys(["moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size",
                     "moe_ffn_hidden_size"], 32),
    **dict.fromkeys(["n_shared_experts", "num_shared_experts", "moe_num_shared_experts"], 1),
    **dict.fromkeys(["first_k_dense_replace", "first_k_dense"], 1),
    **dict.fromkeys(["n_group", "topk_group"], 1),
    # MLA at DeepSeek's proportions: keys (nope + rope) wider than values.
    "kv_lora_rank": 16, "q_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "qk_head_dim": 24,
    **dict.fromkeys(["decoder_layers", "encoder_layers"], 2),
    **dict.fromkeys(["encoder_attention_heads"], 4),
    **dict.fromkeys(["encoder_ffn_dim"], 128),
    **dict.fromkeys(["embedding_size", "input_embedding_size", "output_embedding_size"], 64),
    "rotary_dim": 8, "is_decoder": True,
    "vocab_size": VOCAB, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2,
    "tie_word_embeddings": False,
}
# Other integer fields above SMALL, by what their names contain (the first pattern that matches).
PATTERNS = [("vocab_size", VOCAB), ("head_dim", 16), ("dim_head", 16), ("window", WINDOW), ("max_position", 64),
            ("moe_intermediate", 32), ("shared_intermediate", 32), ("intermediate", 128), ("dim_ff", 128),
            ("ffn", 128), ("embed_dim", 64), ("hidden_size", 64), ("lora_rank", 16), ("experts", 4),
            ("topk", 4)]
SMALL = 64
# A few types whose own fields the names above do not reach, or reach wrongly (their validation's demands).
OVERRIDES: dict[str, dict] = {
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]]),
    # state-space layers: Mamba 2 heads of the attention heads' width, a chunk shorter than the longer prompt (its
    # scan carries a state from chunk to chunk), attention layers between them as the released checkpoints have
    "mamba2": dict(expand=1, n_groups=1, state_size=16, chunk_size=8),
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention", "linear_attention"],
                             num_hidden_layers=3, mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16,
                             mamba_chunk_size=8),
    "bamba": dict(attn_layer_indices=[1], num_hidden_layers=3, mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16,
                  mamba_chunk_size=8),
    # LFM2's short-convolution layers around an attention layer (its default config attends in every layer)
    "lfm2": dict(layer_types=["conv", "full_attention", "conv"], num_hidden_layers=3),
    "lfm2_moe": dict(layer_types=["conv", "full_attention", "conv"], num_hidden_layers=3, num_dense_layers=1),
    "zaya": dict(num_experts_per_tok=1),
    "gemma4_assistant": dict(hidden_size_per_layer_input=0),
    "dots3_note_text": dict(num_key_value_heads=4),
    "kolibri1_1": dict(index_num_heads=2),
    "dbrx": dict(attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                 ffn_config=dict(ffn_hidden_size=128, moe_num_experts=4, moe_top_k=2)),
    # the last layers reuse the keys and values of the last layer of their type before them
    **dict.fromkeys(["gemma3n_text", "gemma4_text"], dict(
        num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2)),
    "cohere_compass_text": dict(rope_parameters={"full_attention": dict(rope_type="default", rope_theta=10000.0)}),
    "reformer": dict(axial_pos_shape=[8, 8], axial_pos_embds_dim=[32, 32]),
}
# Multimodal types whose configs hold no vision or audio sub-config.
NOT_TEXT_TYPES = {"fuyu": "image patches", "emu3": "image tokens of its VQ model"}
NOT_TEXT_KEYS = ("vision", "audio", "image", "speech", "visual", "encoder", "depth", "codec")
PASS = "passes"
MAX_PARAMETERS = 4_000_000


def text_causal_lm_types() -> list[str]:
    """The installed transformers' causal-LM model types, sorted."""
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def not_text(config) -> str | None:
    """Why a model of `config` is not a text model (its config holds a vision, audio, ... sub-config), or None."""
    for name in sorted(getattr(config, "sub_configs", None) or {}):
        if any(key in name for key in NOT_TEXT_KEYS):
            return f"not a text model (its config has {name})"
    return None


def accepted_fields(config_class, default) -> set[str]:
    names = set(default.to_dict()) | set(getattr(config_class, "attribute_map", {}))
    with contextlib.suppress(TypeError, ValueError):
        names |= set(inspect.signature(config_class.__init__).parameters)
    return names


def layer_kinds_prefix(default) -> list | None:
    """The shortest prefix of the default config's `layer_types` that holds each kind it mixes (at least 2)."""
    types = getattr(default, "layer_types", None)
    if not types:
        return None
    first = {}
    for index, kind in enumerate(types):
        first.setdefault(kind, index)
    return list(types[:max(2, max(first.values()) + 1)])


def tiny_config(model_type: str):
    """A tiny config of `model_type` from its own config class: every size-like field it has shrunk."""
    config_class = transformers.CONFIG_MAPPING[model_type]
    default = config_class()
    fields = accepted_fields(config_class, default)
    arguments = {name: value for name, value in SIZES.items() if name in fields}
    for name, value in default.to_dict().items():
        small = next((small for pattern, small in PATTERNS if pattern in name), None)
        if name not in arguments and type(value) is int and value > SMALL and small is not None:
            arguments[name] = small
    if "qk_rope_head_dim" in fields:  # MLA: head_dim is the rotary part's (derived), keys expand to every head
        arguments.pop("head_dim", None)
        arguments["num_key_value_heads"] = arguments.get("num_attention_heads", 4)
    prefix = layer_kinds_prefix(default)
    if prefix is not None:
        arguments["layer_types"] = prefix
        for name in ("num_hidden_layers", "n_layer", "num_layers"):
            if name in arguments:
                arguments[name] = len(prefix)
    arguments.update(OVERRIDES.get(model_type, {}))
    try:
        config = config_class(**arguments)
    except (AttributeError, TypeError):  # layer_types derived (a property), not an argument
        arguments.pop("layer_types", None)
        config = config_class(**arguments)
    config.use_cache = True
    return config


def one_line(error: BaseException) -> str:
    """An exception as one short line: its type and the first line of its message, numbers of float errors cut."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    text = " ".join(lines[:2]) if lines and lines[0].endswith(":") else (lines or [""])[0]
    text = re.sub(r"\s*\(relative error [^)]*\)", "", text)
    text = re.sub(r"0x[0-9a-f]+", "0x…", text)
    return f"{type(error).__name__}: {text[:160]}"


def coverage_row(model_type: str) -> dict:
    """What happens to a tiny random `model_type`: {type, path (native, generic, hf or skipped), result (`PASS` or
    the first check that fails, with why)}."""
    if model_type in SUPPORTED_MODEL_TYPES:
        return dict(type=model_type, path="native", result="cohort's own implementation (cohort_grpo/models/)")
    with quiet():
        return walk(model_type)


@contextlib.contextmanager
def quiet():
    """transformers' and cohort's prints and warnings kept off the output."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        verbosity = transformers.logging.get_verbosity()
        transformers.logging.set_verbosity_error()
        try:
            yield
        finally:
            transformers.logging.set_verbosity(verbosity)


def walk(model_type: str) -> dict:
    from cohort_grpo.models.generic import TransformersCausalLM
    from cohort_grpo.models.generic_attention import GenericPathRefused, refusal

    row = dict(type=model_type)
    if model_type in VISION_FAMILIES:
        return dict(row, path="vision", result="served with its images (tests/test_vision_language.py)")
    try:
        config = tiny_config(model_type)
    except Exception as error:  # noqa: BLE001 - the reason is the row's
        return dict(row, path="skipped", result=f"no tiny config: {one_line(error)}")
    reason = not_text(config)
    if model_type in NOT_TEXT_TYPES:
        reason = f"not a text model ({NOT_TEXT_TYPES[model_type]})"
    if reason is not None:
        return dict(row, path="skipped", result=reason)
    try:
        with torch.device("meta"):
            size = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
    except Exception as error:  # noqa: BLE001
        if refusal(config) is not None:  # refused from the config alone, whether or not the tiny model loads
            return dict(row, path="hf", result=f"refused: {refusal(config)}")
        return dict(row, path="skipped", result=f"does not load: {one_line(error)}")
    if size > MAX_PARAMETERS:
        return dict(row, path="skipped", result=f"the tiny config still has {size:,} parameters (a size field "
                                                "SIZES does not name)")
    try:
        torch.manual_seed(0)
        reference = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32).eval()
    except Exception as error:  # noqa: BLE001
        return dict(row, path="skipped", result=f"does not load: {one_line(error)}")
    reference.generation_config.eos_token_id = None  # both samplers run to NEW_TOKENS
    reference.generation_config.pad_token_id = 0
    try:
        model = TransformersCausalLM.wrap(copy.deepcopy(reference)).eval()
    except GenericPathRefused as refused:
        return dict(row, path="hf", result=f"refused: {one_line(refused).split(': ', 1)[1]}")
    except Exception as error:  # noqa: BLE001
        return dict(row, path="hf", result=f"wrap fails: {one_line(error)}")
    for check in (check_logits, check_greedy, check_training):
        try:
            failure = check(reference, model)
        except Exception as error:  # noqa: BLE001
            failure = one_line(error)
        if failure is not None:
            return dict(row, path="generic", result=f"{check.__doc__.split(':')[0]}: {failure}")
    return dict(row, path="generic", result=PASS)


def check_logits(reference, model) -> str | None:
    """logits: the wrapped model's full and cached forwards equal transformers' (≤ LOGIT_TOLERANCE)."""
    from cohort_grpo.models.cache import KVCache

    torch.manual_seed(1)
    input_ids = torch.randint(3, VOCAB, (2, 11))
    cache = KVCache.for_model(model, 2, 16)
    with torch.no_grad():
        expected = reference(input_ids).logits
        positions = torch.arange(11).expand(2, 11)
        for name, logits in (("forward", model(input_ids)),
                             ("cached forward", model(input_ids, positions, kv_cache=cache, cache_len=11))):
            error = float((logits - expected).abs().max())
            if not error <= LOGIT_TOLERANCE:
                return f"the {name} differs from transformers' by more than {LOGIT_TOLERANCE:g}"
    return None


def check_greedy(reference, model) -> str | None:
    """greedy tokens: the engine's equal transformers' greedy `generate`, prompt by prompt."""
    from cohort_grpo.rollout.engine import Engine
    from cohort_grpo.rollout.sampler import SamplingParams

    rollout = Engine(model, max_batch_size=2).generate(
        PROMPTS, 1, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, pad_token_id=0))
    for row, prompt in enumerate(PROMPTS):
        ids = torch.tensor([prompt])
        expected = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                      do_sample=False)[0, len(prompt):]
        if rollout.completion_ids[row].tolist() != expected.tolist():
            return f"the engine's tokens differ from generate's for a prompt of {len(prompt)} tokens"
    return None


def check_training(reference, model) -> str | None:
    """training: two GRPO steps (`GRPOTrainer`, the engine sampling, cohort's update) run with finite losses."""
    from cohort_grpo import GRPOConfig, GRPOTrainer
    from cohort_grpo.models.tiny import build_tokenizer

    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(output_dir=out, max_steps=2, num_generations=2, per_device_train_batch_size=4,
                          gradient_accumulation_steps=1, max_completion_length=4, learning_rate=1e-3, seed=0,
                          quiet=True, device="cpu", save_strategy="no", report_to=[])
        trainer = GRPOTrainer(model, lambda completions, **_: [float(len(c) % 3) for c in completions],
                              [{"prompt": p} for p in ("12+3=", "7*8=", "1-1=", "40/5=")], args=args,
                              processing_class=build_tokenizer())
        trainer.train()
        if trainer.step != 2:
            return f"stopped at step {trainer.step}"
    return None


def coverage_rows(model_types: list[str] | None = None, workers: int | None = None) -> list[dict]:
    """`coverage_row` of each type (default: every causal-LM type), in `workers` processes (default: the CPUs)."""
    model_types = model_types or text_causal_lm_types()
    workers = workers or len(os.sched_getaffinity(0))
    if workers == 1:
        return [coverage_row(model_type) for model_type in model_types]
    if workers == 0:  # one by one, each named on stderr first (finding a type that crashes the process)
        return [print(model_type, file=sys.stderr, flush=True) or coverage_row(model_type)
                for model_type in model_types]
    # Spawned, not forked: a fork of a process whose torch has started its threads can hang or crash.
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                             initializer=torch.set_num_threads, initargs=(1,)) as pool:
        return list(pool.map(coverage_row, model_types, chunksize=1))


def render(rows: list[dict]) -> str:
    """docs/models.md from the rows."""
    passing = [row for row in rows if row["result"] == PASS]
    lines = [
        "# Models: which transformers types cohort serves",
        "",
        f"Generated for transformers {transformers.__version__} by `tests/model_coverage.py` (each type: a tiny "
        "random model from its own config class, float32, seed 0, on the CPU). Regenerate with",
        "`PYTHONPATH=$PWD python tests/model_coverage.py --write docs/models.md`; `tests/test_model_coverage.py` "
        "fails when this page is out of date.",
        "",
        "Path: `native` — cohort's own implementation (`cohort_grpo/models/causal_lm.py`, `decoder.py`); `generic` — "
        "transformers' "
        "own modules with cohort's attention and KV cache ([speed.md](howto/speed.md#other-decoder-only-models-the-"
        "generic-path)), sampled by cohort's engine; `hf` — transformers' model and `generate` (`--model_impl auto` "
        "says why; `--model_impl cohort` refuses it); `vision` — a vision-language model on the vision-language path "
        "([vision.md](howto/vision.md): the language tower as the generic path serves it, the images through the "
        "vision tower once per prompt), checked with images by its own tests, not walked here; `skipped` — not "
        "walked.",
        "",
        f"`{PASS}`: the logits of the wrapped model (full and cached forwards) equal transformers' within "
        f"{LOGIT_TOLERANCE:g}, the engine's greedy tokens equal `generate`'s (prompts of {len(PROMPTS[0])} and "
        f"{len(PROMPTS[1])} tokens, {NEW_TOKENS} new tokens), and two GRPO steps run. "
        f"{len(passing)} generic types pass; {sum(row['path'] == 'native' for row in rows)} are native.",
        "",
        "| type | path | result |",
        "|---|---|---|",
    ]
    for row in rows:
        result = row["result"].replace("|", "\\|")
        lines.append(f"| `{row['type']}` | {row['path']} | {result} |")
    return "\n".join(lines) + "\n"


def parse(page: str) -> dict[str, dict]:
    """The rows of a page `render` wrote, by type."""
    rows = {}
    for line in page.splitlines():
        match = re.match(r"\| `([^`]+)` \| (\w+) \| (.*) \|$", line)
        if match:
            rows[match[1]] = dict(type=match[1], path=match[2], result=match[3].replace("\\|", "|"))
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("types", nargs="*", help="model types (default: every causal-LM type)")
    parser.add_argument("--write", metavar="PAGE", help="write the page here (e.g. docs/models.md)")
    parser.add_argument("--workers", type=int, default=None)
    options = parser.parse_args(argv)
    rows = coverage_rows(options.types or None, options.workers)
    if options.write:
        with open(options.write, "w") as page:
            page.write(render(rows))
    else:
        for row in rows:
            print(f"{row['type']:28} {row['path']:8} {row['result']}")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
