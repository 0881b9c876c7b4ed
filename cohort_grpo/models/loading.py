"""Model files into `CausalLM`: find them (local folder, hub id, GGUF file), read them, check them.

Weights are read only from safetensors (or GGUF, `gguf.py`), never from pickle files. Writing goes
the other way in `causal_lm.save_pretrained`; turning whatever the user named (nothing, a model
object, a model transformers implements) into a policy and its tokenizer is `policy.py`.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import ssl
import urllib.error
import urllib.request
from pathlib import Path

import torch
from safetensors import safe_open

from cohort_grpo.errors import CohortError
from cohort_grpo.models.config import SUPPORTED_MODEL_TYPES, ModelConfig, is_supported
from cohort_grpo.models.causal_lm import CausalLM
from cohort_grpo.models.moe import fuse_expert_weights

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
HUB_FILES = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
             "tokenizer*", "special_tokens_map.json", "vocab.json", "merges.txt", "*.model", "chat_template*"]
# A name that ends like one of these is a file the user means, never a hub repository.
FILE_SUFFIXES = {".gguf", ".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".json", ".jsonl", ".onnx", ".model"}
HUB_PROBE_TIMEOUT_S = 5.0  # one request to the hub's front page decides whether to try it at all
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def resolve_dtype(dtype, default: torch.dtype = torch.float32) -> torch.dtype:
    """A torch dtype from a dtype, a name ("bfloat16", "bf16", ...) or None/"auto" (-> default)."""
    if dtype is None or dtype == "auto":
        return default
    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise CohortError(f"unknown dtype {dtype!r}: use one of float32, bfloat16, float16")
    return DTYPES[name]


def _find_model(path_or_id, gguf_file: str | None) -> tuple[str, Path]:
    """("hf", folder) or ("gguf", file) for a local path or hub id; downloads hub ids."""
    path = Path(path_or_id).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return "gguf", path
    if path.is_dir():
        if gguf_file is not None:
            if not (path / gguf_file).is_file():
                raise CohortError(f"no GGUF file {gguf_file!r} in {path}: check the file name")
            return "gguf", path / gguf_file
        if (path / "config.json").is_file():
            return "hf", path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return "gguf", ggufs[0]
        if ggufs:
            names = ", ".join(p.name for p in ggufs)
            raise CohortError(f"{path} holds several GGUF files ({names}): name one, e.g. {path / ggufs[0].name}")
        if (path / "adapter_config.json").is_file():
            raise adapter_folder_error(path)
        raise CohortError(f"{path} is not a model folder: it has no config.json (nor a .gguf file)")
    if path.exists():
        raise CohortError(f"{path} is not a model: give a folder with config.json + *.safetensors or a .gguf file")
    spec = str(path_or_id)
    if looks_local(spec):
        raise missing_path_error(spec)
    if is_hub_id(spec):
        return "hf", _download(spec, gguf_file)
    raise CohortError(
        f"no model at {path_or_id!r}: give a local folder (config.json + *.safetensors), a .gguf file, "
        "or a Hugging Face hub id like HuggingFaceTB/SmolLM2-135M-Instruct"
    )


# ---- local path or hub id ------------------------------------------------------------------------
def adapter_folder_error(path: Path) -> CohortError:
    """A peft adapter folder given as a model: the folder of merged weights beside it (a LoRA run's output folder
    holds its merged policy and, in adapter/, the adapters alone), else the base model its config names."""
    if (path.parent / "config.json").is_file():
        fix = f"pass {path.parent}, the run's policy with the adapters merged"
    else:
        try:
            base = json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path")
        except (OSError, ValueError):
            base = None
        fix = (f"pass its base model{f' ({base})' if base else ''} and merge the adapters into it with peft "
               "(merge_and_unload) first")
    return CohortError(f"{path} is a LoRA adapter (peft's adapter_config.json), not a whole model: {fix}")


def is_hub_id(spec: str) -> bool:
    """Shaped like a hub repository id, `org/name`, and not like a local path (`looks_local`)."""
    return bool(HUB_ID.match(spec)) and not looks_local(spec)


def looks_local(spec: str) -> bool:
    """Whether a model name that does not exist here is a mistyped local path rather than a hub id: it
    starts with ./ ../ / ~ (or is absolute), has a backslash or more than one slash, ends in a model
    file's suffix, is not a valid `org/name` id, or its first component is a folder here (`runs/nope`
    when runs/ exists). A bare name without a slash is neither."""
    spec = str(spec)
    if spec in (".", "..") or spec.startswith(("./", "../", "~", "/")) or os.path.isabs(spec) or "\\" in spec:
        return True
    if Path(spec).suffix.lower() in FILE_SUFFIXES:
        return True
    if "/" not in spec:
        return False
    if spec.rstrip("/").count("/") > 1 or not HUB_ID.match(spec):
        return True
    return Path(spec.split("/", 1)[0]).is_dir()


def missing_path_error(spec: str) -> CohortError:
    """One line for a local model path that does not exist, naming the nearest folder that does and
    what it holds (and the closest name there, when one is close)."""
    typed = spec.rstrip("/") or spec
    kind = "file" if Path(typed).suffix.lower() in FILE_SUFFIXES else "folder"
    parent = os.path.dirname(typed)
    while parent and not Path(parent).expanduser().is_dir():
        up = os.path.dirname(parent)
        if up == parent:
            break
        parent = up
    folder = Path(parent or ".").expanduser()
    shown = "the current folder" if not parent else parent if parent.endswith("/") else parent + "/"
    try:
        entries = sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")
                         and (p.is_dir() or p.suffix.lower() == ".gguf"))
    except OSError:
        entries = []
    if entries:
        listed = ", ".join(entries[:10]) + (f", … ({len(entries) - 10} more)" if len(entries) > 10 else "")
        contents = f"{shown} has: {listed}"
    else:
        contents = f"{shown} has no subfolders"
    missing = typed[len(parent):].lstrip("/").split("/")[0] if parent else typed.split("/")[0]
    close = difflib.get_close_matches(missing, entries, n=1, cutoff=0.6)
    hint = f"did you mean {os.path.join(parent, close[0])!r}? Else " if close else ""
    return CohortError(f"model {kind} {spec!r} does not exist ({contents}); {hint}pass an existing {kind} "
                       "or a hub id")


def hub_endpoint() -> str:
    try:
        from huggingface_hub import constants

        default = constants.ENDPOINT
    except ImportError:
        default = "https://huggingface.co"
    return (os.environ.get("HF_ENDPOINT") or default).rstrip("/")


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or the older TRANSFORMERS_OFFLINE / HF_DATASETS_OFFLINE) is set."""
    return any(os.environ.get(name, "").strip().upper() in ("1", "ON", "YES", "TRUE")
               for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"))


_PROBES: dict[str, str | None] = {}


def hub_unreachable(timeout_s: float = HUB_PROBE_TIMEOUT_S) -> str | None:
    """Why the Hugging Face hub cannot be reached (e.g. "[Errno -2] Name or service not known"), or None
    when it answers. One request with a short timeout, remembered for the process: the hub's own client
    would retry a dead connection for half a minute before saying the same. Any HTTP answer (even an
    error status) or a TLS failure counts as reachable: the hub's client then reports what is wrong."""
    endpoint = hub_endpoint()
    if endpoint not in _PROBES:
        reason = None
        try:
            urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=timeout_s).close()
        except urllib.error.HTTPError:
            pass
        except urllib.error.URLError as error:
            cause = error.reason
            if not isinstance(cause, ssl.SSLError):
                reason = str(cause.strerror if isinstance(cause, OSError) and cause.strerror else cause) or "no answer"
        except (TimeoutError, ConnectionError, OSError) as error:
            reason = str(error) or f"no answer within {timeout_s:g}s"
        except ValueError as error:  # a malformed HF_ENDPOINT
            reason = f"invalid endpoint ({error})"
        _PROBES[endpoint] = reason
    return _PROBES[endpoint]


