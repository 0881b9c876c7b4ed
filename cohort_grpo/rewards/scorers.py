"""Reward-model networks: a transformer with a scalar head that scores prompt + completion.

Three kinds, one interface (`forward(input_ids, attention_mask, completion_mask=None) -> scores [B]`;
`completion_mask` marks the completion's tokens):

- `CausalLMScorer`: our own decoder (`cohort_grpo.models.CausalLM`, `return_hidden=True`) and a
  `score = Linear(hidden, 1, bias=False)` read at the last real token, as in transformers'
  `LlamaForSequenceClassification` (the InstructGPT reward model, Ouyang et al. 2022, reads the
  final token the same way). Its saved folder uses exactly that class's layout (`model.*`,
  `score.weight`, `architectures: [...ForSequenceClassification]`), so transformers loads it too.
- `LikelihoodScorer`: our own decoder read as a generative verifier, score = a · log π_φ(completion |
  prompt) + b with a learned scalar pair (a, b) (the `score` head, Linear(1, 1)). Trained by the same
  labels, BCE on this score raises the LM's probability of correct completions and lowers that of wrong
  ones, so the trunk's own next-token skill does the checking — as in generative reward models /
  verifiers (Zhang et al. 2024, "Generative Verifiers"; Yuan et al. 2024, "Free Process Rewards without
  Process Labels", which trains an LM's log-likelihood ratio with an outcome-label cross-entropy). A
  last-token head must instead learn verification from scratch, which the tiny arithmetic model does not
  within our budget (docs/history/benchmarks-2026-11.md, "Learned reward model with replay"). It saves as
  a causal-LM folder plus two config keys.
- `SequenceClassifierScorer`: any transformers `AutoModelForSequenceClassification` with one label.

Our two scorers expose `features(...) -> [B, F]` and `score` (the final Linear), so the head alone can be
fitted on frozen features first (a linear probe before fine-tuning, Kumar et al. 2022, "Fine-Tuning can
Distort Pretrained Features").

`load_scorer(folder)` picks the first for the families we implement and the second otherwise; a
causal-LM folder (no `score.weight`) gets a fresh zero head, so r_φ can start from a policy's weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from cohort_grpo.config.choices import CHOICES
from cohort_grpo.errors import CohortError

REWARD_OUTPUT_KEY = "cohort_reward_output"  # config.json key: "probability" or "logit"
SCORER_KEY = "cohort_scorer"  # config.json key of a likelihood scorer: "likelihood"
LIKELIHOOD_HEAD_KEY = "cohort_likelihood_head"  # its [a, b]
SCORERS = CHOICES["rm_scorer"]


class CausalLMScorer(nn.Module):
    def __init__(self, backbone, score: nn.Linear | None = None):
        super().__init__()
        self.backbone = backbone
        hidden = backbone.config.hidden_size
        if score is None:  # a zero head scores every text equally: no random preference before training
            score = nn.Linear(hidden, 1, bias=False, device=backbone.device, dtype=backbone.dtype)
            nn.init.zeros_(score.weight)
        self.score = score

    def features(self, input_ids, attention_mask, completion_mask=None) -> torch.Tensor:
        """[B, H]: the final hidden state at the last real token (right padding)."""
        hidden = self.backbone(input_ids, attention_mask=attention_mask, return_hidden=True)  # [B, T, H]
        last = attention_mask.sum(dim=1).clamp(min=1) - 1
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]

    def forward(self, input_ids, attention_mask, completion_mask=None) -> torch.Tensor:
        return self.score(self.features(input_ids, attention_mask)).squeeze(-1).float()

    def save_pretrained(self, out_dir, extra_config: dict | None = None) -> Path:
        from cohort_grpo.models.config import ARCHITECTURES
        from cohort_grpo.models.files import save_safetensors

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        config = self.backbone.config.to_hf_dict()
        config["architectures"] = [ARCHITECTURES[config["model_type"]].replace("ForCausalLM", "ForSequenceClassification")]
        config.update({"id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}, "torch_dtype": str(self.backbone.dtype).removeprefix("torch.")})
        config.update(extra_config or {})
        (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        state = {k: v.detach().to("cpu").contiguous() for k, v in self.backbone.state_dict().items()
                 if not k.startswith("lm_head.")}  # a sequence classifier has no LM head
        state["score.weight"] = self.score.weight.detach().to("cpu").contiguous()
        save_safetensors(state, out / "model.safetensors")
        return out


class LikelihoodScorer(nn.Module):
    def __init__(self, backbone, head: tuple[float, float] = (0.0, 0.0)):
        super().__init__()
        self.backbone = backbone
        self.score = nn.Linear(1, 1, device=backbone.device, dtype=torch.float32)  # (a, b); zero: no preference
        with torch.no_grad():
            self.score.weight.fill_(float(head[0]))
            self.score.bias.fill_(float(head[1]))

    def features(self, input_ids, attention_mask, completion_mask=None) -> torch.Tensor:
        """[B, 1]: log π_φ(completion | prompt), the sum over the tokens `completion_mask` marks (all real
        tokens but the first when it is None)."""
        if completion_mask is None:
            completion_mask = attention_mask.clone()
            completion_mask[:, 0] = 0
        hidden = self.backbone(input_ids, attention_mask=attention_mask, return_hidden=True)[:, :-1]
        logits = (hidden @ self.backbone.lm_head.weight.T).float()  # position t predicts token t + 1
        token_logprobs = torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
        return (token_logprobs * completion_mask[:, 1:].to(token_logprobs.dtype)).sum(dim=1, keepdim=True)

    def forward(self, input_ids, attention_mask, completion_mask=None) -> torch.Tensor:
        return self.score(self.features(input_ids, attention_mask, completion_mask)).squeeze(-1)

    def save_pretrained(self, out_dir, extra_config: dict | None = None) -> Path:
        out = self.backbone.save_pretrained(out_dir)  # a causal LM that transformers loads as one
        config = json.loads((out / "config.json").read_text())
        config.update({SCORER_KEY: "likelihood",
                       LIKELIHOOD_HEAD_KEY: [float(self.score.weight.detach()), float(self.score.bias.detach())]}, **(extra_config or {}))
        (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        return out


class SequenceClassifierScorer(nn.Module):
    def __init__(self, model, pad_token_id: int | None = None):
        super().__init__()
        num_labels = getattr(model.config, "num_labels", None)
        if num_labels != 1:
            raise CohortError(f"a reward model needs one output (num_labels=1), this one has num_labels={num_labels}; "
                              "load it with AutoModelForSequenceClassification.from_pretrained(..., num_labels=1)")
        if model.config.pad_token_id is None:  # transformers finds the last real token through the pad id
            model.config.pad_token_id = pad_token_id
        self.model = model

    def forward(self, input_ids, attention_mask, completion_mask=None) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits[:, 0].float()

    def save_pretrained(self, out_dir, extra_config: dict | None = None) -> Path:
        for key, value in (extra_config or {}).items():
            setattr(self.model.config, key, value)
        from cohort_grpo.models.policy import save_transformers_model

        save_transformers_model(self.model, Path(out_dir))
        return Path(out_dir)


def as_scorer(model, pad_token_id: int | None = None, kind: str = "head") -> nn.Module:
    """Wrap a model object as a scorer: a scorer as is, our `CausalLM` with a fresh head (`kind`: "head"
    or "likelihood"), or a transformers sequence classifier."""
    from cohort_grpo.models import CausalLM

    if kind not in SCORERS:
        raise CohortError(f"unknown rm_scorer {kind!r}; choose one of {list(SCORERS)}")
    if isinstance(model, (CausalLMScorer, LikelihoodScorer, SequenceClassifierScorer)):
        return model
    if isinstance(model, CausalLM):
        return LikelihoodScorer(model) if kind == "likelihood" else CausalLMScorer(model)
    if isinstance(model, nn.Module) and type(model).__name__.endswith("ForSequenceClassification"):
        return SequenceClassifierScorer(model, pad_token_id)
    raise CohortError(f"cannot use a {type(model).__name__} as a reward model; pass a folder, a cohort CausalLM "
                      "or a transformers AutoModelForSequenceClassification")


def load_scorer(folder, device=None, dtype: str | None = None, kind: str = "head") -> tuple[nn.Module, object, bool, dict]:
    """(scorer, tokenizer, has_trained_head, config.json) from a model folder. A causal-LM folder becomes
    a `kind` scorer with a fresh zero head; a saved likelihood scorer comes back as one."""
    from cohort_grpo.models import is_supported, load_tokenizer
    from cohort_grpo.models.loading import build_model, read_hf_config, read_safetensors, resolve_dtype, safetensors_files

    path = Path(folder).expanduser()
    try:
        hf = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as error:
        raise CohortError(f"reward model folder {folder} has no readable config.json ({error}); "
                          "pass a Hugging Face model folder") from None
    device = torch.device(device or "cpu")
    tokenizer = load_tokenizer(str(path))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if is_supported(hf):
        state = read_safetensors(safetensors_files(path))
        head = state.pop("score.weight", None)
        config = read_hf_config(path)
        if "lm_head.weight" not in state and not config.tie_word_embeddings:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]  # unused by a scorer; fills the slot
        backbone = build_model(config, state, resolve_dtype(dtype), device, str(path))
        if hf.get(SCORER_KEY) == "likelihood" or (kind == "likelihood" and head is None):
            saved = hf.get(LIKELIHOOD_HEAD_KEY)
            return LikelihoodScorer(backbone, saved or (0.0, 0.0)), tokenizer, saved is not None, hf
        score = None
        if head is not None:
            if head.shape != (1, config.hidden_size):
                raise CohortError(f"{path}: score.weight has shape {tuple(head.shape)}, a reward model needs "
                                  f"(1, {config.hidden_size}): one output")
            score = nn.Linear(config.hidden_size, 1, bias=False, device=device, dtype=backbone.dtype)
            with torch.no_grad():
                score.weight.copy_(head)
        return CausalLMScorer(backbone, score), tokenizer, head is not None, hf
    from transformers import AutoModelForSequenceClassification

    try:
        model = AutoModelForSequenceClassification.from_pretrained(
            str(path), num_labels=1, dtype=getattr(torch, dtype) if dtype else torch.float32)
    except (OSError, ValueError) as error:
        raise CohortError(f"cannot load a reward model from {folder}: {str(error).splitlines()[0]}") from None
    trained = any(a.endswith("ForSequenceClassification") for a in hf.get("architectures") or [])
    return SequenceClassifierScorer(model.to(device), tokenizer.pad_token_id), tokenizer, trained, hf
