"""Linear-attention, state-space and convolution layers on a GPU (COHORT_TEST_GPU=1): the engine's CUDA-graph
decode steps advance each row's recurrent state (models/recurrent_state.py) as its eager steps do. A graph's
warm-up and check runs advance the states too, so the capture puts them back (`KVCache.step_states`); where it did
not, the check would find the graph and the eager step apart and decode without graphs, or the tokens would drift
from transformers'."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a GPU: run with COHORT_TEST_GPU=1 on a machine with one", allow_module_level=True)

from test_generic_models import PROMPTS, reference_model, wrapped  # noqa: E402

from cohort_grpo.rollout.engine import Engine  # noqa: E402
from cohort_grpo.rollout.sampler import SamplingParams  # noqa: E402


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_next", "granitemoehybrid", "lfm2", "jamba"])
def test_graph_decode_keeps_recurrent_states(model_type):
    """Greedy tokens of the engine with checked CUDA graphs (more prompts than rows, prompts of several lengths)
    equal transformers' greedy `generate` on the same GPU, and the graphs stayed on."""
    reference = reference_model(model_type).cuda()
    model, new_tokens = wrapped(reference), 12
    engine = Engine(model, max_batch_size=2, check_interval=3, use_cuda_graph=True, check_graphs=True,
                    compile_kernels=False)
    rollout = engine.generate(PROMPTS, 1, SamplingParams(max_new_tokens=new_tokens, temperature=0.0, pad_token_id=0))
    assert engine.graphs.enabled and engine.graphs.captures > 0
    for row, prompt in enumerate(PROMPTS):
        ids = torch.tensor([prompt], device="cuda")
        expected = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                      do_sample=False)[0, len(prompt):]
        assert rollout.completion_ids[row].tolist() == expected.tolist(), (row, prompt)
