"""Vision-language models (cohort_grpo/models/vision_language.py): a tiny random Qwen2.5-VL, Qwen2-VL, Qwen3-VL,
Qwen3-VL-MoE, Qwen3.5 (dense and MoE), Gemma 3, Idefics3, SmolVLM, LLaVA, LLaVA-NeXT and LLaVA-OneVision and their
processor (Mistral 3 with its image processor), built with no download
(float32, CPU), checked against transformers itself: the logits of its own forward with the same images, the tokens
of its own greedy `generate`, the teacher-forced log-probs of the engine's samples."""

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from cohort_grpo.errors import CohortError
from cohort_grpo.models.cache import KVCache
from cohort_grpo.models.tiny_vision import (PATCHES, RECURRENT_FAMILIES, build_vision_model, build_vision_processor,
                                            family_unavailable)
from cohort_grpo.models.vision_language import ImageInputs, VisionLanguageModel
from cohort_grpo.rollout.engine import Engine
from cohort_grpo.rollout.sampler import SamplingParams

pytestmark = pytest.mark.cpu("float32 tolerances of CPU forwards")

# (height, width, seed) of each prompt's random image, and its question; two prompts share a size (the same image
# tokens) and their question, so only their images tell them apart.
IMAGES = [(60, 90, 0), (56, 56, 1), (56, 56, 2), (100, 40, 3)]
QUESTIONS = ["how many? ", "what colour? ", "what colour? ", "count: "]


def random_image(height, width, seed):
    from PIL import Image

    pixels = np.random.RandomState(seed).randint(0, 256, (height, width, 3)).astype("uint8")
    return Image.fromarray(pixels)


def processor_or_skip(family: str):
    """The tiny processor of `family`, or a skip where the installed transformers cannot serve the family
    (`family_unavailable`) or builds its processor only with a package that is not installed (before 5.2x,
    Idefics3's image processor needs torchvision even in its PIL form)."""
    if family_unavailable(family):
        pytest.skip(family_unavailable(family))
    try:
        return build_vision_processor(family=family)
    except ImportError as error:
        pytest.skip(f"{family}'s processor cannot be built here: {str(error).strip().splitlines()[0]}")


@pytest.fixture(scope="module", params=sorted(PATCHES))
def vision(request):
    processor = processor_or_skip(request.param)
    reference = build_vision_model(processor.tokenizer, family=request.param).eval()
    model = VisionLanguageModel.wrap(copy.deepcopy(reference)).eval()
    prompts = []
    for (height, width, seed), question in zip(IMAGES, QUESTIONS):
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompts.append(processor(text=[text], images=[random_image(height, width, seed)], return_tensors="pt"))
    return processor, reference, model, prompts


def image_inputs(encoded) -> ImageInputs:
    return ImageInputs.from_processor(encoded)


def with_completion(encoded, completion: torch.Tensor) -> dict:
    """The processor's inputs of a prompt followed by `completion` [1, n] (text tokens), for transformers' forward."""
    extended = dict(encoded, input_ids=torch.cat([encoded["input_ids"], completion], dim=1))
    extended["attention_mask"] = torch.ones_like(extended["input_ids"])
    for types in ("mm_token_type_ids", "token_type_ids"):  # Qwen-VL's name, Gemma 3's
        if types in encoded:
            extended[types] = torch.cat([encoded[types], torch.zeros_like(completion)], dim=1)
    return extended


def teacher_forced_logits(reference, encoded, completion: torch.Tensor) -> torch.Tensor:
    """transformers' logits over a prompt with its images followed by `completion` [1, n]: one forward, or, where
    the completion holds an image token (a text token there, as `generate` has it; transformers' forward would count
    it as an image's), the prompt's forward and then the completion over its cache, as `generate` runs them."""
    if not bool((completion == reference.config.image_token_id).any()):
        return reference(**with_completion(encoded, completion)).logits
    prompt = reference(**encoded, use_cache=True)
    mask = torch.ones(1, encoded["input_ids"].shape[1] + completion.shape[1], dtype=torch.long)
    # transformers 5.2x names the cache `cache` where earlier 5.x releases named it `past_key_values`
    cache = {"cache": prompt.cache} if hasattr(prompt, "cache") else {"past_key_values": prompt.past_key_values}
    rest = reference(input_ids=completion, attention_mask=mask, use_cache=True, **cache)
    return torch.cat([prompt.logits, rest.logits], dim=1)


