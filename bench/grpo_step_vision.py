"""The vision-language runs of bench/grpo_step.py (a Qwen2.5-VL shape): the same kinds as grpo_step_worker.py's
(build, trl, cohort), with one synthetic image per prompt.

- The model: a random-init `Qwen2_5_VLForConditionalGeneration` of the shape (grpo_step_worker.SHAPES), saved as bf16
  safetensors, as the text shapes' folders are.
- The processor, built in each worker with no download: transformers' Qwen2.5-VL image processor (patch 14, 2 × 2
  merge, Qwen2.5-VL's preprocessor_config.json pixel bounds, so a 448 × 448 image is 32 × 32 patches = 256 image
  tokens) over grpo_step_worker's word-level tokenizer ('t<i>' is token i) with Qwen-VL's vision tags as single
  tokens, and a chat template that renders an image part as `<|vision_start|><|image_pad|><|vision_end|>` and a text
  part as its words (`cohort_grpo.models.tiny_vision.image_only_processor_class`: Qwen2.5-VL's processor without the
  video processor, which needs torchvision).
- The data: conversational prompts (one user turn of `prompt_len` random words) with an `image` column, as TRL's VLM
  path takes them; each image is `image_side` pixels square of random colours (DISTINCT_IMAGES of them, cycled).
- The reward: the fraction of distinct words of the completion, as for text.
Both trainers get the processor as `processing_class` and train every weight, the vision tower's too (TRL's default;
cohort's is a frozen tower, `freeze_vision_tower=true`, which `--cohort-variants` can add); everything else is
grpo_step_worker's configuration, but TRL's weights are bf16 (`TRL_DTYPE`).
"""

from __future__ import annotations

import shutil
import time

import numpy as np
import torch

import grpo_step_worker as text_bench

# The vision tags' ids: below EOS (V-1) and pad (V-2), the rest of the vocabulary is words.
TAGS = {"<|vision_start|>": 6, "<|vision_end|>": 5, "<|image_pad|>": 4, "<|video_pad|>": 3}  # id = V - value
TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.content is string %}{{- message.content + ' ' }}"
    "{%- else %}{%- for part in message.content %}"
    "{%- if part.type == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|> ' }}"
    "{%- elif part.type == 'text' %}{{- part.text + ' ' }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{%- endfor %}"
)
# Qwen2.5-VL's preprocessor_config.json: min_pixels 56 × 56, max_pixels 28 × 28 × 16384 (the smoke's 56 × 56 image is
# 4 × 4 patches, 4 image tokens).
MIN_PIXELS, MAX_PIXELS = 3136, 12845056
DISTINCT_IMAGES = 32
# TRL loads a model path in float32 unless told (the text shapes' runs keep that default): at 3.75B parameters, the
# float32 weights, π_ref's copy, the gradients and AdamW's two moments are 75 GB before any activation, more than an
# H100 holds. Its weights (and so its AdamW moments) are bf16 here instead, beside cohort's bf16 weights.
TRL_DTYPE = "bfloat16"


def is_vision(shape: dict) -> bool:
    return shape.get("model_type") == "qwen2_5_vl"


def tag_ids(vocab: int) -> dict[str, int]:
    return {tag: vocab - offset for tag, offset in TAGS.items()}


def make_tokenizer(vocab: int):
    """grpo_step_worker's word-level tokenizer with the vision tags as single tokens (at `tag_ids`)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    ids = tag_ids(vocab)
    words = {f"t{i}": i for i in range(vocab) if i not in ids.values()}
    tok = Tokenizer(models.WordLevel(vocab={**words, **ids}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_tokens([AddedToken(tag, normalized=False) for tag in ids])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=f"t{vocab - 1}", pad_token=f"t{vocab - 2}",
                                        unk_token="t0")
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def make_processor(shape: dict):
    from transformers import Qwen2VLImageProcessorPil

    from cohort_grpo.models.tiny_vision import image_only_processor_class

    vision = shape["vision_config"]
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=vision["patch_size"],
        merge_size=vision["spatial_merge_size"], temporal_patch_size=vision["temporal_patch_size"])
    return image_only_processor_class()(image_processor=image_processor, tokenizer=make_tokenizer(shape["vocab_size"]),
                                        chat_template=TEMPLATE)


def image_tokens(shape: dict) -> int:
    """The image tokens of one prompt's image: its patches over the merge window."""
    vision = shape["vision_config"]
    return (shape["image_side"] // vision["patch_size"]) ** 2 // vision["spatial_merge_size"] ** 2


def make_rows(shape: dict, rows: int, prompt_len: int) -> list[dict]:
    """grpo_step_worker's prompts as one user turn each, with an `image` column of random-colour squares."""
    from PIL import Image

    rng = np.random.RandomState(0)
    side = shape["image_side"]
    images = [Image.fromarray(rng.randint(0, 256, (side, side, 3)).astype("uint8")) for _ in range(DISTINCT_IMAGES)]
    texts = text_bench.make_prompts(shape["vocab_size"] - len(TAGS) - 1, rows, prompt_len)  # no tag, EOS or pad
    return [{"prompt": [{"role": "user", "content": row["prompt"]}], "image": images[i % DISTINCT_IMAGES]}
            for i, row in enumerate(texts)]


def make_reward(completion_len: int):
    def reward_distinct(completions, **kwargs):
        """The fraction of distinct words over the completion budget (completions are assistant messages)."""
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [len(set(t.split())) / float(completion_len) for t in texts]

    return reward_distinct


def hf_config(shape: dict):
    """The shape as a `Qwen2_5_VLConfig` (its text and vision configs, the tags' ids of `make_tokenizer`)."""
    from transformers import Qwen2_5_VLConfig

    vocab = shape["vocab_size"]
    ids = tag_ids(vocab)
    text = {**shape["text_config"], "vocab_size": vocab, "eos_token_id": vocab - 1, "pad_token_id": vocab - 2,
            "bos_token_id": None}
    return Qwen2_5_VLConfig(
        text_config=text, vision_config=dict(shape["vision_config"]), image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], eos_token_id=vocab - 1, pad_token_id=vocab - 2, bos_token_id=None,
        tie_word_embeddings=shape["tie_word_embeddings"])