def _download(repo_id: str, gguf_file: str | None = None) -> Path:
    """The local snapshot of a hub repository: from the cache when the hub is offline or unreachable
    (one quick check, no retries), else downloaded. Every failure is one line."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError as error:
        raise CohortError(f"cannot fetch {repo_id!r}: huggingface_hub is not installed (pip install huggingface_hub)") from error
    patterns = HUB_FILES + ([gguf_file] if gguf_file else [])
    offline = hub_offline()
    unreachable = None if offline else hub_unreachable()
    if offline or unreachable:
        try:
            return Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True))
        except Exception:  # noqa: BLE001 — not in the cache: the one-line error below
            pass
        if offline:
            raise CohortError(f"{repo_id!r} is no local folder and not in the Hugging Face cache, and HF_HUB_OFFLINE "
                              "is set; pass an existing folder, or unset HF_HUB_OFFLINE to download it")
        raise CohortError(f"{repo_id!r} is no local folder, not in the Hugging Face cache, and the hub cannot be "
                          f"reached to fetch it ({hub_endpoint()}: {unreachable}); pass an existing folder, or "
                          "retry once the hub can be reached")
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as error:  # auth, missing repo, a network failure mid-way: all user-fixable
        raise CohortError(f"cannot fetch {repo_id!r} from the Hugging Face hub: {one_line(error)}; pass an "
                          "existing folder or check the hub id") from error


def one_line(error: BaseException) -> str:
    """`Type: first line of the message`, for errors whose text runs over several lines."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def read_hf_config(folder: Path) -> ModelConfig:
    try:
        hf = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as error:
        raise CohortError(f"cannot read {folder / 'config.json'}: {error}") from error
    if not is_supported(hf):
        raise CohortError(
            f"{folder} has model_type {hf.get('model_type')!r}, which cohort does not implement; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return ModelConfig.from_hf_dict(hf)


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of an HF folder: the shards its index names (all present), else model.safetensors,
    else every *.safetensors; no weights (or only pickle files) is a `CohortError`."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as error:
            raise CohortError(f"cannot read {index}: {error}; re-download the model") from error
        files = [folder / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise CohortError(f"{folder} lacks weight shards {', '.join(absent)} named in {index.name}; re-download it")
        return files
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return files
    pickled = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt")]
    hint = f" (found {', '.join(pickled)}: cohort never loads pickle files; convert to safetensors)" if pickled else ""
    raise CohortError(f"{folder} has no *.safetensors weights{hint}")


def read_safetensors(files: list[Path], device="cpu") -> dict[str, torch.Tensor]:
    state = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device=str(device)) as reader:
                for name in reader.keys():
                    state[name] = reader.get_tensor(name)
        except Exception as error:  # safetensors raises its own SafetensorError / OSError for bad headers
            raise CohortError(f"corrupt or unreadable safetensors file {file}: {error}; re-download or re-save it") from error
    return state


def build_model(config: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype, device,
                source: str) -> CausalLM:
    """A `CausalLM` holding `state` (HF names), checked for missing / unexpected / misshapen tensors."""
    state = fuse_expert_weights({k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")})
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # transformers also uses the embedding then
    with torch.device("meta"):
        model = CausalLM(config)
    expected = {k for k in model.state_dict() if not (config.tie_word_embeddings and k == "lm_head.weight")}
    missing, unexpected = sorted(expected - state.keys()), sorted(state.keys() - expected)
    if missing:
        raise CohortError(f"{source} lacks tensors {', '.join(missing[:5])}{' …' if len(missing) > 5 else ''}; "
                          "the checkpoint is incomplete or not a standard transformers layout")
    if unexpected:
        raise CohortError(f"{source} has tensors this {config.model_type} config does not use: "
                          f"{', '.join(unexpected[:5])}; check that config.json matches the weights")
    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    try:
        model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as error:
        raise CohortError(f"{source} tensor shapes do not match its config: {error}".splitlines()[0]) from error
    model.tie_weights()
    return model.to(device=device)


def from_pretrained(path_or_id, dtype=None, device=None, gguf_file: str | None = None) -> CausalLM:
    """Load a local HF folder (config.json + safetensors, sharded or not), a hub id or a GGUF file.

    dtype None / "auto" keeps the checkpoint's dtype (config.json's torch_dtype; float32 for GGUF,
    whose quantised weights are dequantised); device None = CPU. Returns the model in eval mode.
    """
    device = torch.device(device or "cpu")
    kind, path = _find_model(path_or_id, gguf_file)
    if kind == "gguf":
        from cohort_grpo.models.gguf import load_gguf

        config, state = load_gguf(path)
        model = build_model(config, state, resolve_dtype(dtype), device, str(path))
    else:
        config = read_hf_config(path)
        stored = resolve_dtype(config.torch_dtype) if config.torch_dtype in DTYPES else torch.float32
        model = build_model(config, read_safetensors(safetensors_files(path)), resolve_dtype(dtype, stored),
                            device, str(path))
    model.config.torch_dtype = str(model.dtype).removeprefix("torch.")
    return model.eval()


def load_tokenizer(path_or_id, gguf_file: str | None = None, trust_remote_code: bool = False):
    """The HF tokenizer of a model folder, hub id or GGUF file (transformers reads GGUF vocabularies)."""
    from transformers import AutoTokenizer

    folder = Path(path_or_id).expanduser()
    has_tokenizer_files = any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json"))
    kind, path = ("hf", folder) if gguf_file is None and has_tokenizer_files else _find_model(path_or_id, gguf_file)
    try:
        if kind == "gguf":
            return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except Exception as error:
        raise CohortError(f"cannot load a tokenizer from {path}: {type(error).__name__}: {error}".splitlines()[0]) from error
