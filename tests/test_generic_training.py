"""Training on the generic path (cohort_grpo/models/generic_training.py): per-layer gradient checkpointing, LoRA,
hub ids resolved to their model type, FSDP2 by the model's own decoder layers, and the options the generic path
refuses by name. Tiny random models of transformers' own classes (test_generic_models.py), float32, CPU."""

import copy
import json
import os
import subprocess
import sys

import pytest
import torch

from cohort_grpo.errors import CohortError
from cohort_grpo.models.generic import TransformersCausalLM
from cohort_grpo.models.generic_training import decoder_layer_list, is_mixture_of_experts
from tests.test_generic_models import FAMILIES, VOCAB, reference_model, save_folder

pytestmark = pytest.mark.cpu("float32 gradients and logits of CPU forwards")


def loss_and_grads(model, input_ids):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids)
    loss = torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, input_ids[:, 1:, None]).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model_type", ["olmo2", "gemma3_text", "gpt_neox"])
def test_checkpointing_the_first_layers_leaves_gradients_unchanged(model_type):
    """gradient_checkpointing_layers=N recomputes the first N decoder layers (found without naming the family)
    and keeps the others; the loss and every gradient equal a run without checkpointing."""
    model = TransformersCausalLM.wrap(reference_model(model_type)).train()
    layers = decoder_layer_list(model.decoder)
    assert len(layers) == FAMILIES[model_type][2]["num_hidden_layers"]
    torch.manual_seed(4)
    input_ids = torch.randint(1, VOCAB, (2, 9))
    want_loss, want = loss_and_grads(model, input_ids)
    recomputed = []
    for checkpointed in (0, 1, 3, None):
        model.gradient_checkpointing_enable(checkpointed_layers=checkpointed)
        assert model.checkpointed_layers == (len(layers) if checkpointed is None else checkpointed)
        forwards = []  # each layer's forwards (of its first part): a checkpointed one runs again in the backward
        hooks = [next(layer.children()).register_forward_pre_hook(lambda m, a, i=i: forwards.append(i))
                 for i, layer in enumerate(layers)]
        loss, grads = loss_and_grads(model, input_ids)
        for hook in hooks:
            hook.remove()
        recomputed.append(len(forwards) - len(layers))
        assert torch.equal(loss, want_loss)
        assert grads.keys() == want.keys()
        assert max(float((grads[n] - want[n]).abs().max()) for n in want) <= 1e-6
    assert recomputed[:3] == [0, 1, 3] and recomputed[3] == len(layers)
    with pytest.raises(CohortError, match="not between 0"):
        model.gradient_checkpointing_enable(checkpointed_layers=len(layers) + 1)


@pytest.mark.parametrize("model_type", ["olmo2", "gpt_neox"])
def test_checkpointed_shared_prompt_forward_recomputes_over_the_same_attention_rows(model_type):
    """The update's shared-prompt layout (one flat row, attention rows saying what each token sees) under gradient
    checkpointing: the backward's recomputation attends over the same attention rows as the forward, so the
    gradients equal those of a forward without checkpointing (a recomputation under the model's own causal mask
    over the flat row would save other tensors, or other values)."""
    from cohort_grpo.update.packing import pack_shared_prompts

    micro = pack_shared_prompts([[5, 6, 7, 8], [5, 6, 7, 8], [9, 10]], torch.tensor([[11, 12, 13], [14, 15, 16],
                                [17, 18, 0]]), torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0]]), [0, 1, 2], pad_id=0)
    model = TransformersCausalLM.wrap(reference_model(model_type)).train()

    def grads():
        model.zero_grad(set_to_none=True)
        logits = model(micro.input_ids, micro.position_ids, attention_rows=micro.attention_rows,
                       attention_slots=micro.attention_slots)
        torch.log_softmax(logits.float(), -1)[0, :-1].gather(-1, micro.input_ids[0, 1:, None]).mean().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want = grads()
    model.gradient_checkpointing_enable()
    got = grads()
    assert got.keys() == want.keys()
    assert max(float((got[n] - want[n]).abs().max()) for n in want) <= 1e-6