def test_logits_equal_transformers_forward(vision):
    """A prompt with its image through the wrapper (no cache, and prefilled into a cache) equals transformers'
    forward with the same pixels; a decode step over the cache equals the full forward's next position."""
    _, reference, model, prompts = vision
    for encoded in prompts:
        ids = encoded["input_ids"]
        with torch.no_grad():
            expected = reference(**encoded).logits
            assert (model(ids, images=[image_inputs(encoded)]) - expected).abs().max() < 1e-4
            cache = KVCache.for_model(model, 1, 64)
            positions = torch.arange(ids.shape[1])[None]
            prefilled = model(ids[:, :-1], positions[:, :-1], kv_cache=cache, images=[image_inputs(encoded)],
                              cache_len=ids.shape[1] - 1)
            assert (prefilled - expected[:, :-1]).abs().max() < 1e-4
            step = model(ids[:, -1:], positions[:, -1:], kv_cache=cache, cache_len=ids.shape[1])
            assert (step[:, 0] - expected[:, -1]).abs().max() < 1e-4


def assert_greedy_up_to_ties(reference, encoded, tokens: list[int], expected: list[int], row: int) -> None:
    """`tokens`, the engine's greedy completion, are greedy under transformers' own forward teacher-forced on them
    (each within 1e-5 of that step's best logit: a tie of the random model, which another machine's float32 sums may
    break the other way), and equal `expected`, transformers' greedy `generate`, up to a step where the two differ and
    the forward ranks generate's token no higher than the engine's (within 1e-5). `generate` is not always its own
    forward's greedy choice: Gemma 3's cached decoding with a sliding window shorter than an image departs from its
    full forward (0.014-0.094 below the best logit with seeds 3, 6, 14 and 15 of the tiny model)."""
    image_token = reference.config.image_token_id  # up to the first one the engine samples: a text token there
    checked = tokens.index(image_token) + 1 if image_token in tokens else len(tokens)
    completion = torch.tensor([tokens[:checked]], dtype=torch.long)
    start = encoded["input_ids"].shape[1] - 1
    with torch.no_grad():
        logits = teacher_forced_logits(reference, encoded, completion[:, :-1])[0, start:]
    below = logits.max(-1).values - logits.gather(1, completion[0, :, None])[:, 0]
    assert float(below.max()) < 1e-5, f"row {row}: the engine's token at step {int(below.argmax())} is " \
                                      f"{float(below.max()):.2e} below the best of transformers' forward"
    if tokens == expected:
        return
    step = next(i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b)
    if step >= checked:  # past an image token the engine sampled: its prefix's forward is generate's own
        with torch.no_grad():
            prefix = torch.tensor([expected[:step]], dtype=torch.long)
            last = teacher_forced_logits(reference, encoded, prefix)[0, -1]
        gap = (last[expected[step]] - last[tokens[step]]).item()
        assert 0 <= gap < 1e-5, f"row {row}: the engine took token {tokens[step]} at step {step}, {gap:.2e} below"
        return
    gap = (logits[step, expected[step]] - logits[step, tokens[step]]).item()
    assert gap < 1e-5, f"row {row}: generate's token at step {step} is {gap:.2e} above the engine's"


def test_engine_greedy_tokens_equal_generate(vision):
    """Continuous batching (more prompts than rows, compaction): each prompt's greedy completion in the engine is
    transformers' `generate`'s with the same image, including the two prompts whose tokens are the same."""
    processor, reference, model, prompts = vision
    assert prompts[1]["input_ids"].tolist() == prompts[2]["input_ids"].tolist()
    new_tokens = 12
    pad = processor.tokenizer.pad_token_id
    rollout = Engine(model, max_batch_size=3, check_interval=4).generate(
        [p["input_ids"][0].tolist() for p in prompts], 1,
        SamplingParams(max_new_tokens=new_tokens, temperature=0.0, pad_token_id=pad),
        images=[image_inputs(p) for p in prompts])
    generated = []
    for row, encoded in enumerate(prompts):
        with torch.no_grad():
            out = reference.generate(**encoded, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                     do_sample=False)
        expected = out[0, encoded["input_ids"].shape[1]:].tolist()
        assert_greedy_up_to_ties(reference, encoded, rollout.completion_ids[row].tolist(), expected, row)
        generated.append(expected)
    assert generated[1] != generated[2]  # the images, not the tokens, made them differ


