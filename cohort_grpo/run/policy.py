"""The policy the user named, as (model, tokenizer).

`load_policy` takes whatever `--model` / `GRPOTrainer(model=...)` was given: nothing (the built-in
tiny model, `cohort_grpo.sft.builtin`), a model object, a local folder, a .gguf file or a hub id. Order of preference:
our own implementation (`CausalLM`, which the fast engine samples from) for the families it
supports, read by `cohort_grpo.models.loading`; otherwise Hugging Face's `AutoModelForCausalLM`, wrapped in
`TransformersCausalLM` so that the engine samples it too (`generic_policy`; `--model_impl hf` or a model the
generic path refuses keeps it bare, sampled through `generate`). `load_run_policy` loads a rank's policy as the
run's config says. Saving is `cohort_grpo.models.policy.save_policy`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from cohort_grpo.errors import CohortError
from cohort_grpo.models import tiny
from cohort_grpo.models.config import is_supported
from cohort_grpo.models.exact_layers import use_exact_numerics
from cohort_grpo.models.generic import GenericPathRefused, TransformersCausalLM
from cohort_grpo.models.generic_training import is_mixture_of_experts
from cohort_grpo.models.loading import (from_pretrained, hub_offline, hub_unreachable, is_hub_id, load_tokenizer, looks_local,
                                   missing_path_error, one_line)
from cohort_grpo.models.causal_lm import CausalLM
from cohort_grpo.models.dropout import active_dropouts, disable_dropout
from cohort_grpo.models.lora import apply_lora, base_model, has_lora, lora_config_from_args
from cohort_grpo.models.tiny_vision import (IMAGE_ONLY_PROCESSOR, TINY_VISION_MODEL, build_vision_model,
                                           build_vision_processor, image_only_processor_class)
from cohort_grpo.models.vision_language import VisionLanguageModel, is_vision_language
from cohort_grpo.optim.precision import resolve_dtype
from cohort_grpo.sft import builtin


def _hf_model_type(path: Path) -> str | None:
    config = path if path.name == "config.json" else path / "config.json"
    if config.is_file():
        try:
            return json.loads(config.read_text()).get("model_type")
        except json.JSONDecodeError:
            raise CohortError(f"{config} is not valid JSON; the model folder is damaged") from None
    return None


def _has_vision_tower(path: Path) -> bool:
    """Whether the model folder's config.json describes a vision tower (a vision-language model)."""
    config = path / "config.json"
    return config.is_file() and "vision_config" in json.loads(config.read_text())


def hub_model_type(repo_id: str) -> str | None:
    """The model type of hub repository `repo_id` from its config.json alone (fetched, or from the cache when the hub
    is offline or unreachable, as `_load_hf` loads); None where there is none to read, and the native loader then
    fetches (or fails) in its own words."""
    try:
        from huggingface_hub import hf_hub_download

        cache_only = hub_offline() or bool(hub_unreachable())
        config = hf_hub_download(repo_id, "config.json", local_files_only=cache_only)
    except Exception:  # noqa: BLE001 — not in the cache, no such repo, no config.json (a GGUF-only repo)
        return None
    return _hf_model_type(Path(config))


