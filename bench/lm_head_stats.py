"""One LM-head chunk's (log π, entropy, logsumexp): the one-pass Triton kernel (cohort_grpo/kernels/logprobs.py)
against torch.compile of the reference `logprobs._chunk_forward`, on a chunk of the benchmark's size
(862 rows × 151,936 bf16 logits, 262 MB). Prints ms per call (triton.testing.do_bench), the bytes
read per second, and the largest differences between the two.

    python bench/lm_head_stats.py     # on a GPU
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cohort_grpo.update.logprobs import _chunk_forward, _maybe_compiled# noqa: E402
from cohort_grpo.kernels.logprobs import chunk_logprob_stats# noqa: E402


def main() -> None:
    torch.manual_seed(0)
    for rows, vocab in ((862, 151_936), (256, 151_936)):
        logits = (3 * torch.randn(rows, vocab, device="cuda")).to(torch.bfloat16)
        tokens = torch.randint(0, vocab, (rows,), device="cuda")
        compiled = _maybe_compiled("forward", _chunk_forward, logits)
        want, got = compiled(logits, tokens, 1.0), chunk_logprob_stats(logits, tokens, 1.0)
        diff = {name: (a - b).abs().max().item() for name, a, b in zip(("logp", "entropy", "lse"), want, got)}
        compiled_ms = triton.testing.do_bench(lambda: compiled(logits, tokens, 1.0))
        triton_ms = triton.testing.do_bench(lambda: chunk_logprob_stats(logits, tokens, 1.0))
        gb = logits.numel() * logits.element_size() / 1e9
        print(json.dumps(dict(rows=rows, vocab=vocab, compiled_ms=round(compiled_ms, 4), triton_ms=round(triton_ms, 4),
                              speedup=round(compiled_ms / triton_ms, 2), triton_gb_s=round(gb / triton_ms * 1e3),
                              max_abs_diff=diff)), flush=True)


if __name__ == "__main__":
    main()
