"""The learned reward model r_φ: replay buffer, mixing ratio, online accuracy, checkpoints, wiring."""

import math
import random
from collections import Counter

import pytest
import torch

import dataclasses

from cohort_grpo import GRPOConfig, GRPOTrainer
from cohort_grpo.config.settings import RewardModelSettings
from cohort_grpo.errors import CohortError
from cohort_grpo.models import CausalLM, ModelConfig
from cohort_grpo.rewards.model import RewardModelReward, prepare_reward_funcs
from cohort_grpo.rewards.replay import MixedBatches, ReplayBuffer, Sample, within_group_pairs
from cohort_grpo.rewards.runner import RewardRunner
from cohort_grpo.rewards.scorers import CausalLMScorer
from cohort_grpo.tasks.arithmetic import ArithmeticTask
from cohort_grpo.models.tiny import build_model, build_tokenizer

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def tiny_backbone(tokenizer, seed=0, hidden=32) -> CausalLM:
    torch.manual_seed(seed)
    config = ModelConfig(model_type="llama", vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                         max_position_embeddings=128, tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id)
    return CausalLM(config)


def samples(n, group=0, label=1.0, tag="s"):
    return [Sample(f"{tag}{i}", "", label, group + i) for i in range(n)]


def parity_batch(rng, groups=4, size=4):
    """A step of `groups` prompts × `size` completions; label: the answer's first digit is even."""
    prompts, completions = [], []
    for _ in range(groups):
        prompt = f"{rng.randint(10, 99)}+{rng.randint(10, 99)}=? Reply <answer>N</answer>\n"
        for _ in range(size):
            prompts.append(prompt)
            completions.append(f"<answer>{rng.randint(10, 99)}</answer>")  # first digit: 4 of 9 even
    return prompts, completions


def parity_label(prompts, completions, completion_ids=None, **_):
    return [1.0 if int(c[len("<answer>")]) % 2 == 0 else 0.0 for c in completions]


# ---- replay buffer -----------------------------------------------------------------------------

def test_fifo_buffer_is_bounded_and_keeps_the_newest_in_order():
    buffer = ReplayBuffer(10, "fifo")
    stream = samples(25)
    for start in range(0, 25, 7):
        buffer.add(stream[start:start + 7])
        assert len(buffer) == min(10, start + 7)
    assert buffer.items == stream[-10:]


def test_reservoir_buffer_is_bounded_and_uniform_over_everything_seen():
    inclusions = Counter()
    trials = 2000
    for seed in range(trials):
        buffer = ReplayBuffer(5, "reservoir", seed=seed)
        buffer.add(samples(20))
        assert len(buffer) == 5 and len(set(buffer.items)) == 5
        inclusions.update(s.prompt for s in buffer.items)
    # Algorithm R keeps each of 20 samples with probability 5/20; 4 standard errors ≈ 0.039
    for i in range(20):
        assert abs(inclusions[f"s{i}"] / trials - 0.25) < 0.045, (i, inclusions[f"s{i}"])