def load_run_policy(model, processing_class, args, device: torch.device, *, peft_config=None, log=print):
    """A rank's policy for a run, the same on trainer and sampling ranks: (model, tokenizer, pad id), loaded as
    `args` says (dtype, implementation, remote code), with LoRA adapters injected in place when asked (`peft_config`,
    else the config's lora options). Padding uses EOS where the tokenizer has no pad token; a tokenizer without
    EOS is refused, since completions could never end."""
    refused = generic_path_refusal(generic_path_type(model, args.model_impl), args)
    if refused is not None:  # the folder's config alone shows it: refused before its weights load
        raise CohortError(refused)
    model, tokenizer = load_policy(model, processing_class, device=device, log=log,
                                   dtype=resolve_dtype(args.dtype, device), trust_remote_code=args.trust_remote_code,
                                   impl=args.model_impl)
    refused, notice = loaded_policy_refusal(model, args), generic_path_notice(model, args)
    if refused is not None:
        raise CohortError(refused)
    if notice is not None:
        log(notice)
    peft_config = peft_config if peft_config is not None else lora_config_from_args(args)
    if isinstance(model, VisionLanguageModel):
        model.freeze_vision_tower(args.freeze_vision_tower)
        if peft_config is not None:
            peft_config = model.language_lora_config(peft_config)
    if peft_config is not None:  # π_ref is then the base model (adapters off)
        apply_lora(model, peft_config)
    if args.disable_dropout:
        disable_dropout(model)
    elif active := [name for name in active_dropouts(model) if "lora_dropout" not in name]:  # LoRA's: asked for
        log(f"dropout: {len(active)} dropout layers of this model act in the update (e.g. {active[0]}) but not in "
            "the passes of π_old and π_ref, which adds noise to the ratio and the KL; --disable_dropout true "
            "turns them off (TRL's option)")
    if args.rollout_numerics == "exact":
        use_exact_numerics(model, device)
    if tokenizer.eos_token_id is None:
        raise CohortError("the tokenizer has no EOS token; completions could never end — set tokenizer.eos_token")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return model, tokenizer, pad_id


def generic_path_notice(model, args) -> str | None:
    """The one line a run on the generic path gets where a default it keeps cannot apply: routing replay (on by
    default) on a mixture-of-experts model, whose transformers expert blocks record no routes. A notice, not a
    refusal: replay narrows the gap between π_old's and π_θ's routes, the run learns without it."""
    if isinstance(model, TransformersCausalLM) and args.routing_replay and is_mixture_of_experts(model.config):
        return (f"cohort: {model.model_type} runs through transformers' modules (the generic path), whose expert "
                "blocks record no routes: it trains without routing replay (--routing_replay false says so)")
    return None


def generic_path_type(model, impl: str) -> str | None:
    """The model type of a folder or hub id `model` that will load through transformers' modules (the generic
    path, or generate where that refuses it), read from its config.json alone; None for a native type, a vision
    folder, a .gguf file, a model object, `impl` hf, or where there is no config to read."""
    if impl == "hf" or not isinstance(model, (str, Path)) or tiny.is_builtin_model(str(model)):
        return None
    spec = str(model)
    path = Path(spec).expanduser()
    if path.is_dir():
        model_type = None if _has_vision_tower(path) else _hf_model_type(path)
    else:
        model_type = hub_model_type(spec) if is_hub_id(spec) and not path.exists() else None
    return None if model_type is None or is_supported({"model_type": model_type}) else model_type


def loaded_policy_refusal(model, args) -> str | None:
    """Why the loaded policy cannot run as `args` ask, in one line naming the option and the fix: what only
    cohort's own models do, asked of the generic path (`generic_path_refusal`) or of transformers' model."""
    base = base_model(model)
    if isinstance(base, TransformersCausalLM):
        return generic_path_refusal(base.model_type, args)
    if args.torch_compile is True and not hasattr(base, "compile_for_training"):
        return (f"torch_compile=true compiles the decoder layers of cohort's own models; {type(base).__name__} is "
                "transformers' (sampled with generate): use --torch_compile auto")
    return None


def generic_path_refusal(model, args) -> str | None:
    """Why the run `args` asks the generic path for what only cohort's own models do, in one line naming the option
    and the fix; None where nothing is refused, or for a native or bare transformers model. `model`: a loaded
    model, or the model type the generic path will serve (`generic_path_type`, None: nothing to refuse)."""
    if isinstance(model, torch.nn.Module):
        if not isinstance(model, TransformersCausalLM):
            return None
        model = model.model_type
    if model is None:
        return None
    where = f"{model} runs through transformers' modules (the generic path)"
    if args.rollout_numerics == "exact":
        return f"rollout_numerics=exact needs cohort's own models; {where}: use --rollout_numerics fast"
    size = args.rollout_tensor_parallel_size
    if size != "auto" and int(size) > 1:
        return (f"rollout_tensor_parallel_size={size} needs cohort's own models (Llama, Mistral, Qwen2, Qwen3, "
                f"Qwen3-MoE, Mixtral); {where}: use --rollout_tensor_parallel_size 1")
    if args.torch_compile is True:
        return f"torch_compile=true compiles the decoder layers of cohort's own models; {where}: use --torch_compile auto"
    return None


