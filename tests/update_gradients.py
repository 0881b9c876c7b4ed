"""The gradient one trainer update builds, for tests that compare updates."""

import torch


def update_gradient(trainer, batch) -> tuple[torch.Tensor, dict]:
    """(the flat gradient `trainer.update(batch)` hands its optimizer, the update's statistics).

    The optimizer step is switched off, so the weights stay put; the gradient is read at the step
    because the update frees it right after."""
    seen = []
    trainer.optimizer.step = lambda *a, **k: seen.append(
        torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None]))
    stats = trainer.update(batch)
    return seen[0], stats