@pytest.mark.parametrize("batch_size,ratio", [(32, 0.25), (10, 0.5), (7, 0.3), (16, 0.0)])
def test_mixed_batches_hold_the_replay_ratio_exactly(batch_size, ratio):
    fresh = [("fresh", i) for i in range(64)]
    replayed = [("old", i) for i in range(500)]
    batches = MixedBatches(fresh, replayed, batch_size, ratio, random.Random(0))
    want_replayed = round(ratio * batch_size)
    fresh_counts, old_counts = Counter(), Counter()
    draws = 64 * 40  # a multiple of the fresh pool: each fresh unit is walked the same number of times
    for _ in range(draws):
        new, old = batches.next()
        assert len(new) == batch_size - want_replayed and len(old) == want_replayed
        assert all(u[0] == "fresh" for u in new) and all(u[0] == "old" for u in old)
        assert len(set(old)) == len(old)  # without replacement within a batch
        fresh_counts.update(new)
        old_counts.update(old)
    assert set(fresh_counts.values()) == {draws * (batch_size - want_replayed) // 64}
    if want_replayed:  # replayed units uniform over the buffer: every one drawn, none wildly often
        expected = draws * want_replayed / 500
        assert len(old_counts) == 500
        assert max(old_counts.values()) < expected + 6 * math.sqrt(expected)


def test_mixed_batches_when_a_pool_is_empty_or_small():
    rng = random.Random(0)
    only_fresh = MixedBatches([1, 2, 3], [], 8, 0.5, rng).next()
    assert len(only_fresh[0]) == 8 and only_fresh[1] == []  # first step: nothing to replay
    only_old = MixedBatches([], [1, 2, 3], 8, 0.5, rng).next()
    assert only_old[0] == [] and len(only_old[1]) == 8
    small = MixedBatches([1, 2], [7, 8, 9], 10, 0.5, rng).next()  # pools smaller than their shares
    assert len(small[0]) == 5 and len(small[1]) == 5 and set(small[1]) <= {7, 8, 9}
    assert not MixedBatches([], [], 8, 0.5, rng)


def test_within_group_pairs_never_cross_groups():
    items = [Sample("p", "a", 1.0, 0), Sample("p", "b", 0.0, 0), Sample("p", "c", 0.0, 0),
             Sample("q", "d", 1.0, 1), Sample("q", "e", 1.0, 1), Sample("r", "f", 0.0, 2)]
    assert sorted(within_group_pairs(items)) == [(0, 1), (0, 2)]


# ---- the reward model as a reward function and its online training --------------------------------

def make_rm(tokenizer, seed=0, label_fn=parity_label, **settings):
    settings = RewardModelSettings(**{"updates_per_step": 4, "batch_size": 16, "learning_rate": 3e-3, **settings})
    return RewardModelReward(tiny_backbone(tokenizer, seed), tokenizer, settings, label_fn=label_fn, seed=seed)


def test_hook_mixes_fresh_and_replayed_samples_at_the_ratio(tokenizer):
    rm = make_rm(tokenizer, replay_ratio=0.25, batch_size=8, updates_per_step=3, buffer_size=24)
    seen = []
    update = rm.update
    rm.update = lambda units: seen.append([u.group for u in units]) or update(units)
    rng = random.Random(1)
    for step in range(4):
        prompts, completions = parity_batch(rng)
        metrics = rm.on_step_end(prompts, completions, group_size=4, step=step + 1)
        first_fresh_group = 4 * step  # groups are numbered over the run: this step's are 4·step … 4·step+3
        for groups in seen[-3:]:
            replayed = sum(g < first_fresh_group for g in groups)
            assert replayed == (0 if step == 0 else 2)  # round(0.25 · 8); nothing to replay at step 1
        assert len(rm.buffer) == min(24, 16 * (step + 1)) and metrics["rm/buffer_size"] == len(rm.buffer)
        assert metrics["rm/replayed_fraction"] == (0 if step == 0 else 0.25)
    assert [s.group for s in rm.buffer.items] == sorted(s.group for s in rm.buffer.items)  # FIFO: newest 24
    assert rm.buffer.items[0].group == 10


def test_online_accuracy_is_measured_before_training_on_the_fresh_samples(tokenizer):
    # A zero head scores every text 0 (P = 0.5, predicted "wrong"); with every label 1 it is wrong on all.
    rm = make_rm(tokenizer, label_fn=lambda prompts, completions, **_: [1.0] * len(completions),
                 updates_per_step=10, learning_rate=1e-2)
    prompts, completions = parity_batch(random.Random(0))
    texts = [p + c for p, c in zip(prompts, completions)]
    before = rm.logits(texts)
    assert torch.all(before == 0)
    metrics = rm.on_step_end(prompts, completions, group_size=4)
    assert metrics["rm/online_accuracy"] == 0.0
    assert metrics["rm/loss"] == pytest.approx(math.log(2), abs=1e-6)  # BCE(σ(0), 1) = log 2
    assert "rm/pair_accuracy" not in metrics  # equal labels form no pairs
    after = rm.logits(texts)
    assert float((after > 0).float().mean()) == 1.0  # it did learn, so the 0.0 above came before
    second = rm.on_step_end(prompts, completions, group_size=4)
    assert second["rm/online_accuracy"] == 1.0


def test_pairwise_online_accuracy_and_loss_are_computed_from_within_group_pairs(tokenizer):
    rm = make_rm(tokenizer, loss="pairwise")
    prompts, completions = parity_batch(random.Random(3))
    labels = parity_label(prompts, completions)
    logits = rm.logits([p + c for p, c in zip(prompts, completions)])
    metrics = rm.on_step_end(prompts, completions, group_size=4)
    pairs = [(a, b) for g in range(4) for a in range(4 * g, 4 * g + 4) for b in range(4 * g, 4 * g + 4)
             if labels[a] > labels[b]]
    assert pairs
    assert metrics["rm/online_accuracy"] == 0.5  # the zero head ties every pair
    margins = torch.stack([logits[a] - logits[b] for a, b in pairs])
    assert metrics["rm/loss"] == pytest.approx(float(-torch.nn.functional.logsigmoid(margins).mean()), abs=1e-6)
    assert "rm/train_loss" in metrics


def test_reward_model_learns_a_toy_labelling_above_chance(tokenizer):
    rm = make_rm(tokenizer, seed=1, updates_per_step=4, batch_size=32, learning_rate=3e-3, replay_ratio=0.5)
    rng = random.Random(2)
    accuracies = [rm.on_step_end(*parity_batch(rng, groups=8), group_size=4)["rm/online_accuracy"]
                  for _ in range(30)]
    prompts, completions = parity_batch(random.Random(99), groups=16)
    held_out = rm.logits([p + c for p, c in zip(prompts, completions)]) > 0
    truth = torch.tensor(parity_label(prompts, completions)) == 1
    assert float((held_out == truth).float().mean()) > 0.8  # chance is 0.5
    assert sum(accuracies[-5:]) / 5 > 0.8 and sum(accuracies[:2]) / 2 < 0.7


def test_label_fraction_labels_only_that_share_of_groups(tokenizer):
    calls = []

    def counting_label(prompts, completions, **columns):
        calls.append((len(completions), list(columns["solution"])))
        return parity_label(prompts, completions)

    rm = make_rm(tokenizer, label_fn=counting_label, label_fraction=0.25, updates_per_step=1)
    prompts, completions = parity_batch(random.Random(0), groups=8)
    solution = [str(i // 4) for i in range(32)]  # a dataset column: it must follow the chosen rows
    metrics = rm.on_step_end(prompts, completions, group_size=4, solution=solution)
    (count, chosen), = calls
    assert count == 8 and metrics["rm/labelled"] == 8 and len(rm.buffer) == 8
    assert chosen == [chosen[0]] * 4 + [chosen[4]] * 4 and chosen[0] < chosen[4]  # two whole groups, in order
    assert {s.group for s in rm.buffer.items} == {int(x) for x in chosen}


def test_train_steps_freezes_the_model_after_k_steps(tokenizer):
    rm = make_rm(tokenizer, train_steps=2, updates_per_step=2)
    rng = random.Random(0)
    for _ in range(2):
        assert "rm/train_loss" in rm.on_step_end(*parity_batch(rng), group_size=4)
    frozen = {k: v.clone() for k, v in rm.model.state_dict().items()}
    metrics = rm.on_step_end(*parity_batch(rng), group_size=4)
    assert "rm/online_accuracy" in metrics and "rm/train_loss" not in metrics and len(rm.buffer) == 32
    assert all(torch.equal(frozen[k], v) for k, v in rm.model.state_dict().items())


def test_checkpoint_round_trips_weights_optimizer_buffer_and_rng_exactly(tokenizer, tmp_path):
    rng = random.Random(5)
    steps = [parity_batch(rng) for _ in range(4)]
    rm = make_rm(tokenizer, buffer_size=20, buffer_policy="reservoir", seed=3)
    for prompts, completions in steps[:3]:
        rm.on_step_end(prompts, completions, group_size=4)
    torch.save(rm.state_dict(), tmp_path / "rm.pt")
    state = torch.load(tmp_path / "rm.pt", weights_only=True)  # plain tensors and Python data only
    restored = make_rm(tokenizer, buffer_size=20, buffer_policy="reservoir", seed=11)  # other weights, other RNG
    restored.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(rm.model.state_dict().values(), restored.model.state_dict().values()))
    assert restored.buffer.items == rm.buffer.items and restored.buffer.seen == rm.buffer.seen == 48
    assert restored.rng.getstate() == rm.rng.getstate() and restored.buffer.rng.getstate() == rm.buffer.rng.getstate()
    a, b = rm.optimizer.state_dict()["state"], restored.optimizer.state_dict()["state"]
    assert a.keys() == b.keys() and all(torch.equal(a[k][n], b[k][n]) for k in a for n in a[k])
    # Resuming gives exactly what running on would have: same metrics, same weights, same buffer.
    prompts, completions = steps[3]
    assert rm.on_step_end(prompts, completions, group_size=4) == restored.on_step_end(prompts, completions, group_size=4)
    assert all(torch.equal(a, b) for a, b in zip(rm.model.state_dict().values(), restored.model.state_dict().values()))
    assert restored.buffer.items == rm.buffer.items


# ---- loading, saving and the trainer ---------------------------------------------------------------

def test_saved_reward_model_is_a_transformers_sequence_classifier(tokenizer, tmp_path):
    from transformers import AutoModelForSequenceClassification

    rm = make_rm(tokenizer)
    with torch.no_grad():
        rm.model.score.weight.normal_()  # a head that tells texts apart
    rm.save_pretrained(tmp_path / "rm")
    texts = ["12+34=? Reply <answer>N</answer>\n<answer>46</answer>", "1+1=? <answer>3</answer>", "9"]
    ours = rm.logits(texts)
    hf = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm").eval()
    reloaded_hf = RewardModelReward(hf, tokenizer)  # a transformers object in place of ours
    assert torch.allclose(reloaded_hf.logits(texts), ours, atol=1e-5)
    reloaded = RewardModelReward.from_pretrained(tmp_path / "rm")
    assert isinstance(reloaded.model, CausalLMScorer) and reloaded.output == "probability"
    assert torch.allclose(reloaded.logits(texts), ours, atol=1e-6)
    assert reloaded(["12+34=? "], ["x"]) == pytest.approx(torch.sigmoid(reloaded.logits(["12+34=? x"])).tolist())


def test_reward_model_mixes_with_a_rule_by_weight(tokenizer):
    rm = make_rm(tokenizer)
    with torch.no_grad():
        rm.model.score.weight.normal_()
    prompts, completions = parity_batch(random.Random(0))
    runner = RewardRunner([rm, parity_label], [0.5, 2.0])
    out = runner(prompts, completions, None, {})
    expected = 0.5 * torch.sigmoid(rm.logits([p + c for p, c in zip(prompts, completions)])) \
        + 2.0 * torch.tensor(parity_label(prompts, completions))
    assert torch.allclose(out.rewards, expected, atol=1e-6)
    assert "rewards/reward_model/mean" in out.metrics


def _policy_folder(tokenizer, path):
    """The built-in tiny policy (seed 0) saved as an HF folder: a reward-model folder to pass by path."""
    build_model(tokenizer, seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_trainer_takes_a_folder_in_reward_funcs_and_trains_it_each_step(tokenizer, tmp_path):
    policy_dir = _policy_folder(tokenizer, tmp_path / "policy")
    task = ArithmeticTask()
    rows = task.load("train", levels=[3], size=32)
    args = GRPOConfig(num_generations=4, per_device_train_batch_size=8, gradient_accumulation_steps=1,
                      max_completion_length=4, max_steps=2, output_dir=str(tmp_path / "run"), quiet=True,
                      rm_updates_per_step=2, rm_batch_size=8, reward_funcs=[str(policy_dir)])
    # A causal-LM folder is no reward model: frozen, it would score everything alike.
    with pytest.raises(CohortError, match="no trained score head"):
        prepare_reward_funcs([str(policy_dir)], args=GRPOConfig(), tokenizer=tokenizer, device="cpu", task=task)
    with pytest.raises(CohortError, match="needs labels"):
        prepare_reward_funcs([str(policy_dir)], args=args, tokenizer=tokenizer, device="cpu", task=None)
    trainer = GRPOTrainer(str(policy_dir), None, rows, args=args, task=task)  # the folder, via args.reward_funcs
    (rm,) = trainer.rewards.funcs
    assert isinstance(rm, RewardModelReward) and rm.label_fn is not None
    trainer.train()
    history = trainer.history
    assert len(rm.buffer) == 16 and rm.steps_seen == 2
    for record in history:
        # named as TRL names a reward model: its folder's name
        assert {"rm/online_accuracy", "rm/loss", "rm/train_loss", "rewards/policy/mean"} <= record.keys()
    assert history[0]["rm/online_accuracy"] == 1 - history[0]["rm/label_mean"]  # zero head says "wrong" to all


# ---- the likelihood verifier, the warm-up and the head's learning rate ---------------------------

def independent_completion_logprob(backbone, tokenizer, prompt: str, completion: str) -> float:
    """Σ log p(completion token | everything before it), from the model's full logits, one text at a time."""
    head = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    tail = tokenizer(completion, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([head + tail])
    with torch.no_grad():
        logprobs = torch.log_softmax(backbone(ids).float(), dim=-1)[0]
    return sum(float(logprobs[len(head) + j - 1, token]) for j, token in enumerate(tail))


def test_likelihood_scorer_is_a_times_the_completion_logprob_plus_b(tokenizer):
    rm = make_rm(tokenizer, scorer="likelihood")
    prompts, completions = parity_batch(random.Random(4))
    assert torch.all(rm.logits(prompts, completions) == 0)  # a zero head: no preference before training
    with torch.no_grad():
        rm.model.score.weight.fill_(0.7)
        rm.model.score.bias.fill_(-1.5)
    want = torch.tensor([0.7 * independent_completion_logprob(rm.model.backbone, tokenizer, p, c) - 1.5
                         for p, c in zip(prompts[:6], completions[:6])])
    got = rm.logits(prompts[:6], completions[:6])  # one padded batch of unequal lengths
    assert torch.allclose(got, want, atol=1e-4)
    assert rm(prompts[:6], completions[:6]) == pytest.approx(torch.sigmoid(want).tolist(), abs=1e-4)


def test_likelihood_scorer_saves_and_reloads_with_its_head(tokenizer, tmp_path):
    rm = make_rm(tokenizer, scorer="likelihood")
    with torch.no_grad():
        rm.model.score.weight.fill_(1.25)
        rm.model.score.bias.fill_(0.5)
    rm.save_pretrained(tmp_path / "rm")
    reloaded = RewardModelReward.from_pretrained(tmp_path / "rm")
    prompts, completions = parity_batch(random.Random(6))
    assert type(reloaded.model).__name__ == "LikelihoodScorer"
    assert torch.allclose(reloaded.logits(prompts, completions), rm.logits(prompts, completions), atol=1e-5)


def test_head_learning_rate_puts_the_head_in_its_own_group(tokenizer):
    rm = make_rm(tokenizer, learning_rate=1e-4, head_learning_rate=5e-3)
    trunk, head = rm.optimizer.param_groups
    assert trunk["lr"] == 1e-4 and head["lr"] == 5e-3
    assert [id(p) for p in head["params"]] == [id(rm.model.score.weight)]
    assert len(trunk["params"]) + 1 == len(list(rm.model.parameters()))
    with pytest.raises(CohortError, match="rm_scorer"):
        make_rm(tokenizer, scorer="middle_token")


def test_settings_are_the_configs_rm_options_and_refused_as_the_config_refuses_them(tokenizer):
    config = GRPOConfig(rm_updates_per_step=3, rm_replay_ratio=0.25, rm_scorer="likelihood", rm_warmup_batches=2)
    settings = config.reward_model()
    for f in dataclasses.fields(RewardModelSettings):
        assert getattr(settings, f.name) == getattr(config, f"rm_{f.name}")
    assert RewardModelSettings() == GRPOConfig().reward_model()  # the same defaults
    # A Python caller building r_φ directly meets the config's rule, in its words.
    for bad in ({"replay_ratio": 1.0}, {"label_fraction": 0.0}, {"batch_size": 0}, {"head_learning_rate": 0.0},
                {"loss": "listwise"}):
        (name, value), = bad.items()
        with pytest.raises(CohortError) as from_config:
            GRPOConfig(**{f"rm_{name}": value}).validate()
        with pytest.raises(CohortError) as from_python:
            make_rm(tokenizer, **bad)
        assert str(from_python.value) == str(from_config.value) and f"rm_{name}=" in str(from_config.value)
    with pytest.raises(CohortError, match="takes a RewardModelSettings"):
        RewardModelReward(tiny_backbone(tokenizer), tokenizer, {"replay_ratio": 0.5})


@pytest.mark.parametrize("scorer", ["head", "likelihood"])
def test_warm_up_holds_out_groups_learns_and_fills_the_buffer(tokenizer, scorer):
    rm = make_rm(tokenizer, seed=1, scorer=scorer, batch_size=32, learning_rate=3e-3, head_learning_rate=3e-2)
    prompts, completions = parity_batch(random.Random(7), groups=40)
    metrics = rm.warm_up(prompts, completions, group_size=4, updates=60, held_out_fraction=0.25)
    assert rm.warmed_up and len(rm.buffer) == 160 and metrics["rm/warmup_samples"] == 160
    assert rm.next_group == 40 and rm.steps_seen == 0  # the warm-up is no policy step
    labels = torch.tensor(parity_label(prompts, completions))
    held_out = slice(120, 160)  # the last 10 of 40 groups
    zero_head_accuracy = float((labels[held_out] == 0).float().mean())  # a zero head says "wrong" to all
    assert metrics["rm/warmup_online_accuracy_before"] == pytest.approx(zero_head_accuracy)
    after = rm.logits(prompts[held_out], completions[held_out]) > 0
    assert metrics["rm/warmup_online_accuracy_after"] == pytest.approx(float((after == (labels[held_out] == 1)).float().mean()))
    if scorer == "head":  # the parity of a digit is easy for a last-token head; it must be learnt here
        assert metrics["rm/warmup_online_accuracy_after"] > 0.75
    assert rm.model.score.weight.abs().sum() > 0  # the probe moved the head


@pytest.mark.slow
def test_trainer_warm_up_trains_r_phi_before_step_one_and_leaves_the_data_stream_alone(tokenizer, tmp_path):
    policy_dir = _policy_folder(tokenizer, tmp_path / "policy")
    task = ArithmeticTask()
    rows = task.load("train", levels=[3], size=32)
    common = dict(num_generations=4, per_device_train_batch_size=8, gradient_accumulation_steps=1,
                  max_completion_length=4, max_steps=1, quiet=True, rm_updates_per_step=1, rm_batch_size=8,
                  rm_scorer="likelihood", rm_head_learning_rate=1e-2, reward_funcs=[str(policy_dir)])
    prompts_seen = {}
    for batches in (0, 3):
        args = GRPOConfig(output_dir=str(tmp_path / f"run{batches}"), rm_warmup_batches=batches,
                          rm_warmup_updates=2, **common)
        trainer = GRPOTrainer(str(policy_dir), None, rows, args=args, task=task)
        (rm,) = trainer.rewards.funcs
        trainer.train()
        prompts_seen[batches] = [s.prompt for s in rm.buffer.items[-8:]]  # the GRPO step's own samples
        assert rm.warmed_up == bool(batches) and len(rm.buffer) == 8 * (batches + 1)
        if batches:
            assert {"rm/warmup_online_accuracy_before", "rm/warmup_online_accuracy_after"} <= rm.warmup_metrics.keys()
    assert prompts_seen[0] == prompts_seen[3]  # the warm-up drew its own prompts and restored the data order