def load_policy(model, processing_class=None, *, device=None, dtype="auto", impl: str = "auto", log=print,
                trust_remote_code: bool = False):
    """(model, tokenizer) on `device`. `model`: None, an nn.Module, a folder, a .gguf file or a hub id.
    Python code shipped with a model repo runs only when the user asks for it (--trust_remote_code)."""
    device = torch.device(device or "cpu")
    if isinstance(model, torch.nn.Module) and is_vision_language(getattr(model, "config", None)):
        return vision_policy(model.to(device), processing_class, impl, log)
    if isinstance(model, torch.nn.Module):
        if processing_class is None:
            raise CohortError("a model object needs its tokenizer: pass processing_class=tokenizer")
        return loaded_policy(model.to(device), impl, log), processing_class
    if model == TINY_VISION_MODEL:
        processor = processing_class or build_vision_processor()
        return vision_policy(build_vision_model(processor.tokenizer).to(device), processor, impl, log)
    if model is None:
        model = str(builtin.tiny_model_dir(log=log))
    elif tiny.is_builtin_model(model):  # "cohort:tiny-tools": a built-in model, built on first use
        model = str(builtin.builtin_model_dir(model, log=log))
    spec = str(model)
    path = Path(spec).expanduser()
    if not path.exists() and looks_local(spec):  # a mistyped path: one line naming it, never a hub error
        raise missing_path_error(spec)
    torch_dtype = None if dtype == "auto" else dtype
    if path.is_dir() and _has_vision_tower(path):
        if impl == "hf":
            raise hf_vision_refusal(_hf_model_type(path))
        loaded = _load_hf(spec, torch_dtype, device, trust_remote_code, vision=True)
        return vision_policy(loaded, processing_class or load_processor(spec, trust_remote_code), impl, log)
    tokenizer = processing_class or load_tokenizer(spec, trust_remote_code=trust_remote_code)
    model_type = _hf_model_type(path) if path.is_dir() else hub_model_type(spec) if is_hub_id(spec) else None
    native = path.suffix == ".gguf" or model_type is None or is_supported({"model_type": model_type})
    if impl != "hf" and native:
        policy = from_pretrained(spec, dtype=torch_dtype or "float32", device=device)
    else:
        policy = _load_hf(spec, torch_dtype, device, trust_remote_code)
        if impl != "hf":
            policy = generic_policy(policy, model_type, impl, log)
    if tokenizer.pad_token_id is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return policy, tokenizer


def loaded_policy(model: torch.nn.Module, impl: str, log=print) -> torch.nn.Module:
    """A model object as the user gave it; under `impl` cohort a transformers model that is not yet behind the
    engine's interface is wrapped for it (`generic_policy`: the user's own modules, sampled by the engine), or
    refused in one line. auto and hf keep it as given (sampled with generate unless it is cohort's)."""
    if impl != "cohort" or isinstance(base_model(model), (CausalLM, TransformersCausalLM)):
        return model
    if has_lora(model) or hasattr(model, "get_base_model"):
        raise CohortError("model_impl=cohort takes a model object without adapters: pass the base model with "
                          "peft_config (or --use_peft), or use model_impl auto")
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type is None:
        raise CohortError(f"model_impl=cohort serves transformers causal LMs; a {type(model).__name__} object is not "
                          "one: use model_impl auto")
    return generic_policy(model, model_type, impl, log)


