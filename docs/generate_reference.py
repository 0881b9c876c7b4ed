"""Write docs/reference.md from the code: every `GRPOConfig` field (name, type, default, help), grouped
in the sections of cohort_grpo/config/sections.py, with the values of each option that takes a fixed set
(the table in cohort_grpo/config/choices.py), the configs refused (the table in cohort_grpo/config/rules.py), and
every metric name the step log writes.

    python docs/generate_reference.py           # rewrite docs/reference.md
    python docs/generate_reference.py --check   # exit 1 if docs/reference.md is not what the code gives

tests/test_reference_doc.py runs the check, so the page cannot drift from the code. The options come
from `dataclasses.fields(GRPOConfig)`; the metrics table is kept here by hand (METRICS), next to the
modules that write the names it lists.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "reference.md"

# (name, when it is logged, meaning). Written by cohort_grpo/telemetry/step_report.py (the step record; its warnings
# come from cohort_grpo/telemetry/health.py),
# cohort_grpo/telemetry/metrics.py (throughput_metrics), cohort_grpo/update/policy_update.py (the update),
# cohort_grpo/algorithm/objectives.py (PolicyLossStats.as_dict), cohort_grpo/rewards/runner.py, cohort_grpo/rewards/model.py,
# cohort_grpo/algorithm/{dynamic_sampling,curriculum,ppo}.py and cohort_grpo/eval/evaluate.py.
METRICS: list[tuple[str, str, str]] = [
    ("step", "every line", "the GRPO step the line belongs to"),
    ("time", "every line", "Unix time the line was written"),
    ("reward", "every step", "mean total (weighted) reward of the step's completions"),
    ("reward_std", "every step", "mean over groups of the group's reward standard deviation"),
    ("rewards/<func>/mean", "every step", "mean score of one reward function, unweighted (samples it could not "
                                          "score left out)"),
    ("rewards/<func>/std", "every step", "standard deviation of that function's scores"),
    ("frac_reward_zero_std", "every step", "fraction of groups whose rewards are all equal: zero advantage, "
                                           "no learning signal"),
    ("informative", "every step", "1 − frac_reward_zero_std: the groups that carry a learning signal"),
    ("success", "every step", "fraction of completions the task's verifier accepts; without a verifier, the "
                              "fraction accuracy_reward scores above 0 when it is a reward function, else the "
                              "fraction with a total reward above 0 (the step line then calls it `Reward>0`)"),
    ("completions/mean_length", "every step", "mean completion length in tokens, EOS included"),
    ("completions/clipped_ratio", "every step", "fraction of completions cut at max_completion_length"),
    ("completions/empty_ratio", "every step", "fraction of completions with no text but white space (the model "
                                              "ended them at once)"),
    ("loss", "every step", "the optimised loss (normalised over the whole step and every rank), mean over "
                           "the μ updates"),
    ("entropy", "every step", "mean per-token entropy of the policy on its own completions (nats)"),
    ("kl", "β > 0", "mean per-token k3 estimate of KL(π_θ‖π_ref); 0 at the first step of each outer iteration"),
    ("clip_ratio/low_mean", "every step", "fraction of tokens with ρ < 1 − ε and a negative advantage (clip "
                                          "active); 0 when μ = 1"),
    ("clip_ratio/high_mean", "every step", "fraction of tokens with ρ > 1 + epsilon_high and a positive advantage"),
    ("clip_ratio/region_mean", "every step", "fraction of tokens where either clip is active"),
    ("grad_norm", "every step", "gradient norm before clipping"),
    ("learning_rate", "every step", "the scheduler's learning rate"),
    ("num_iterations", "every step", "μ, the policy updates made on this rollout"),
    ("micro_batches", "every step", "micro-batches in the update's optimizer step"),
    ("routing/replay_mismatch", "a mixture-of-experts model the engine samples", "share of the positions that "
     "predict completion tokens whose router, left free, picks other top-k experts than the sampler did in at "
     "least one MoE layer (the update's forwards; with routing_replay they route by the sampler's experts anyway)"),
    ("routing/expert_load_max_over_mean", "a mixture-of-experts model the engine samples", "token copies routed "
     "to the busiest expert over the mean per expert, averaged over MoE layers, for the step's sampled tokens "
     "(1 is balanced)"),
    ("routing/aux_loss", "router_aux_loss_coef > 0", "the Switch load-balancing loss of the update, averaged over "
     "MoE layers, before its weight"),
    ("skipped_steps", "every step", "updates skipped so far for a non-finite loss, gradient norm, log-prob or "
                                    "importance ratio (docs/reliability.md)"),
    ("nonfinite_logprobs", "every step", "loss tokens of this update (all ranks) whose log π_θ, log π_old, log "
                                         "π_ref (β > 0), sampler log-prob (correction on) or ratio ρ was NaN/inf; "
                                         "the update is skipped when it is not 0"),
    ("oom_retries", "every step", "out-of-GPU-memory retries so far (a halved micro-batch or optimizer chunk)"),
    ("step_time", "every step", "seconds of the whole step"),
    ("time/<phase>", "every step", "seconds of each phase: sampling, rewards, resampling (dynamic_sampling), "
                                   "logprobs, update, gather (fsdp), reward_model, eval (the evaluation that "
                                   "ran since the previous line)"),
    ("time/gc", "every step", "seconds Python's garbage collector ran during the step, inside the phases"),
    ("tokens_per_second/sampling", "every step", "completion tokens generated per second of sampling"),
    ("tokens_per_second/logprobs", "μ > 1 or β > 0", "prompt + completion tokens per second of the no-grad "
                                                     "log-prob passes (π_old, π_ref)"),
    ("tokens_per_second/update", "every step", "prompt + completion tokens per second of the μ updates"),
    ("mfu", "every step", "the update's model FLOPs ÷ seconds ÷ the GPU's peak bf16 FLOP/s, per GPU; null on a "
                          "CPU or an unknown GPU (`metrics.update_flops` counts them)"),
    ("peak_memory_gib", "every step", "CUDA: the step's peak allocated memory; CPU: the process's peak resident "
                                      "memory"),
    ("memory/<phase>_gib", "CUDA", "each phase's peak allocated memory"),
    ("memory/lent_gib", "every step", "gradient memory the update kept in the engine's idle KV cache instead of "
                                      "allocating it (lend_kv_cache)"),
    ("memory/alloc_retries", "CUDA", "the CUDA caching allocator's retries in the step (it emptied its cache, a "
                                     "device sync, and asked CUDA again)"),
    ("checkpointed_layers", "gradient_checkpointing_layers=auto", "decoder layers the update checkpointed "
                                                                  "(recomputed in the backward): all but the last "
                                                                  "in the first update, then its choice"),
    ("rewards/overlong_penalty", "overlong_buffer_length > 0", "mean DAPO overlong penalty added to the reward"),
    ("rewards/<func>/errors", "reward_errors warn", "samples the function raised on in the step (they score None)"),
    ("rewards/unscored_frac", "always", "fraction of completions no reward function scored (left out of their "
                                        "group's baseline, advantage 0)"),
    ("sampling/sampling_logp_difference/mean", "the engine samples", "mean |log π_trainer − log π_sampler| over the "
                                                                     "completion tokens (TRL's name)"),
    ("sampling/sampling_logp_difference/max", "the engine samples", "largest such difference in the step"),
    ("sampling/importance_sampling_ratio/min", "the engine samples", "smallest importance weight π_trainer / "
                                                                     "π_sampler the correction applies (the raw "
                                                                     "per-token ratio when it is off)"),
    ("sampling/importance_sampling_ratio/mean", "the engine samples", "mean of those weights"),
    ("sampling/importance_sampling_ratio/max", "the engine samples", "largest of those weights"),
    ("dynamic_sampling/tries", "dynamic_sampling", "sampling rounds of the step (1: no refill needed)"),
    ("dynamic_sampling/dropped_groups", "dynamic_sampling", "all-equal-reward groups thrown away"),
    ("dynamic_sampling/informative_groups", "dynamic_sampling", "groups trained on"),
    ("curriculum/stage", "curriculum", "index of the curriculum stage the step trained on"),
    ("rm/labelled", "learned r_φ", "samples given a rule label this step"),
    ("rm/label_mean", "learned r_φ", "mean of those labels"),
    ("rm/point_accuracy", "learned r_φ", "r_φ's accuracy on the fresh samples before it trains on them"),
    ("rm/pair_accuracy", "learned r_φ", "fraction of within-group pairs r_φ orders like their labels"),
    ("rm/online_accuracy", "learned r_φ", "the accuracy of r_φ's loss kind: point (pointwise) or pair (pairwise)"),
    ("rm/loss", "learned r_φ", "r_φ's loss on the fresh samples before training on them"),
    ("rm/train_loss", "rm_updates_per_step > 0", "mean loss of r_φ's updates this step"),
    ("rm/replayed_fraction", "rm_updates_per_step > 0", "fraction of r_φ's training samples drawn from the buffer"),
    ("rm/buffer_size", "learned r_φ", "samples in the replay buffer"),
    ("ppo/value_mean", "PPOTrainer", "mean critic value over completion tokens"),
    ("ppo/return_mean", "PPOTrainer", "mean GAE return over completion tokens"),
    ("value_loss", "PPOTrainer", "the critic's clipped value loss"),
    ("critic_grad_norm", "PPOTrainer", "the critic's gradient norm before clipping"),
    ("warnings", "a learning-health check fired", "the warning lines given since the previous line, each "
                                                  "once a run: every completion empty or clipped, no completion "
                                                  "scored, every group's rewards equal, a reward function or the "
                                                  "tools failing on most "
                                                  "calls, the KL or the clipped share running away, each for 10 "
                                                  "steps in a row (cohort_grpo/telemetry/health.py); a list of strings"),
    ("eval/accuracy", "evaluations", "greedy held-out accuracy (before training, every eval_steps, after)"),
    ("eval/greedy_accuracy", "evaluations", "the same greedy accuracy, under the name `cohort-grpo eval` uses"),
    ("eval/pass@k", "cohort-grpo eval --num_samples n", "unbiased pass@k from n samples (Chen et al. 2021), k = 1, 2, 4, "
                                                   "…, n; pass@1 is the mean accuracy of the samples"),
    ("eval/maj@n", "cohort-grpo eval --num_samples n", "majority vote of the n samples' answers"),
    ("eval/format_rate", "evaluations", "fraction of held-out completions in the task's answer format"),
    ("eval/mean_length", "evaluations", "mean held-out completion length in tokens"),
]


def default_text(f: dataclasses.Field) -> str:
    if "default_text" in f.metadata:  # a default that depends on where it is read, described
        return f"`{f.metadata['default_text']}`"
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    if isinstance(value, float) and "e" in repr(value):
        mantissa, exponent = repr(value).split("e")
        return f"`{mantissa}e{int(exponent)}`"
    return f"`{value!r}`"


def cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def type_cell(f: dataclasses.Field, choices: dict[str, tuple[str, ...]]) -> str:
    """The field's type, and its values where the one table of them (cohort_grpo/config/choices.py) lists them."""
    text = f"`{cell(f.type)}`"
    if f.name in choices:
        values = ", ".join(f"`{value}`" for value in choices[f.name])
        text += f": {values}"
    return text