def first_char_digit(completions, **kwargs):
    return [1.0 if c[:1].isdigit() else 0.0 for c in completions]


def logits_of(model, ids):
    with torch.no_grad():
        out = model(ids)
    return (out if isinstance(out, torch.Tensor) else out.logits).float()


@pytest.mark.parametrize("model_type", ["gemma3_text", "olmo2"])
def test_lora_on_the_generic_path(model_type, tmp_path):
    """LoRA adapters on a transformers model's own projections: only they train; π_ref is the model with them off
    (the untouched base, from its folder); the engine samples with them; the saved folder loads in transformers
    (merged) and in peft (base + adapter) with the trained policy's logits."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from cohort_grpo import GRPOConfig, GRPOTrainer
    from cohort_grpo.models.lora import adapters_disabled
    from cohort_grpo.rollout.sampler import SamplingParams

    folder = save_folder(model_type, tmp_path / "base")
    args = GRPOConfig(num_generations=4, per_device_train_batch_size=8, gradient_accumulation_steps=1,
                      max_completion_length=5, max_steps=2, learning_rate=5e-2, output_dir=str(tmp_path / "run"),
                      quiet=True, seed=0, beta=0.04, use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0)
    prompts = [{"prompt": f"{a}+{b}="} for a in range(1, 9) for b in range(1, 4)]
    trainer = GRPOTrainer(folder, first_char_digit, prompts, args=args)
    assert isinstance(trainer.model, TransformersCausalLM) and trainer.ref_model is None
    adapted = {n.split(".")[-4] for n, _ in trainer.model.named_parameters() if "lora_A" in n}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    base_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" not in n}
    assert all("lora_" in n for n, p in trainer.model.named_parameters() if p.requires_grad)
    trainer.train()
    after = dict(trainer.model.named_parameters())
    assert all(torch.equal(after[n], t) for n, t in base_before.items())
    assert any(p.abs().sum() > 0 for n, p in after.items() if "lora_B" in n)

    ids = torch.tensor([[3, 5, 7, 9, 11, 4]])
    original = AutoModelForCausalLM.from_pretrained(folder).eval()
    policy = logits_of(trainer.model, ids)
    with adapters_disabled(trainer.model):
        assert torch.allclose(logits_of(trainer.model, ids), logits_of(original, ids), atol=1e-5)
    assert not torch.allclose(policy, logits_of(original, ids), atol=1e-3)

    prompt = [3, 5, 7]
    rollout = trainer.sampler.generate([prompt], 1, SamplingParams(max_new_tokens=4, temperature=0.0, pad_token_id=0))
    sequence = list(prompt)
    for _ in range(4):
        sequence.append(int(logits_of(trainer.model, torch.tensor([sequence]))[0, -1].argmax()))
    assert rollout.completion_ids[0].tolist() == sequence[3:]

    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "run")).eval()
    assert torch.allclose(logits_of(merged, ids), policy, atol=1e-5)
    with_adapter = peft.PeftModel.from_pretrained(original, str(tmp_path / "run" / "adapter")).eval()
    assert torch.allclose(logits_of(with_adapter, ids), policy, atol=1e-5)


def hub_cache_entry(cache, repo_id: str, model_type: str) -> None:
    """`repo_id` in a Hugging Face hub cache at `cache`, laid out as huggingface_hub lays it out (refs/main names
    the snapshot), holding a tiny saved model of `model_type` and the built-in tokenizer."""
    commit = "0" * 40
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    save_folder(model_type, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)


def test_hub_ids_of_other_types_take_the_generic_path(tmp_path):
    """A hub id resolves to its model type from its cached config.json (offline: the cache only, no network): a
    type cohort does not implement takes the generic path, a native one cohort's own loader, one not in the cache
    the native loader's one-line error."""
    hub_cache_entry(tmp_path / "hub", "tiny-org/olmo2", "olmo2")
    hub_cache_entry(tmp_path / "hub", "tiny-org/qwen2", "qwen2")
    script = (
        "from cohort_grpo.run.policy import load_policy\n"
        "from cohort_grpo.errors import CohortError\n"
        "for repo in ('tiny-org/olmo2', 'tiny-org/qwen2'):\n"
        "    model, tokenizer = load_policy(repo, log=lambda line: print('line:', line))\n"
        "    print(repo, type(model).__name__, model.config.model_type, tokenizer.eos_token_id is not None)\n"
        "try:\n"
        "    load_policy('tiny-org/absent')\n"
        "except CohortError as error:\n"
        "    print('refused:', error)\n")
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path / "hub"), HF_HOME=str(tmp_path / "home"), HF_HUB_OFFLINE="1",
               PYTHONPATH=os.getcwd())
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert "tiny-org/olmo2 TransformersCausalLM olmo2 True" in lines
    assert "tiny-org/qwen2 CausalLM qwen2 True" in lines
    assert any(line.startswith("line: cohort: olmo2 is not one of cohort's own") for line in lines)
    refused = [line for line in lines if line.startswith("refused:")]
    assert len(refused) == 1 and "'tiny-org/absent'" in refused[0] and "HF_HUB_OFFLINE" in refused[0]