def test_group_shares_one_prefill_and_logprobs_are_teacher_forced(vision):
    """G completions of a prompt share its prefill (the vision tower runs once per prompt), and their sampled
    log-probs equal transformers' teacher-forced forward over prompt + completion with the image."""
    processor, reference, model, prompts = vision
    calls = []
    hook = model.vision_tower.register_forward_hook(lambda *args: calls.append(1))
    try:
        engine = Engine(model, max_batch_size=8, check_interval=3)
        rollout = engine.generate([p["input_ids"][0].tolist() for p in prompts[:2]], 3,
                                  SamplingParams(max_new_tokens=6, temperature=1.0, seed=5,
                                                 pad_token_id=processor.tokenizer.pad_token_id),
                                  images=[image_inputs(p) for p in prompts[:2]])
    finally:
        hook.remove()
    assert len(calls) == 2 and engine.stats["prefill_shared_rows"] == 4
    worst = 0.0
    for row in range(6):
        prompt_length = prompts[row // 3]["input_ids"].shape[1]
        completion = rollout.completion_ids[row]
        with torch.no_grad():
            logits = teacher_forced_logits(reference, prompts[row // 3], completion[None])[0, prompt_length - 1: -1]
        logp = torch.log_softmax(logits, dim=-1).gather(1, completion[:, None])[:, 0]
        worst = max(worst, float((logp - rollout.logprobs[row]).abs().max()))
    assert worst < 1e-4


def test_refusals_name_what_is_not_supported(vision):
    """Images with tool turns, images for a text model, a prompt short of image tokens, and other vision-language
    families are one-line errors that say what to do."""
    processor, _, model, prompts = vision
    ids = prompts[0]["input_ids"]
    params = SamplingParams(max_new_tokens=2, temperature=0.0, pad_token_id=0)
    with pytest.raises(CohortError, match="tool turns with images"):
        Engine(model).generate([ids[0].tolist()], 1, params, turns=object(), images=[image_inputs(prompts[0])])
    with pytest.raises(CohortError, match="image tokens where its images fill"):
        model(ids[:, 4:], images=[image_inputs(prompts[0])])
    rows = torch.arange(ids.shape[1])[None]
    flat = "keep a recurrent state" if model.model_type in RECURRENT_FAMILIES else "no kv_cache or attention_mask"
    with pytest.raises(CohortError, match=flat):
        model(ids, rows, kv_cache=KVCache.for_model(model, 1, 64), attention_rows=rows,
              attention_slots=rows[0], images=[image_inputs(prompts[0])])
    other = SimpleNamespace(config=SimpleNamespace(model_type="mllama", vision_config={}))
    with pytest.raises(CohortError, match="mllama is a vision-language family cohort does not serve yet.*SmolVLM"):
        VisionLanguageModel.wrap(other)


def test_update_logprobs_equal_transformers_with_the_images(vision):
    """The update's log-probs (one padded row per completion, the images given with their rows) equal transformers'
    teacher-forced forward with the same pixels; the vision tower runs once per distinct prompt in a forward; with the
    tower frozen its weights get no gradient while the language tower's do."""
    from cohort_grpo.rollout.layout import PADDED
    from cohort_grpo.update.logprobs import rollout_logprobs

    processor, reference, model, prompts = vision
    torch.manual_seed(4)
    chosen = [prompts[0], prompts[0], prompts[3], prompts[3]]
    images = [image_inputs(prompts[0])] * 2 + [image_inputs(prompts[3])] * 2
    completions = torch.randint(5, 60, (4, 5))
    mask = torch.ones_like(completions)
    mask[1, 3:] = 0
    prompt_ids = [p["input_ids"][0].tolist() for p in chosen]
    calls = []
    hook = model.vision_tower.register_forward_hook(lambda *args: calls.append(1))
    try:
        logp = rollout_logprobs(model, prompt_ids, completions, mask, pad_id=0, max_rows=4, layout=PADDED,
                                images=images)
    finally:
        hook.remove()
    assert len(calls) == 2
    for row, encoded in enumerate(chosen):
        with torch.no_grad():
            logits = teacher_forced_logits(reference, encoded, completions[row: row + 1])
        logits = logits[0, len(prompt_ids[row]) - 1: -1]
        expected = torch.log_softmax(logits, -1).gather(1, completions[row][:, None])[:, 0] * mask[row]
        assert (logp[row] - expected).abs().max() < 1e-4
    trained = copy.deepcopy(model)
    trained.freeze_vision_tower()
    ids = torch.cat([chosen[0]["input_ids"], completions[:1]], dim=1)
    trained(ids, images=[image_inputs(chosen[0])]).logsumexp(-1).sum().backward()
    assert all(p.grad is None for p in trained.vision_parameters())
    assert trained.transformers_model.lm_head.weight.grad is not None


def shared_prompt_rollout(processor, model, prompts):
    """Two completions each of: two prompts of the same tokens and different images, another prompt, and a text prompt
    (no images); one completion samples an image token (a text token there), one is cut short."""
    text = processor.tokenizer("no picture: ")["input_ids"]
    chosen = [1, 1, 2, 2, 3, 3, None, None]
    prompt_ids = [text if p is None else prompts[p]["input_ids"][0].tolist() for p in chosen]
    images = [None if p is None else image_inputs(prompts[p]) for p in chosen]
    images = [images[0], images[0], images[2], images[2], images[4], images[4], None, None]  # one object a prompt
    torch.manual_seed(5)
    completions = torch.randint(5, 60, (len(chosen), 6))
    completions[2, 1] = model.image_token_id
    mask = torch.ones_like(completions)
    mask[3, 2:] = 0
    return prompt_ids, images, completions, mask


def test_shared_prompt_layout_equals_the_padded_one(vision):
    """The shared-prompt layout (each prompt once in a flat row, its images encoded once and merged at its image
    tokens; Qwen-VL's multimodal positions, Gemma 3's two-way image attention) gives the padded layout's log-probs,
    and the same loss and gradients through both towers (float32: ≤ 1e-5); prompts of the same tokens with other
    images stay two prompts."""
    from cohort_grpo.rollout.layout import PADDED, Layout
    from cohort_grpo.update.logprobs import micro_batch_logprobs, rollout_logprobs
    from cohort_grpo.update.packing import pack

    processor, _, model, prompts = vision
    if model.model_type in RECURRENT_FAMILIES:
        pytest.skip("a recurrent language tower takes one padded row per completion: "
                    "test_a_recurrent_language_tower_takes_the_padded_layout")
    prompt_ids, images, completions, mask = shared_prompt_rollout(processor, model, prompts)
    shared = Layout(shared=True, group=2)
    calls = []
    hook = model.vision_tower.register_forward_hook(lambda *args: calls.append(1))
    try:
        packed = rollout_logprobs(model, prompt_ids, completions, mask, pad_id=0, max_rows=8, layout=shared,
                                  images=images)
    finally:
        hook.remove()
    assert len(calls) == 3  # one per distinct prompt with images, in one forward
    padded = rollout_logprobs(model, prompt_ids, completions, mask, pad_id=0, max_rows=8, layout=PADDED,
                              images=images)
    assert (packed - padded).abs().max() <= 1e-5 and padded.abs().sum() > 0
    trained = copy.deepcopy(model)
    trained.freeze_vision_tower(False)
    weights = torch.linspace(-1.0, 1.0, completions.numel()).view(completions.shape)
    losses, grads = [], []
    for layout in (PADDED, shared):
        trained.zero_grad()
        micro = pack(prompt_ids, completions, mask, list(range(len(prompt_ids))), 0, layout, images=images)
        assert (micro.attention_rows is not None) == layout.shared
        loss = (micro_batch_logprobs(trained, micro).logp * weights).sum()
        loss.backward()
        losses.append(float(loss.detach()))
        grads.append({name: p.grad.clone() for name, p in trained.named_parameters() if p.grad is not None})
    assert abs(losses[0] - losses[1]) <= 1e-5
    vision = {id(p) for p in trained.vision_parameters()}
    assert grads[0].keys() == grads[1].keys() and any(id(p) in vision for n, p in trained.named_parameters()
                                                      if n in grads[0])
    assert max(float((grads[0][n] - grads[1][n]).abs().max()) for n in grads[0]) <= 1e-5


def test_a_recurrent_language_tower_takes_the_padded_layout(vision):
    """Qwen3.5's Gated DeltaNet layers would run a flat row's state through the other completions' tokens: the
    update's layout is one padded row per completion (as for its text-only models), a shared-prompt forward is
    refused by name, and the padded log-probs of prompts of other lengths with their images are the full forward's
    of each row alone."""
    from cohort_grpo.rollout.layout import PADDED, Layout
    from cohort_grpo.update.logprobs import rollout_logprobs, takes_attention_rows

    processor, _, model, prompts = vision
    if model.model_type not in RECURRENT_FAMILIES:
        pytest.skip("its language tower keeps no recurrent state: test_shared_prompt_layout_equals_the_padded_one")
    assert not takes_attention_rows(model) and not Layout.choose(True, 2, takes_attention_rows(model)).shared
    prompt_ids, images, completions, mask = shared_prompt_rollout(processor, model, prompts)
    with pytest.raises(CohortError, match="keep a recurrent state"):
        rollout_logprobs(model, prompt_ids, completions, mask, pad_id=0, max_rows=8,
                         layout=Layout(shared=True, group=2), images=images)
    padded = rollout_logprobs(model, prompt_ids, completions, mask, pad_id=0, max_rows=8, layout=PADDED, images=images)
    for row in (0, 4, 6):  # prompts of three lengths, the last without images
        ids = torch.cat([torch.tensor([prompt_ids[row]]), completions[row: row + 1]], dim=1)
        with torch.no_grad():
            logits = model(ids, images=[images[row]])[0, len(prompt_ids[row]) - 1: -1]
        alone = torch.log_softmax(logits, -1).gather(1, completions[row][:, None])[:, 0] * mask[row]
        assert (padded[row] - alone).abs().max() < 1e-5


def test_qwen3_5_is_refused_by_name_without_the_state_interface(monkeypatch):
    """Below transformers 5.21 the Gated DeltaNet layers keep their states in their own fields, which the engine's
    rows cannot: wrapping a Qwen3.5 vision-language model says so in one line (a later transformers made to look
    like one without the state interface)."""
    import transformers

    from cohort_grpo.models import generic_attention

    if not hasattr(transformers, "Qwen3_5ForConditionalGeneration"):
        pytest.skip(f"transformers {transformers.__version__} has no Qwen3.5")
    processor = build_vision_processor(family="qwen3_5")
    model = build_vision_model(processor.tokenizer, family="qwen3_5")
    monkeypatch.setattr(generic_attention, "has_state_interface", lambda: False)
    with pytest.raises(CohortError, match=r"recurrent layers .* 5\.21 and later .*: upgrade transformers"):
        VisionLanguageModel.wrap(model)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: decode steps as captured CUDA graphs")
def test_cuda_graph_decode_reads_each_rows_rope_delta(vision):
    """On a GPU the decode steps are captured CUDA graphs (checked against an eager step) that read each row's rope
    delta from the cache: the greedy tokens stay transformers' own, prompt by prompt, with continuous batching."""
    processor, reference, model, prompts = vision
    reference, model = copy.deepcopy(reference).cuda(), copy.deepcopy(model).cuda()
    new_tokens = 12
    engine = Engine(model, max_batch_size=2, check_interval=4, verify_graphs=True)
    rollout = engine.generate([p["input_ids"][0].tolist() for p in prompts], 1,
                              SamplingParams(max_new_tokens=new_tokens, temperature=0.0,
                                             pad_token_id=processor.tokenizer.pad_token_id),
                              images=[image_inputs(p).to("cuda") for p in prompts])
    for row, encoded in enumerate(prompts):
        with torch.no_grad():
            out = reference.generate(**{k: v.cuda() for k, v in encoded.items()}, max_new_tokens=new_tokens,
                                     min_new_tokens=new_tokens, do_sample=False)
        assert rollout.completion_ids[row].tolist() == out[0, encoded["input_ids"].shape[1]:].tolist(), row


def test_a_frozen_tower_runs_once_per_prompt_across_sampling_and_the_update(vision):
    """With the vision tower frozen, a prompt's image features are computed at its prefill and kept with its images:
    the log-prob pass after sampling reuses them (same log-probs as a fresh computation); a trainable tower
    computes them afresh in every forward."""
    from cohort_grpo.update.logprobs import rollout_logprobs

    processor, _, model, prompts = vision
    frozen = copy.deepcopy(model)
    frozen.freeze_vision_tower()
    calls = []
    hook = frozen.vision_tower.register_forward_hook(lambda *args: calls.append(1))
    images = [image_inputs(p) for p in prompts[:2]]
    ids = [p["input_ids"][0].tolist() for p in prompts[:2]]
    try:
        rollout = Engine(frozen, max_batch_size=4).generate(
            ids, 2, SamplingParams(max_new_tokens=5, temperature=1.0, seed=1,
                                   pad_token_id=processor.tokenizer.pad_token_id), images=images)
        rows = [i for i in images for _ in range(2)]
        reused = rollout_logprobs(frozen, [p for p in ids for _ in range(2)], rollout.completion_ids,
                                  rollout.completion_mask, pad_id=0, max_rows=4, images=rows)
    finally:
        hook.remove()
    assert len(calls) == 2
    fresh = rollout_logprobs(model, [p for p in ids for _ in range(2)], rollout.completion_ids,
                             rollout.completion_mask, pad_id=0, max_rows=4,
                             images=[image_inputs(p) for p in prompts[:2] for _ in range(2)])
    assert (reused - fresh).abs().max() < 1e-5
    assert (reused - rollout.logprobs).abs().max() < 1e-4


def test_gemma3_image_tokens_see_their_whole_image():
    """Gemma 3's image tokens attend to every token of their own image in both directions, and causally to the rest
    (within a sliding layer's window, shorter here than an image): a prompt with two images equals transformers'
    forward with its token types, without the cache and prefilled into it, and the engine's greedy tokens equal
    `generate`'s. transformers' causal forward over the same tokens differs, so the mask is what is tested."""
    processor = build_vision_processor(family="gemma3")
    reference = build_vision_model(processor.tokenizer, family="gemma3").eval()
    model = VisionLanguageModel.wrap(copy.deepcopy(reference)).eval()
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and "}, {"type": "image"},
                                             {"type": "text", "text": "same? "}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    encoded = processor(text=[text], images=[random_image(60, 90, 7), random_image(40, 40, 8)], return_tensors="pt")
    ids, images = encoded["input_ids"], [image_inputs(encoded)]
    assert encoded["token_type_ids"].sum() == 2 * model.transformers_model.config.mm_tokens_per_image
    positions = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        expected = reference(**encoded).logits
        causal = reference(**{k: v for k, v in encoded.items() if k != "token_type_ids"}).logits
        assert (causal - expected).abs().max() > 1e-2
        assert (model(ids, images=images) - expected).abs().max() < 1e-4
        cache = KVCache.for_model(model, 1, 64)
        prefilled = model(ids, positions, kv_cache=cache, images=images, cache_len=ids.shape[1])
        assert (prefilled - expected).abs().max() < 1e-4
        out = reference.generate(**encoded, max_new_tokens=10, min_new_tokens=10, do_sample=False)
    rollout = Engine(model, max_batch_size=2).generate(
        [ids[0].tolist()], 2, SamplingParams(max_new_tokens=10, temperature=0.0,
                                             pad_token_id=processor.tokenizer.pad_token_id), images=images)
    for row in range(2):
        assert rollout.completion_ids[row].tolist() == out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("family", ["mistral3", "llava"])
def test_pixtral_towers_take_each_images_own_size(family):
    """Mistral 3, and LLaVA over a Pixtral tower, take images of their own size (`image_sizes` beside the padded
    pixels): a prompt with two images of different shapes equals transformers' forward without the cache and
    prefilled into it, a decode step its next position, and the engine's greedy tokens `generate`'s. (Their
    processor, transformers' PixtralProcessor, needs torchvision: the pixels are its image processor's, the
    image tokens laid out as it lays them.)"""
    from transformers import PixtralImageProcessorPil

    from cohort_grpo.models.tiny_vision import (MISTRAL3_LONGEST, PIXTRAL_PATCH, build_plain_model,
                                                pixtral_image_tokens, pixtral_tokenizer)

    tokenizer = pixtral_tokenizer()
    reference = build_plain_model(tokenizer, family, pixtral_tower=True).eval()
    model = VisionLanguageModel.wrap(copy.deepcopy(reference)).eval()
    merged = PIXTRAL_PATCH * getattr(reference.config, "spatial_merge_size", 1)
    pixels = PixtralImageProcessorPil(size={"longest_edge": MISTRAL3_LONGEST},
                                      patch_size={"height": merged, "width": merged})(
        [random_image(60, 90, 0), random_image(100, 40, 1)], return_tensors="pt")
    assert pixels["image_sizes"][0].tolist() != pixels["image_sizes"][1].tolist()
    first, second = pixtral_image_tokens(tokenizer, pixels["image_sizes"], merged)
    text = tokenizer("and ")["input_ids"], tokenizer("same? \n")["input_ids"]
    ids = torch.tensor([first + text[0] + second + text[1]])
    encoded = dict(input_ids=ids, attention_mask=torch.ones_like(ids), **pixels)
    images = [image_inputs(encoded)]
    assert model.image_token_count(images[0]) == int((ids == reference.config.image_token_id).sum())
    positions = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        expected = reference(**encoded).logits
        assert (model(ids, images=images) - expected).abs().max() < 1e-4
        cache = KVCache.for_model(model, 1, 128)
        prefilled = model(ids[:, :-1], positions[:, :-1], kv_cache=cache, images=images, cache_len=ids.shape[1] - 1)
        assert (prefilled - expected[:, :-1]).abs().max() < 1e-4
        step = model(ids[:, -1:], positions[:, -1:], kv_cache=cache, cache_len=ids.shape[1])
        assert (step[:, 0] - expected[:, -1]).abs().max() < 1e-4
        out = reference.generate(**encoded, max_new_tokens=10, min_new_tokens=10, do_sample=False)
    rollout = Engine(model, max_batch_size=2).generate(
        [ids[0].tolist()], 2, SamplingParams(max_new_tokens=10, temperature=0.0, pad_token_id=tokenizer.pad_token_id),
        images=images)
    for row in range(2):
        assert_greedy_up_to_ties(reference, encoded, rollout.completion_ids[row].tolist(),
                                 out[0, ids.shape[1]:].tolist(), row)


@pytest.mark.parametrize("family", ["llava_next", "llava_onevision"])
def test_anyres_image_tokens_follow_the_models_unpadding(family):
    """LLaVA-NeXT's and LLaVA-OneVision's image token count (tiles, unpadded grid, a newline per row; OneVision's
    grid shrunk past its aspect ratio, a prompt of several images untiled) equals the tokens the processor inserts and
    the rows transformers' vision tower gives, over images of many shapes; a prompt of two images of different
    shapes equals transformers' forward."""
    processor = processor_or_skip(family)
    reference = build_vision_model(processor.tokenizer, family=family).eval()
    model = VisionLanguageModel.wrap(copy.deepcopy(reference)).eval()
    shapes = [[(20, 200)], [(200, 20)], [(31, 33)], [(14, 14)], [(90, 60)], [(57, 29)], [(60, 90), (100, 40)]]
    counts = set()
    for seed, sizes in enumerate(shapes):
        content = [{"type": "image"}] * len(sizes) + [{"type": "text", "text": "same? "}]
        text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                             tokenize=False)
        encoded = processor(text=[text], images=[[random_image(h, w, seed) for h, w in sizes]], return_tensors="pt")
        images = image_inputs(encoded)
        inserted = int((encoded["input_ids"] == reference.config.image_token_id).sum())
        with torch.no_grad():
            rows = sum(part.shape[0] for part in reference.model.get_image_features(
                encoded["pixel_values"], **images.extra_tensors).pooler_output)
        assert model.image_token_count(images) == inserted == rows
        counts.add(inserted)
        if len(sizes) > 1:
            with torch.no_grad():
                expected = reference(**encoded).logits
                assert (model(encoded["input_ids"], images=[images]) - expected).abs().max() < 1e-4
    assert len(counts) >= 4