def render() -> str:
    sys.path.insert(0, str(ROOT))
    from cohort_grpo.config.choices import CHOICES
    from cohort_grpo.config.grpo_config import GRPOConfig
    from cohort_grpo.config.rules import RULES
    from cohort_grpo.config.sections import SECTIONS

    fields = {f.name: f for f in dataclasses.fields(GRPOConfig)}
    listed = [name for section in SECTIONS for name in section.options]
    missing = [name for name in fields if name not in listed]
    if missing or len(listed) != len(set(listed)) or set(listed) - set(fields):
        raise SystemExit(f"the sections of cohort_grpo/config/sections.py do not cover the fields exactly (missing "
                         f"{missing})")
    lines = [
        "# Reference",
        "",
        "<!-- Generated by docs/generate_reference.py from cohort_grpo/config/grpo_config.py and the metric names it lists. "
        "Do not edit by hand: change the code, then run `python docs/generate_reference.py`. -->",
        "",
        "Every `GRPOConfig` field is a flag of `cohort-grpo train` (`--learning_rate 1e-5` or `--learning-rate=1e-5`; a "
        "bare `--flag` means true; lists are comma-separated), a key of a YAML file passed with `--config run.yaml` "
        "(flags override it) and a keyword of `GRPOConfig(...)`. The defaults are `GRPOConfig`'s; `cohort-grpo train` "
        "starts from its task's defaults (`default_config` in cohort_grpo/tasks/), then the YAML, then the flags; "
        "`cohort-grpo train --help` shows each default this invocation would use and its source. A value outside an "
        "option's listed values (the one table of them, cohort_grpo/config/choices.py) is a one-line error.",
        "",
        "A run settles its configuration once, when the device and the model are known (cohort_grpo/run/resolve.py): "
        "every `auto` (and unset `max_staleness`, `importance_sampling_correction`) gets the value the run uses, "
        "and every stage is built from that resolved config. `GRPOTrainer(...).args` is it, read-only (setting a "
        "field raises a one-line `CohortError`; `dataclasses.replace(trainer.args, ...)` gives an editable copy); "
        "the `GRPOConfig` you pass in is never changed, so one config can build several trainers. "
        "`cohort-grpo train ... --print_config` loads the model, resolves, prints that configuration as YAML with each "
        "value's source (`resolved from auto` where resolution chose it) and exits untrained; `--config` reads the "
        "file back to the same run. `gradient_checkpointing_layers: auto` can stay: it is measured in the first "
        "update.",
        "",
        "- [Options](#options): " + ", ".join(f"[{s.title}](#{anchor(s.title)})" for s in SECTIONS),
        "- [Refused configurations](#refused-configurations): the ranges and combinations a run refuses",
        "- [Metrics](#metrics): the names in `metrics.jsonl`, TensorBoard and Weights & Biases",
        "",
        "## Options",
    ]
    for section in SECTIONS:
        lines += ["", f"### {section.title}", ""]
        if section.description:
            lines += [section.description, ""]
        lines += ["| option | type | default | what it does |", "| --- | --- | --- | --- |"]
        for name in section.options:
            f = fields[name]
            lines.append(f"| `{name}` | {type_cell(f, CHOICES)} | {cell(default_text(f))} | "
                         f"{cell(f.metadata.get('help', ''))} |")
    lines += ["", "## Refused configurations", "",
              "Besides a value of the wrong type or outside an option's listed values, `GRPOConfig(...)` itself "
              "(and so `cohort-grpo train`) refuses a configuration in these cases, with a one-line error that names "
              "the values and the fix (the table of them is cohort_grpo/config/rules.py; checks that need the number "
              "of processes or the model run when those are known):", ""]
    lines += [f"- {rule.when}" for rule in RULES]
    lines += ["", "## Metrics", "",
              "Each line of `<output_dir>/metrics.jsonl` is one JSON object, `{\"step\", \"time\", <name>: value, …}`, "
              "written every `logging_steps` steps; a value that is not a finite number is `null`. Evaluations "
              "write lines of their own. The same numbers go to TensorBoard or Weights & Biases with `report_to`. "
              "Names are TRL's where TRL logs the same quantity.",
              "", "| name | logged | meaning |", "| --- | --- | --- |"]
    lines += [f"| `{cell(name)}` | {cell(when)} | {cell(meaning)} |" for name, when, meaning in METRICS]
    return "\n".join(lines) + "\n"


def anchor(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces as dashes."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with docs/reference.md instead of writing it")
    parser.add_argument("--out", default=str(PAGE), help="where to write (default docs/reference.md)")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        same = Path(args.out).is_file() and Path(args.out).read_text(encoding="utf-8") == text
        print(f"{args.out} is {'up to date' if same else 'stale: run python docs/generate_reference.py'}")
        return 0 if same else 1
    Path(args.out).write_text(text, encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