def test_lora_targets_a_family_of_other_names():
    """Without lora_target_modules, a family whose projections are not q_proj/.../down_proj (GPT-NeoX) gets adapters
    on every linear layer of its decoder layers, not on its embedding or head; names matching nothing are refused."""
    pytest.importorskip("peft")
    from types import SimpleNamespace

    from cohort_grpo.models.lora import apply_lora, lora_config_from_args

    options = SimpleNamespace(use_peft=True, lora_r=2, lora_alpha=4, lora_dropout=0.0, lora_target_modules=None)
    model = apply_lora(TransformersCausalLM.wrap(reference_model("gpt_neox")), lora_config_from_args(options))
    adapted = {n.split(".")[-4] for n, _ in model.named_parameters() if "lora_A" in n}
    assert adapted == {"query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"}
    assert sum("lora_A" in n for n, _ in model.named_parameters()) == 4 * 4  # four per layer, four layers
    options.lora_target_modules = ["q_proj"]
    with pytest.raises(CohortError, match="match no module"):
        apply_lora(TransformersCausalLM.wrap(reference_model("gpt_neox")), lora_config_from_args(options))


def test_what_only_cohorts_own_models_do_is_refused_by_name(tmp_path):
    """routing replay (a mixture of experts), rollout_numerics=exact and tensor-parallel sampling are refused in one
    line naming the option when the policy takes the generic path, as it loads; a native model is not refused."""
    import transformers

    from cohort_grpo import GRPOConfig
    from cohort_grpo.run.policy import generic_path_notice, generic_path_refusal, load_run_policy

    def args(**options):
        return GRPOConfig(output_dir=str(tmp_path / "run"), **options)

    folder = save_folder("olmo2", tmp_path / "olmo2")
    cpu = torch.device("cpu")
    for options, named in [(dict(rollout_numerics="exact"), "rollout_numerics=exact"),
                           (dict(rollout_tensor_parallel_size=2, fsdp=True), "rollout_tensor_parallel_size=2")]:
        with pytest.raises(CohortError, match=named) as refused:
            load_run_policy(folder, None, args(**options), cpu)
        assert "olmo2 runs through transformers' modules" in str(refused.value) and "\n" not in str(refused.value)
    model, _, _ = load_run_policy(folder, None, args(rollout_tensor_parallel_size="auto"), cpu)
    assert isinstance(model, TransformersCausalLM)

    config = transformers.OlmoeConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=VOCAB, num_experts=4, num_experts_per_tok=2)
    moe = TransformersCausalLM.wrap(transformers.OlmoeForCausalLM(config).eval())
    assert is_mixture_of_experts(moe.config) and not is_mixture_of_experts(model.config)
    # Routing replay is on by default: on the generic path a mixture of experts trains without it, saying so.
    assert generic_path_refusal(moe, args()) is None
    notice = generic_path_notice(moe, args())
    assert notice.startswith("cohort: olmoe runs through transformers' modules") and "without routing replay" in notice
    assert generic_path_notice(moe, args(routing_replay=False)) is None and generic_path_notice(model, args()) is None

    native_folder = save_folder("qwen2", tmp_path / "qwen2")
    native, _, _ = load_run_policy(native_folder, None, args(rollout_tensor_parallel_size=2, fsdp=True), cpu)
    assert generic_path_refusal(native, args(rollout_numerics="exact")) is None


