"""The distillation teacher of a run, loaded once: frozen, LoRA-free, in eval mode, on the policy's device.

`teacher_model` (the config's, or a `GRPOTrainer(teacher_model=...)` argument: a folder, a hub id, a built-in
name such as cohort:tiny-arithmetic, or a loaded model) loads as the policy does (`load_policy`), in the dtype
`teacher_model_init_kwargs` names, else the run's weights' dtype (bfloat16 on a GPU, float32 on a CPU); a loaded
model keeps its own. It must share the student's vocabulary: its log-probs are of the student's token ids. It is
never checkpointed: a resumed run loads it again from the config (or the argument passed again).
"""

from __future__ import annotations

import torch
from torch import nn

from cohort_grpo.config.rules import refusal, unused_teacher
from cohort_grpo.errors import CohortError
from cohort_grpo.models.lora import has_lora
from cohort_grpo.optim.precision import resolve_dtype
from cohort_grpo.rollout.layout import Layout
from cohort_grpo.run.policy import load_policy
from cohort_grpo.update.logprobs import supports_hidden
from cohort_grpo.update.teacher import TeacherPolicy

DTYPE_KEYS = ("dtype", "torch_dtype")  # transformers' names of the one teacher_model_init_kwargs key cohort honours


def teacher_given(teacher, args) -> object | None:
    """The run's teacher: `GRPOTrainer`'s `teacher` argument or the config's `teacher_model` (both: refused), checked
    against `distillation_coef` before anything loads: a teacher with coefficient 0 would load and never be used,
    a coefficient above 0 with no teacher has nothing to distil."""
    if teacher is not None and args.teacher_model is not None:
        raise CohortError(f"teacher_model is given twice ({args.teacher_model!r} in the config and a "
                          "GRPOTrainer argument); pass one")
    teacher = teacher if teacher is not None else args.teacher_model
    if teacher is not None and not args.distillation_coef:
        raise CohortError(unused_teacher(args.distillation_coef))
    if teacher is None and args.distillation_coef:
        raise CohortError(refusal("distillation_coef", args.distillation_coef, ": there is no teacher to distil "
                                  "from", "name one with --teacher_model, or set --distillation_coef 0"))
    return teacher


def teacher_dtype(args, device: torch.device) -> str:
    """The dtype a named teacher loads in: teacher_model_init_kwargs' dtype (or torch_dtype), else the run's weights'."""
    kwargs = dict(args.teacher_model_init_kwargs or {})
    unknown = sorted(set(kwargs) - set(DTYPE_KEYS))
    if unknown:
        raise CohortError(f"teacher_model_init_kwargs={kwargs!r}: cohort takes only dtype there (got {unknown}); "
                          "the teacher loads as the policy does otherwise (trust_remote_code, model_impl)")
    asked = next((str(kwargs[k]).removeprefix("torch.") for k in DTYPE_KEYS if kwargs.get(k) is not None), "auto")
    return resolve_dtype(args.dtype if asked == "auto" else asked, device)


def load_teacher(teacher, args, tokenizer, device: torch.device, log=print) -> nn.Module:
    """The teacher as a frozen, LoRA-free module in eval mode on `device`; a vocabulary other than the student's
    `tokenizer`'s, or LoRA adapters on a model object, refused in one line."""
    if isinstance(teacher, nn.Module):
        if has_lora(teacher):
            raise CohortError("teacher_model has LoRA adapters: merge them into its weights first "
                              "(peft's merge_and_unload()) and pass the merged model")
        model = teacher.to(device)
        check_rows(model, tokenizer)
    else:
        model, teacher_tokenizer = load_policy(teacher, device=device, dtype=teacher_dtype(args, device), log=log,
                                               trust_remote_code=args.trust_remote_code, impl=args.model_impl)
        if teacher_tokenizer.get_vocab() != tokenizer.get_vocab():
            raise CohortError(f"teacher_model={str(teacher)!r} has another vocabulary than the policy's "
                              f"({len(teacher_tokenizer)} tokens against {len(tokenizer)}): its log-probs would be of "
                              "other tokens; distil from a teacher of the student's tokenizer")
    model.eval()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    return model


def check_rows(model: nn.Module, tokenizer) -> None:
    """A teacher given as an object is taken to share the student's tokenizer; one whose LM head has fewer rows
    than that tokenizer has tokens cannot score them."""
    inner = getattr(model, "module", model)
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else getattr(inner, "lm_head", None)
    rows = getattr(head, "weight", None)
    if rows is not None and rows.shape[0] < len(tokenizer):
        raise CohortError(f"teacher_model's LM head has {rows.shape[0]} rows for the policy tokenizer's "
                          f"{len(tokenizer)} tokens: it has another vocabulary; distil from a teacher of the "
                          "student's tokenizer")


def teacher_policy(teacher, args, *, tokenizer, device: torch.device, policy: nn.Module, logprobs,
                   log=print) -> TeacherPolicy | None:
    """The run's `TeacherPolicy` stage (None without a teacher): `teacher` as `teacher_given` returned it,
    loaded; `policy` π_θ; `logprobs` the policy update's no-grad log-prob pass."""
    if teacher is None:
        return None
    model = load_teacher(teacher, args, tokenizer, device, log)
    layout = Layout.choose(args.share_prompt_prefix, args.num_generations, supports_hidden(model))
    return TeacherPolicy(model, policy, logprobs, layout, args.distillation_coef, args.distillation_discount)
