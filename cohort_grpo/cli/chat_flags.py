"""The flags of `cohort-grpo chat` and `cohort-grpo generate` (their argparse parsers), without torch: `--help` and a
bad option answer at once, before the modules that load a model are imported."""

from __future__ import annotations

import argparse

from cohort_grpo.tools.call_execution import DEFAULT_TIMEOUT_S
from cohort_grpo.tools.toolbox import TOOLS_FILE

DEFAULT_MAX_ITERATIONS = 5


def chat_parser() -> argparse.ArgumentParser:
    """`cohort-grpo chat [MODEL_DIR] [options]`."""
    parser = argparse.ArgumentParser(prog="cohort-grpo chat", description="Chat with a model; /reset clears, "
                                     "/image PATH attaches an image to the next message, /exit quits.")
    model_flags(parser)
    parser.add_argument("--image", action="append", default=[], metavar="PATH",
                        help="an image file for the first message (repeatable; a vision-language model: Qwen-VL, "
                        "Gemma 3)")
    common_flags(parser, temperature=0.7)
    add_tool_flags(parser)
    return parser


def generate_parser() -> argparse.ArgumentParser:
    """`cohort-grpo generate [MODEL_DIR] --prompts FILE [--output out.jsonl] [options]`."""
    parser = argparse.ArgumentParser(prog="cohort-grpo generate", description="Complete every prompt of a file.")
    model_flags(parser)
    parser.add_argument("--prompts", required=True, help=".txt (one prompt a line, completed after the line's "
                        "newline, as training prompts end) or .jsonl with a 'prompt' column (completed exactly as "
                        "written)")
    parser.add_argument("--output", default=None, help="JSONL file to write (default: standard output)")
    parser.add_argument("--num_generations", type=int, default=1, help="completions per prompt (default 1)")
    parser.add_argument("--chat", action="store_true", help="wrap plain-text prompts as one user message "
                        "with the chat template (message-list prompts always get it)")
    common_flags(parser, temperature=0.7)
    return parser


def model_flags(parser: argparse.ArgumentParser) -> None:
    """The model, given as the first argument or as --model (train's and eval's spelling); `parsed` settles it."""
    parser.add_argument("model", nargs="?", default=None, metavar="MODEL_DIR",
                        help="HF folder, .gguf file or hub id (default: runs/arithmetic if trained, else the tiny model)")
    parser.add_argument("--model", dest="model_option", default=None, metavar="MODEL_DIR",
                        help="the same as MODEL_DIR, as train and eval name it")


def parsed(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """`parser`'s arguments, the model settled from MODEL_DIR or --model (both, when they differ, is an error)."""
    args = parser.parse_args(argv)
    if args.model is not None and args.model_option is not None and args.model != args.model_option:
        parser.error(f"the model is given twice ({args.model!r} and --model {args.model_option!r}): give one")
    args.model = args.model if args.model is not None else args.model_option
    return args


def common_flags(parser: argparse.ArgumentParser, temperature: float) -> None:
    parser.add_argument("--max_new_tokens", type=int, default=256, help="most tokens per reply (default 256)")
    parser.add_argument("--temperature", type=float, default=temperature, help=f"0 = greedy (default {temperature})")
    parser.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling mass (default 1.0 = off)")
    parser.add_argument("--seed", type=int, default=None, help="seed for reproducible samples")
    parser.add_argument("--system", default=None, help="a system message put before the conversation")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda (default auto)")
    parser.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU) | float32 | bfloat16")
    parser.add_argument("--model_impl", default="auto", choices=("auto", "cohort", "hf"),
                        help="as in train: cohort's engine (its own models, or transformers' modules for other "
                        "decoder-only types) or hf (transformers and generate); default auto")
    if "chat" in parser.prog:
        parser.add_argument("--raw", action="store_true", help="no chat format and no history: each line is "
                            "completed as it is (base models, the built-in arithmetic model)")


def add_tool_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tools", default=None, metavar="SPECS",
                        help="tools the model may call: module:function,... (typed functions with Google-style "
                        "docstrings; 'run_python' is the built-in sandbox); 'none': no tools, whatever "
                        f"MODEL_DIR/{TOOLS_FILE} says (default: the tools of MODEL_DIR/{TOOLS_FILE}, if any)")
    parser.add_argument("--environment", default=None, metavar="MODULE:CLASS",
                        help="an environment class, instantiated for each conversation: its public methods are "
                        "tools, and the text its reset() returns is appended to the first message")
    parser.add_argument("--max_tool_calling_iterations", type=int, default=None, metavar="N",
                        help=f"most rounds of tool calls in one reply (default: {TOOLS_FILE}'s, else "
                        f"{DEFAULT_MAX_ITERATIONS})")
    parser.add_argument("--tool_timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                        help=f"seconds one tool call may run (default {DEFAULT_TIMEOUT_S:g})")