def test_fsdp_units_are_the_models_own_decoder_layers():
    """FSDP2's units on the generic path are the decoder's repeated layers whatever their class is called
    (GPT-NeoX's `GPTNeoXLayer` is neither *DecoderLayer nor *Block), in a shape-only copy as sharding makes."""
    from cohort_grpo.parallel.sharding import decoder_layers, meta_copy

    for model_type, layer_class in [("gpt_neox", "GPTNeoXLayer"), ("gemma3_text", "Gemma3DecoderLayer")]:
        copy_ = meta_copy(TransformersCausalLM.wrap(reference_model(model_type)))
        layers = decoder_layers(copy_)
        assert [type(layer).__name__ for layer in layers] == [layer_class] * 4
        assert layers[0] is copy_.decoder_layers()[0] and next(layers[0].parameters()).is_meta


REWARD_MODULE = '''
def digit_share(prompts, completions, completion_ids=None, **_):
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) + 0.01 * len(c) for c in completions]
'''


@pytest.mark.slow
def test_olmo2_on_two_ranks_with_fsdp_and_ddp_equals_one_process(tmp_path):
    """`--nproc_per_node 2` (gloo, CPU) with `--fsdp` (FSDP2 by OLMo-2's decoder layers) and without (DDP) trains
    the generic path's OLMo-2 two steps with one process's loss, reward and gradient norm at every step and its
    final weights (float32: ≤ 1e-5, as test_distributed.py asserts for cohort's own models)."""
    from safetensors.torch import load_file

    (tmp_path / "rewardmod.py").write_text(REWARD_MODULE)
    folder = save_folder("olmo2", tmp_path / "olmo2")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.getcwd()]), OMP_NUM_THREADS="1",
               MKL_NUM_THREADS="1", CI="1")
    options = ["--model", folder, "--task", "arithmetic", "--reward_funcs", "rewardmod:digit_share",
               "--num_generations", "4", "--per_device_train_batch_size", "4", "--max_completion_length", "8",
               "--max_prompt_length", "64", "--eval_limit", "5", "--learning_rate", "3e-4", "--beta", "0.04",
               "--num_iterations", "2", "--seed", "3", "--logging_steps", "1", "--device", "cpu", "--quiet",
               "--max_steps", "2"]
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    runs = {"one": ([sys.executable], ["--gradient_accumulation_steps", "4"]),
            "fsdp": (launch, ["--gradient_accumulation_steps", "2", "--fsdp"]),
            "ddp": (launch, ["--gradient_accumulation_steps", "2"])}
    for name, (start, extra) in runs.items():
        done = subprocess.run([*start, "-m", "cohort_grpo", "train", *options, *extra, "--output_dir",
                               str(tmp_path / name)], env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, (name, done.stdout[-2000:], done.stderr[-3000:])
        assert "olmo2 is not one of cohort's own implementations" in done.stdout + done.stderr

    def steps(name):
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return [record for record in map(json.loads, lines) if "loss" in record]

    expected, weights = steps("one"), load_file(tmp_path / "one" / "model.safetensors")
    initial = load_file(tmp_path / "olmo2" / "model.safetensors")
    assert max(float((weights[k] - initial[k]).abs().max()) for k in weights) > 1e-3  # training moved them
    for name in ("fsdp", "ddp"):
        got = steps(name)
        assert [r["step"] for r in got] == [1, 2]
        for mine, theirs in zip(got, expected):
            assert abs(mine["loss"] - theirs["loss"]) <= 1e-5 and abs(mine["reward"] - theirs["reward"]) <= 1e-5
            assert abs(mine["grad_norm"] - theirs["grad_norm"]) <= 1e-4 * max(1.0, theirs["grad_norm"])
        saved = load_file(tmp_path / name / "model.safetensors")
        assert saved.keys() == weights.keys()
        assert max(float((saved[k] - weights[k]).abs().max()) for k in weights) <= 1e-5, name


@pytest.mark.parametrize("model_type", ["granite", "cohere", "gemma3_text"])
def test_a_scaled_head_trains_through_the_fused_head_as_through_its_own_logits(model_type):
    """Granite divides its logits, Cohere multiplies them and this Gemma 3 soft-caps them (at 30): the fused LM-head
    loss and the chunked log-probs (hidden states; the scale folded into the temperature, the cap applied per chunk
    and differentiated through) give the loss and gradients of the policy loss over the logits the model's own
    forward returns, at a sampling temperature."""
    from cohort_grpo.algorithm.loss_spec import LossSpec
    from cohort_grpo.algorithm.objectives import policy_loss
    from cohort_grpo.update.fused_head import micro_batch_policy_loss
    from cohort_grpo.update.logprobs import selected_logprobs, supports_hidden
    from cohort_grpo.update.packing import pack_micro_batch

    model = TransformersCausalLM.wrap(reference_model(model_type)).train()
    assert supports_hidden(model) and (model.lm_head.scale != 1.0 or model.lm_head.softcap is not None)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, VOCAB, (4,), generator=g).tolist() for _ in range(3)]
    completions = torch.randint(1, VOCAB, (3, 5), generator=g)
    mask = torch.ones_like(completions)
    mask[1, 3:] = 0
    micro = pack_micro_batch(prompts, completions, mask, [0, 1, 2], pad_id=0)
    spec = LossSpec(epsilon=0.2, epsilon_high=0.28, beta=0.0, loss_type="grpo", max_completion_length=5)
    advantages, temperature = torch.randn(3, generator=g), 0.7

    def run(path: str):
        model.zero_grad(set_to_none=True)
        if path != "own":  # the fused head, or the chunked log-probs under the plain loss
            loss, _ = micro_batch_policy_loss(model, micro, old_logp=None, ref_logp=None, advantages=advantages,
                                              loss_mask=mask, spec=spec, temperature=temperature,
                                              fused=path == "fused")
        else:  # the model's own logits (its forward applies the scale), one row per completion
            logits = model(micro.input_ids)
            rows, cols = micro.token_rows, micro.token_cols
            token_logp, _ = selected_logprobs(logits[micro.source_rows, micro.source_cols], completions[rows, cols],
                                              temperature)
            logp = torch.zeros(mask.shape).index_put((rows, cols), token_logp)
            loss, _ = policy_loss(logp, None, advantages, mask, spec)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    own_loss, own_grads = run("own")
    assert max(grad.abs().max() for grad in own_grads.values()) > 1e-3  # a gradient to compare at all
    for path in ("fused", "chunked"):
        loss, grads = run(path)
        assert torch.allclose(loss, own_loss, atol=1e-5), path
        assert grads.keys() == own_grads.keys()
        for name, grad in own_grads.items():
            assert torch.allclose(grads[name], grad, atol=1e-5, rtol=1e-4), (path, name)