def run_build(spec: dict, rec) -> None:
    """A random-init Qwen2.5-VL of the shape, bf16 safetensors, with its processor's files (as grpo_step_worker's
    build: initialised on the device in bf16)."""
    import transformers

    started = time.perf_counter()
    config = hf_config(spec["shape"])
    model = text_bench.built_in_bf16(lambda: transformers.Qwen2_5_VLForConditionalGeneration(config), spec["device"])
    model.save_pretrained(spec["folder"])
    make_processor(spec["shape"]).save_pretrained(spec["folder"])
    vision = sum(p.numel() for p in model.model.visual.parameters())
    rec.save(status="ok", parameters=sum(p.numel() for p in model.parameters()), vision_parameters=vision,
             image_tokens=image_tokens(spec["shape"]), transformers=transformers.__version__,
             seconds=round(time.perf_counter() - started, 1))


def run_trl(spec: dict, rec) -> None:
    """TRL 1.16's GRPOTrainer on the folder as grpo_step_worker.run_trl configures it, with the processor as
    processing_class and the rows' `image` column (TRL's VLM path), its weights in `TRL_DTYPE` on a GPU."""
    from datasets import Dataset
    import trl
    from trl import GRPOConfig, GRPOTrainer

    device, run, shape = spec["device"], spec["run"], spec["shape"]
    rec.save(trl=trl.__version__)
    timer = text_bench.trl_step_timer(device, rec)
    dataset = Dataset.from_list(make_rows(shape, run["rows"], run["prompt_len"]))
    bf16 = device == "cuda"
    if not bf16:
        rec.note("CPU: TRL runs with bf16=False")
    options = text_bench.trl_options(run, device, bf16)
    if bf16:
        options["model_init_kwargs"] = {"dtype": TRL_DTYPE}
        rec.note(f"TRL loads the model in {TRL_DTYPE} (its default, float32, needs more than one 80 GB card here)")
    args = GRPOConfig(**options)
    started = time.perf_counter()
    trainer = GRPOTrainer(model=spec["folder"], reward_funcs=[make_reward(run["completion_len"])], args=args,
                          train_dataset=dataset, processing_class=make_processor(shape), callbacks=[timer])
    setup = time.perf_counter() - started
    trainer.train()
    text_bench.trl_finish(rec, timer, setup, started)
    shutil.rmtree(args.output_dir, ignore_errors=True)


def run_cohort(spec: dict, rec) -> None:
    """cohort's GRPOTrainer on the folder, configured as grpo_step_worker.run_cohort (max_prompt_length counts the
    image's tokens), the processor as processing_class."""
    run, shape = spec["run"], spec["shape"]
    processor = make_processor(shape)
    rows = make_rows(shape, run["rows"], run["prompt_len"])
    from cohort_grpo.rollout.images import ImagePrompts

    ids, _ = ImagePrompts(processor).encode(rows[0]["prompt"], [rows[0]["image"]])
    expected = run["prompt_len"] + image_tokens(shape) + 2  # the words, the image tokens and the two tags
    if len(ids) != expected:
        raise RuntimeError(f"a prompt renders to {len(ids)} tokens, not {expected}")
    rec.save(prompt_tokens=len(ids), image_tokens=image_tokens(shape))
    # cohort's max_prompt_length: the whole prompt; the vision tower trains, as TRL's does (cohort's default freezes
    # it: --cohort-variants freeze_vision_tower=true measures that beside)
    options = {"freeze_vision_tower": False, **(spec.get("cohort_options") or {})}
    spec = {**spec, "run": {**run, "prompt_len": len(ids)}, "cohort_options": options}
    rec.save(freeze_vision_tower=options["freeze_vision_tower"])
    config, _ = text_bench.cohort_config(spec, rec)
    started = time.perf_counter()
    trainer = text_bench.bench_trainer(rec)(model=spec["folder"], reward_funcs=[make_reward(run["completion_len"])],
                                            train_dataset=rows, args=config, processing_class=processor)
    text_bench.cohort_train(trainer, spec, rec, config, started)
