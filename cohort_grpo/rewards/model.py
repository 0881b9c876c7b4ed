"""A learned reward model r_φ as a reward function, kept current by continuous training with replay.

DeepSeekMath (Shao et al. 2024), Algorithm 1, line 12: after each policy step, "update r_φ through
continuous training using a replay mechanism"; its training data comes from rule judgments. Here
`RewardModelReward` is a TRL-signature reward function (`f(prompts, completions, completion_ids,
**columns) -> list[float]`) that the trainer also calls once after the policy update:

    on_step_end(step's samples):
        label a fraction of the step's groups with `label_fn` (default: the task's verifier)
        score those fresh samples with r_φ, *before* training on them → rm/online_accuracy, rm/loss
        k times: one optimizer step on a mini-batch mixing fresh and replayed samples
        add the fresh samples to the bounded replay buffer

The loss is pointwise (binary cross-entropy on the label, r_φ(x) = logit of P(correct)) or within-group
pairwise (Bradley & Terry 1952: −log σ(r_φ(better) − r_φ(worse)) over pairs of one prompt's
completions with different labels, the InstructGPT reward-model loss, Ouyang et al. 2022).

Before GRPO starts, `warm_up` (or `warm_up_reward_models`, `rm_warmup_batches`) trains r_φ
offline on labelled samples of the initial policy: first the head alone on frozen features (a linear
probe), then the whole network, and reports its accuracy on held-out groups of those samples. The
network is a last-token scalar head or a likelihood verifier (`scorer`, see scorers.py); the head may
learn faster than the trunk (`head_learning_rate`).

The policy's reward is σ(r_φ) ("probability", the default after pointwise training) or the raw score
("logit", TRL's behaviour for a frozen reward model). `state_dict()` / `load_state_dict()` cover the
network, its optimizer, the replay buffer and the random state, so a checkpoint resumes exactly.
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from cohort_grpo.config.settings import RewardModelSettings
from cohort_grpo.errors import CohortError
from cohort_grpo.rewards.replay import MixedBatches, ReplayBuffer, Sample, rng_state, set_rng_state, within_group_pairs
from cohort_grpo.rewards.completions import completion_text
from cohort_grpo.rewards.user_calls import accepted_kwargs
from cohort_grpo.rewards.scorers import REWARD_OUTPUT_KEY, as_scorer, load_scorer

REWARD_OUTPUTS = ("probability", "logit")


class RewardModelReward:
    """r_φ as a reward function. `model`: a scorer, our `CausalLM` (a fresh head is added) or a transformers
    sequence classifier; `tokenizer`: the one the model reads; `settings`: how it trains
    (`RewardModelSettings`, `GRPOConfig.reward_model()` from a config; the defaults keep r_φ frozen, as TRL
    does). `output`: probability (σ of the score) or logit; None chooses probability for a pointwise r_φ that
    trains, else logit. `seed`: its replay sampling and label choice; `name`: its name in the metrics."""

    def __init__(self, model, tokenizer, settings: RewardModelSettings | None = None, *, label_fn=None,
                 output: str | None = None, max_grad_norm: float = 1.0, seed: int = 0, device=None,
                 name: str = "reward_model"):
        settings = RewardModelSettings() if settings is None else settings
        if not isinstance(settings, RewardModelSettings):
            raise CohortError(f"RewardModelReward takes a RewardModelSettings, got {type(settings).__name__}; build "
                              "one with RewardModelSettings(updates_per_step=..., ...) or config.reward_model()")
        if output is not None and output not in REWARD_OUTPUTS:
            raise CohortError(f"unknown reward model output {output!r}; choose one of {list(REWARD_OUTPUTS)}")
        self.tokenizer = tokenizer
        self.pad_id = next(i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if i is not None)
        self.model = as_scorer(model, self.pad_id, settings.scorer)
        if device is not None:
            self.model.to(device)
        self.label_fn, self.loss_kind, self.label_fraction = label_fn, settings.loss, settings.label_fraction
        self.updates_per_step, self.train_steps = settings.updates_per_step, settings.train_steps
        self.batch_size, self.replay_ratio = settings.batch_size, settings.replay_ratio
        self.max_length, self.max_grad_norm = settings.max_length, max_grad_norm
        self.output = output or ("probability" if settings.loss == "pointwise" and settings.updates_per_step > 0
                                 else "logit")
        self.__name__ = name  # the reward's name in metrics: rewards/<name>/mean
        self.buffer = ReplayBuffer(settings.buffer_size, settings.buffer_policy, seed=seed + 1)
        self.rng = random.Random(seed)
        head = getattr(self.model, "score", None)
        head_ids = {id(q) for q in head.parameters()} if isinstance(head, torch.nn.Module) else set()
        head_learning_rate = settings.head_learning_rate
        head_learning_rate = settings.learning_rate if head_learning_rate is None else head_learning_rate
        groups = [{"params": [q for q in self.model.parameters() if id(q) not in head_ids],
                   "lr": settings.learning_rate},
                  {"params": [q for q in self.model.parameters() if id(q) in head_ids], "lr": head_learning_rate}]
        self.optimizer = torch.optim.AdamW([g for g in groups if g["params"]], weight_decay=0.0)
        self.steps_seen = 0  # policy steps this reward model has been through
        self.warmed_up = False  # `warm_up` ran (a resumed or copied r_φ is not warmed up twice)
        self.next_group = 0  # group ids are unique over the run, so pairs never cross steps

    @classmethod
    def from_pretrained(cls, folder, settings: RewardModelSettings | None = None, *, device=None,
                        dtype: str | None = None, **keywords) -> "RewardModelReward":
        """Load a reward model folder (or a causal-LM folder: a fresh head is added, to be trained); `keywords`
        are the constructor's (label_fn, output, seed, name)."""
        settings = RewardModelSettings() if settings is None else settings
        scorer, tokenizer, trained, config = load_scorer(folder, device=device, dtype=dtype, kind=settings.scorer)
        if not trained and settings.updates_per_step == 0:
            raise CohortError(f"{folder} has no trained score head (it is not a reward model) and r_φ is frozen; "
                              "train it online (--rm_updates_per_step 4) or pass a reward-model folder")
        keywords.setdefault("output", None if settings.updates_per_step else config.get(REWARD_OUTPUT_KEY))
        return cls(scorer, tokenizer, settings, device=device, **keywords)

    def save_pretrained(self, out_dir) -> Path:
        """A Hugging Face folder (config.json, model.safetensors, tokenizer) that `from_pretrained` reloads."""
        out = self.model.save_pretrained(out_dir, {REWARD_OUTPUT_KEY: self.output})
        self.tokenizer.save_pretrained(out)
        return out

    # ---- as a reward function -----------------------------------------------------------------
    def __call__(self, prompts, completions, completion_ids=None, **columns) -> list[float]:
        pairs = [self.split(p, c) for p, c in zip(prompts, completions)]
        logits = self.logits([p for p, _ in pairs], [c for _, c in pairs])
        values = torch.sigmoid(logits) if self.output == "probability" else logits
        return values.tolist()

    @torch.no_grad()
    def logits(self, texts, completions=None, chunk: int = 64, *, features: bool = False) -> torch.Tensor:
        """r_φ's raw scores [N] (float32, CPU), in chunks: of `texts` alone, or of prompts `texts` each
        followed by its completion (the likelihood scorer scores the completion's tokens only).
        `features=True`: the head's inputs [N, F] instead."""
        completions = list(completions) if completions is not None else [""] * len(texts)
        was_training = self.model.training
        self.model.eval()
        out = [self._forward(texts[i:i + chunk], completions[i:i + chunk], features).cpu()
               for i in range(0, len(texts), chunk)]
        self.model.train(was_training)
        return torch.cat(out) if out else torch.zeros(0)

    def split(self, prompt, completion) -> tuple[str, str]:
        """What r_φ reads, as (prompt text, completion text); a chat goes through the tokenizer's template."""
        if isinstance(prompt, str):
            return prompt, completion_text(completion)
        reply = completion if isinstance(completion, list) else [{"role": "assistant", "content": completion}]
        if getattr(self.tokenizer, "chat_template", None):
            whole = self.tokenizer.apply_chat_template(list(prompt) + list(reply), tokenize=False)
            head = self.tokenizer.apply_chat_template(list(prompt), tokenize=False, add_generation_prompt=True)
            return (head, whole[len(head):]) if whole.startswith(head) else (whole, "")
        return "\n".join(completion_text([m]) for m in prompt) + "\n", completion_text(reply)

    def text(self, prompt, completion) -> str:
        return "".join(self.split(prompt, completion))

    def _forward(self, prompts: list[str], completions: list[str], features: bool = False) -> torch.Tensor:
        """Prompt and completion are tokenized apart, as the policy saw them; a text with no completion
        counts wholly as completion for the likelihood scorer (all tokens but the first)."""
        encode = lambda texts: self.tokenizer(texts, add_special_tokens=False)["input_ids"]  # noqa: E731
        heads, tails = encode(prompts), encode(completions)
        ids = [(h + t)[-self.max_length:] for h, t in zip(heads, tails)]  # keep the end: the completion is judged
        width = max(1, max(len(row) for row in ids))
        device = next(self.model.parameters()).device
        input_ids = torch.full((len(ids), width), self.pad_id, dtype=torch.long)
        mask, completion_mask = torch.zeros_like(input_ids), torch.zeros_like(input_ids)
        for i, (row, tail) in enumerate(zip(ids, tails)):
            input_ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
            mask[i, : len(row)] = 1
            completion_mask[i, len(row) - len(tail) if tail else min(1, len(row)): len(row)] = 1
        args = (input_ids.to(device), mask.to(device), completion_mask.to(device))
        return self.model.features(*args) if features else self.model(*args)

    # ---- Algorithm 1, line 12: continuous training with replay ---------------------------------
    def on_step_end(self, prompts, completions, completion_ids=None, *, group_size: int, step: int | None = None,
                    **columns) -> dict[str, float]:
        """Label this step's samples, measure r_φ on them before learning from them, then train and
        replay. `group_size` = G (rows are group-contiguous). Returns rm/* metrics for the step."""
        self.steps_seen += 1
        first_group, self.next_group = self.next_group, self.next_group + max(1, len(completions) // group_size)
        if self.label_fn is None:
            return {}
        fresh = self.label(prompts, completions, completion_ids, columns, group_size, first_group)
        metrics = self.online_metrics(fresh)
        training = self.updates_per_step > 0 and (self.train_steps == 0 or self.steps_seen <= self.train_steps)
        if training:
            metrics.update(self.train_on(fresh))
            self.buffer.add(fresh)
        metrics["rm/buffer_size"] = float(len(self.buffer))
        return metrics

    def label(self, prompts, completions, completion_ids, columns, group_size, first_group) -> list[Sample]:
        """Rule labels for `label_fraction` of the step's groups (whole groups, so pairs survive)."""
        num_groups = max(1, len(completions) // group_size)
        chosen = range(num_groups)
        if self.label_fraction < 1:
            chosen = sorted(self.rng.sample(range(num_groups), max(1, round(self.label_fraction * num_groups))))
        rows = [i for g in chosen for i in range(g * group_size, min((g + 1) * group_size, len(completions)))]
        pick = lambda values: [values[i] for i in rows] if values is not None else None  # noqa: E731
        arguments = dict(prompts=[prompts[i] for i in rows], completions=[completions[i] for i in rows],
                         completion_ids=pick(completion_ids), **{k: pick(v) for k, v in columns.items()})
        labels = self.label_fn(**accepted_kwargs(self.label_fn, arguments))  # keywords, as TRL calls rewards
        fresh = []
        for i, label in zip(rows, labels):
            if label is None or (isinstance(label, float) and math.isnan(label)):
                continue
            if self.loss_kind == "pointwise" and not 0 <= float(label) <= 1:
                raise CohortError(f"label_fn gave label {label}; the pointwise rm_loss needs labels in [0, 1] "
                                  "(use rm_loss=pairwise for other scales)")
            prompt, completion = self.split(prompts[i], completions[i])  # a chat: rendered through its template
            fresh.append(Sample(prompt, completion, float(label), first_group + i // group_size))
        return fresh

    def online_metrics(self, fresh: list[Sample]) -> dict[str, float]:
        """r_φ on the fresh samples before it trains on them: its honest, held-out accuracy."""
        if not fresh:
            return {}
        logits = self.logits([s.prompt for s in fresh], [s.completion for s in fresh])
        labels = torch.tensor([s.label for s in fresh])
        metrics = {"rm/labelled": float(len(fresh)), "rm/label_mean": float(labels.mean()),
                   "rm/point_accuracy": float(((logits > 0) == (labels >= 0.5)).float().mean())}
        pairs = within_group_pairs(fresh)
        if pairs:
            better, worse = logits[[a for a, _ in pairs]], logits[[b for _, b in pairs]]
            metrics["rm/pair_accuracy"] = float(((better > worse).float() + 0.5 * (better == worse).float()).mean())
        if self.loss_kind == "pointwise":
            metrics["rm/online_accuracy"] = metrics["rm/point_accuracy"]
            metrics["rm/loss"] = float(F.binary_cross_entropy_with_logits(logits, labels))
        elif pairs:
            metrics["rm/online_accuracy"] = metrics["rm/pair_accuracy"]
            metrics["rm/loss"] = float(-F.logsigmoid(better - worse).mean())
        return metrics

    def train_on(self, fresh: list[Sample]) -> dict[str, float]:
        """`updates_per_step` optimizer steps on mini-batches mixing fresh and replayed units."""
        fresh_units, replayed_units = self.units(fresh), self.units(self.buffer.items)
        batches = MixedBatches(fresh_units, replayed_units, self.batch_size, self.replay_ratio, self.rng)
        if not batches:
            return {}
        self.model.train()
        losses, replayed = [], 0
        for _ in range(self.updates_per_step):
            new, old = batches.next()
            losses.append(self.update(new + old))
            replayed += len(old)
        self.model.eval()
        return {"rm/train_loss": sum(losses) / len(losses),
                "rm/replayed_fraction": replayed / (self.updates_per_step * self.batch_size)}

    def update(self, units: list) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        if self.loss_kind == "pointwise":
            logits = self._forward([s.prompt for s in units], [s.completion for s in units])
            labels = torch.tensor([s.label for s in units], device=logits.device)
            loss = F.binary_cross_entropy_with_logits(logits, labels)
        else:
            logits = self._forward([s.prompt for pair in units for s in pair], [s.completion for pair in units for s in pair])
            loss = -F.logsigmoid(logits[0::2] - logits[1::2]).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        return float(loss.detach())

    # ---- warm-up: offline training on the initial policy's labelled samples --------------------------
    def warm_up(self, prompts, completions, completion_ids=None, *, group_size: int, updates: int,
                held_out_fraction: float = 0.2, probe_steps: int = 300, **columns) -> dict[str, float]:
        """Label the samples (all of them), hold out the last `held_out_fraction` of the groups, fit the
        head alone on frozen features (`probe_steps` full-batch Adam steps at the head's learning rate),
        then `updates` mini-batch steps of the whole network on the rest; all samples then enter the
        buffer. Returns rm/warmup_* metrics: held-out accuracy and loss before, after the probe, after."""
        first_group, self.next_group = self.next_group, self.next_group + max(1, len(completions) // group_size)
        saved_fraction, self.label_fraction = self.label_fraction, 1.0
        fresh = self.label(prompts, completions, completion_ids, columns, group_size, first_group)
        self.label_fraction = saved_fraction
        groups = sorted({s.group for s in fresh})
        cut = groups[len(groups) - max(1, round(held_out_fraction * len(groups)))] if held_out_fraction > 0 else None
        train = [s for s in fresh if cut is None or s.group < cut] or fresh
        held_out = [s for s in fresh if cut is not None and s.group >= cut]
        report = lambda tag: {f"rm/warmup_{k.removeprefix('rm/')}_{tag}": v  # noqa: E731
                              for k, v in self.online_metrics(held_out).items()
                              if k in ("rm/online_accuracy", "rm/loss", "rm/pair_accuracy")}
        metrics = {"rm/warmup_samples": float(len(fresh)), **report("before")}
        if probe_steps:
            self.fit_head(train, probe_steps)
            metrics.update(report("probe"))
        if updates:
            batches = MixedBatches(self.units(train), [], self.batch_size, 0.0, self.rng)
            self.model.train()
            losses = [self.update(batches.next()[0]) for _ in range(updates)]
            self.model.eval()
            metrics["rm/warmup_train_loss"] = sum(losses[-20:]) / len(losses[-20:])
        metrics.update(report("after"))
        self.buffer.add(fresh)
        self.warmed_up = True
        self.warmup_metrics = metrics
        return metrics

    def units(self, samples: list[Sample]) -> list:
        """Training units: samples (pointwise) or (better, worse) pairs within a group (pairwise)."""
        if self.loss_kind == "pointwise":
            return list(samples)
        return [(samples[a], samples[b]) for a, b in within_group_pairs(samples)]

    def fit_head(self, samples: list[Sample], steps: int) -> None:
        """Fit only the final Linear on r_φ's frozen features of `samples` (full batch, Adam at the head's
        learning rate). Scorers without `features` (transformers classifiers) are left as they are."""
        head = getattr(self.model, "score", None)
        if not samples or not hasattr(self.model, "features") or not isinstance(head, torch.nn.Linear):
            return
        feats = self.logits([s.prompt for s in samples], [s.completion for s in samples], features=True)
        feats = feats.to(head.weight.device, head.weight.dtype)
        labels = torch.tensor([s.label for s in samples], device=feats.device)
        index = {id(s): i for i, s in enumerate(samples)}
        pairs = [(index[id(a)], index[id(b)]) for a, b in self.units(samples)] if self.loss_kind == "pairwise" else []
        optimizer = torch.optim.Adam(head.parameters(), lr=self.optimizer.param_groups[-1]["lr"])
        for _ in range(steps):
            optimizer.zero_grad(set_to_none=True)
            scores = head(feats).squeeze(-1).float()
            if self.loss_kind == "pointwise":
                loss = F.binary_cross_entropy_with_logits(scores, labels)
            elif pairs:
                loss = -F.logsigmoid(scores[[a for a, _ in pairs]] - scores[[b for _, b in pairs]]).mean()
            else:
                return
            loss.backward()
            optimizer.step()

    # ---- checkpointing ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "buffer": self.buffer.state_dict(), "rng": rng_state(self.rng), "steps_seen": self.steps_seen,
                "next_group": self.next_group, "warmed_up": self.warmed_up}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.buffer.load_state_dict(state["buffer"])
        set_rng_state(self.rng, state["rng"])
        self.steps_seen, self.next_group = int(state["steps_seen"]), int(state["next_group"])
        self.warmed_up = bool(state.get("warmed_up", False))


# ---- wiring into the trainer ------------------------------------------------------------------

def task_labeller(task):
    """The task's verifier as a labelling function: 1.0 for a correct completion, else 0.0."""

    def rule_label(prompts, completions, completion_ids=None, **columns) -> list[float]:
        rows = [{"prompt": p, **{k: v[i] for k, v in columns.items()}} for i, p in enumerate(prompts)]
        return [1.0 if task.is_correct(completion_text(c), row) else 0.0 for c, row in zip(completions, rows)]

    return rule_label


def warm_up_reward_models(reward_funcs: list, args, rows: list[dict], sample: Callable[[list[dict]], object],
                          log: Callable[[str], None] = print) -> None:
    """Before GRPO's first step: sample `rm_warmup_batches` batches of the initial policy on random
    `rows` (`sample(rows)` returns a rollout `Batch`) and `warm_up` every learned r_φ among
    `reward_funcs` on them (`rm_warmup_updates` updates). The caller keeps its own data order and
    sampling seeds out of this (`PromptStream.unchanged`), so the GRPO run itself is unchanged."""
    models = [f for f in reward_funcs if isinstance(f, RewardModelReward) and f.label_fn is not None
              and f.updates_per_step > 0 and not f.warmed_up]
    settings = args.reward_model()
    batches = settings.warmup_batches
    if not models or not batches:
        return
    pick = random.Random(args.seed + 7)  # warm-up prompts: their own stream
    prompts, completions, ids, columns = [], [], [], {}
    for _ in range(batches):
        batch = sample(pick.sample(rows, min(len(rows), args.prompts_per_step)))
        prompts += batch.prompts
        completions += batch.completions
        ids += batch.completion_token_ids()
        for key, values in batch.columns.items():
            columns.setdefault(key, []).extend(values)
    for rm in models:
        metrics = rm.warm_up(prompts, completions, ids, group_size=args.num_generations,
                             updates=settings.warmup_updates, **columns)
        log(f"r_φ warm-up on {int(metrics['rm/warmup_samples'])} samples: held-out accuracy "
            f"{100 * metrics.get('rm/warmup_online_accuracy_before', float('nan')):.1f}% → "
            f"{100 * metrics.get('rm/warmup_online_accuracy_after', float('nan')):.1f}%")


def resolve_reward_funcs(reward_funcs, args, task, tokenizer, device,
                         processing_classes=None) -> tuple[list, list[float] | None]:
    """The run's reward functions and their weights: `reward_funcs` as given, else --reward_funcs, else the task's
    (with its weights, unless reward_weights are set); model folders and objects become r_φ
    (`prepare_reward_funcs`), each reading its entry of `processing_classes` (TRL's reward_processing_classes)
    where that is not None. `args` is read, never changed."""
    weights = args.reward_weights
    if reward_funcs is None and args.reward_funcs is not None:
        reward_funcs = list(args.reward_funcs)  # --reward_funcs: names, module:function, reward-model folders; [] none
    if reward_funcs is None:
        if task is None:
            raise CohortError("no reward functions: pass reward_funcs=[...], a task, or an environment_factory "
                              "whose environment has get_reward()")
        reward_funcs = list(task.reward_funcs)
        weights = weights or list(task.reward_weights)
    reward_funcs = reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    if processing_classes is not None:
        processing_classes = processing_classes if isinstance(processing_classes, (list, tuple)) else [processing_classes]
        if len(processing_classes) != len(reward_funcs):
            raise CohortError(f"{len(processing_classes)} reward_processing_classes for {len(reward_funcs)} reward "
                              "functions; pass one per function (None for a function that is not a model)")
    prepared = prepare_reward_funcs(list(reward_funcs), args=args, tokenizer=tokenizer, device=device, task=task,
                                    processing_classes=processing_classes)
    return prepared, weights


def prepare_reward_funcs(reward_funcs: list, *, args, tokenizer, device, task=None, processing_classes=None) -> list:
    """Turn the reward-model entries of `reward_funcs` into `RewardModelReward`s, as TRL does: a folder
    path is loaded, a model object is wrapped (reading text with its entry of `processing_classes`, else its own
    tokenizer if it names one, else the policy's), each named in the metrics as TRL names it (the last part of
    its folder or hub id). Every trainable r_φ without a `label_fn` gets the task's verifier. Others pass as is."""
    from torch import nn

    prepared = []
    for i, spec in enumerate(reward_funcs):
        if isinstance(spec, (str, Path)) and Path(spec).expanduser().is_dir():
            spec = RewardModelReward.from_pretrained(spec, args.reward_model(), device=device, seed=args.seed,
                                                     name=Path(spec).expanduser().resolve().name)
        elif isinstance(spec, nn.Module):
            given = processing_classes[i] if processing_classes is not None else None
            name = str(getattr(getattr(spec, "config", None), "_name_or_path", "") or "").rstrip("/").split("/")[-1]
            spec = RewardModelReward(spec, given or _own_tokenizer(spec) or tokenizer, args.reward_model(),
                                     device=device, seed=args.seed, name=name or "reward_model")
        if isinstance(spec, RewardModelReward) and spec.label_fn is None and spec.updates_per_step > 0:
            if task is None or not hasattr(task, "is_correct"):
                raise CohortError("a trained reward model needs labels: pass a task with a verifier, or build "
                                  "RewardModelReward(..., label_fn=your_rule), or set rm_updates_per_step=0")
            spec.label_fn = task_labeller(task)
        prepared.append(spec)
    return prepared


def _own_tokenizer(model):
    name = getattr(getattr(model, "config", None), "_name_or_path", None)
    if name and Path(name).is_dir():
        from cohort_grpo.models import load_tokenizer

        return load_tokenizer(name)
    return None