def generic_policy(model, model_type: str, impl: str, log=print):
    """A transformers model of a type cohort does not implement itself, behind the engine's interface
    (`TransformersCausalLM`: its own modules, cohort's attention and KV cache), with one line saying so. One the
    generic path cannot serve stays transformers' (sampled with generate) under `impl` auto, with one line saying
    why; under `impl` cohort it is refused."""
    try:
        wrapped = TransformersCausalLM.wrap(model)
    except GenericPathRefused as refused:
        if impl == "cohort":
            raise CohortError(f"model_impl=cohort cannot serve this model: {refused}; use --model_impl hf") from None
        log(f"cohort: {model_type} takes transformers' generate (model_impl hf): {refused}")
        return model
    what = "a loaded model object" if is_supported({"model_type": model_type}) else \
        "not one of cohort's own implementations"
    log(f"cohort: {model_type} is {what}; it samples in cohort's engine through transformers' own modules "
        "(the generic path)")
    return wrapped


def vision_policy(model, processor, impl: str, log=print):
    """A vision-language model as the engine samples it (`VisionLanguageModel`, its processor kept on it) and the
    processor's tokenizer; one line saying so. Other families, and `impl` hf, are refused by name."""
    if impl == "hf":
        raise hf_vision_refusal(model.config.model_type)
    if processor is None or getattr(processor, "tokenizer", None) is None:
        raise CohortError("a vision-language model needs its processor: pass processing_class=AutoProcessor."
                          "from_pretrained(model)")
    wrapped = VisionLanguageModel.wrap(model)
    wrapped.processor = processor
    log(f"cohort: {wrapped.model_type} samples in cohort's engine, its images through its vision tower once per "
        "prompt (vision-language path)")
    tokenizer = processor.tokenizer
    if tokenizer.pad_token_id is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return wrapped, tokenizer


def hf_vision_refusal(model_type: str) -> CohortError:
    return CohortError(f"{model_type} with model_impl=hf: transformers' generate does not take the images here; use "
                       "--model_impl auto")


def load_processor(spec: str, trust_remote_code: bool = False):
    """The model folder's processor; a folder saved from `cohort:tiny-vision` names a class transformers does not
    know (`IMAGE_ONLY_PROCESSOR`), and loads through it."""
    from transformers import AutoProcessor

    saved = Path(spec) / "processor_config.json"
    try:
        if saved.is_file() and json.loads(saved.read_text()).get("processor_class") == IMAGE_ONLY_PROCESSOR:
            return image_only_processor_class().from_pretrained(spec)
        return AutoProcessor.from_pretrained(spec, trust_remote_code=trust_remote_code)
    except Exception as error:  # noqa: BLE001 - transformers' own reasons, in one line
        raise CohortError(f"cannot load the processor of {spec!r} ({one_line(error)}): pass "
                          "processing_class=the model's processor") from None


def _load_hf(spec: str, dtype, device, trust_remote_code: bool = False, vision: bool = False):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    # A hub id while the hub is offline or unreachable: the cache only (transformers would retry for long).
    cache_only = not Path(spec).expanduser().exists() and is_hub_id(spec) and (hub_offline() or bool(hub_unreachable()))
    try:
        auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
        model = auto.from_pretrained(spec, dtype=getattr(torch, dtype) if dtype else torch.float32,
                                                     trust_remote_code=trust_remote_code,
                                                     **({"local_files_only": True} if cache_only else {}))
    except ValueError as error:  # custom code refused, or a model_type transformers does not know
        if "trust_remote_code" in str(error):
            raise CohortError(f"{spec!r} needs its own Python code to load; cohort runs it only with "
                              "--trust_remote_code (pass it only for a model repo you trust)") from None
        raise CohortError(f"cannot load a model from {spec!r}: {str(error).splitlines()[0]}") from None
    except OSError as error:
        where = " (the Hugging Face hub cannot be reached and it is not in the cache)" if cache_only else ""
        raise CohortError(f"cannot load a model from {spec!r}{where}: {one_line(error)}") from None
    return model.to(device)
