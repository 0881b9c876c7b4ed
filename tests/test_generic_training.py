"""Training on the generic path (cohort_grpo/models/generic_training.py): per-layer gradient checkpointing, LoRA,
hub ids resolved to their model type, FSDP2 by the model's own decoder layers, and the options the generic path
refuses by name. Tiny random models of transformers' own classes (test_generic_models.py), float32, CPU."""

import copy
import json
import os
import subprocess
import sys

import pytest
import torch

from cohort_grpo.errors import CohortError
from cohort_grpo.models.generic import TransformersCausalLM
from cohort_grpo.models.generic_training import decoder_layer_list, is_mixture_of_experts
from tests.test_generic_models import FAMILIES, VOCAB, reference_model, save_folder

pytestmark = pytest.mark.cpu("float32 gradients and logits of CPU forwards")


def loss_and_grads(model, input_ids):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids)
    loss = torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, input_ids[:, 1:, None]).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model_type", ["olmo2", "gemma3_text", "gpt_neox"])
def test_checkpointing_the_first_layers_leaves_gradients_unchanged(model_type):
    """gradient_checkpointing_layers=N recomputes the first N decoder layers (found without naming the family)
    and keeps the others; the loss and every gradient equal a run without checkpointing."""
    model = TransformersCausalLM.wrap(reference_model(model_type)).train()
    layers = decoder_layer_list(model.decoder)
    assert len(layers) == FAMILIES[model_type][2]["num_hidden_layers"]
    torch.manual_seed(4)
    input_ids = torch.randint(1, VOCAB, (2, 9))
    want_loss, want = loss_and_grads(model, input_ids)
    recomputed = []
    for checkpointed in (0, 1, 3, None):
        model.gradient_checkpointing_enable(checkpointed_layers=checkpointed)
        assert model.checkpointed_layers == (len(layers) if checkpointed is None else checkpointed)
        forwards = []  # each layer's forwards (of its first part): a checkpointed one runs again in the backward
        hooks = [next(layer.children()).register_forward_pre_hook(lambda m, a, i=i: forwards.append(i))
                 for i, layer in enumerate(layers)]
        loss, grads = loss_and_grads(model, input_ids)
        for hook in hooks:
            hook.remove()
        recomputed.append(len(forwards) - len(layers))
        assert torch.equal(loss, want_loss)
        assert grads.keys() == want.keys()
        assert max(float((grads[n] - want[n]).abs().max()) for n in want) <= 1e-6
    assert recomputed[:3] == [0, 1, 3] and recomputed[3] == len(layers)
    with pytest.raises(CohortError, match="not between 0"):
        model.gradient_checkpointing_enable(checkpointed_layers=len(layers) + 1)
