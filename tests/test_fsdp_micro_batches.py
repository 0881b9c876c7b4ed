"""FSDP2 on 2 ranks with gloo on the CPU (float32): the sharded copy is built shard first, gradients are
reduce-scattered after every micro-batch, and ranks whose rows plan different numbers of micro-batches
still run as many forwards as each other (every FSDP2 forward all-gathers), with one process's result.

The two ranks are started once for the module (torch.multiprocessing spawn, a FileStore, a short collective
timeout so that ranks disagreeing on their forwards fail the test instead of hanging it). Each builds a
trainer with `--fsdp` on the tiny model and a small `max_tokens_per_micro_batch`, takes its half of one
batch (rank 0 long completions, rank 1 short ones) and runs the log-prob pass and one update; the test
compares them with one process on the whole batch."""

import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cohort_grpo.trainer.grpo_trainer import Batch
from cohort_grpo.models import ModelConfig
from cohort_grpo.rollout.sampler import Rollout
from cohort_grpo.parallel.distributed import Parallel
from helpers import random_completions, update_trainer
from test_tensor_parallel_model import random_model

TOLERANCE = 1e-5
WORLD = 2
ROWS, GROUP, PROMPT = 16, 4, 5
# A prompt group on rank 0 is 5 + 4 × 6 = 29 tokens, on rank 1 5 + 4 × 1 = 9: under 20 tokens a training
# micro-batch, rank 0 plans 2 micro-batches (each group alone) and rank 1 one; the no-grad passes (40 tokens,
# twice the update's) the same.
LENGTHS = [6] * (ROWS // 2) + [1] * (ROWS // 2)
MICRO_TOKENS = 20
SMALL = ModelConfig(model_type="qwen2", tie_word_embeddings=False, vocab_size=83, hidden_size=64,
                    intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16, max_position_embeddings=64)


def whole_batch(vocab: int) -> Batch:
    """ROWS completions of ROWS / GROUP prompts, lengths LENGTHS, random advantages and π_ref log-probs."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, vocab, (PROMPT,), generator=g).tolist() for _ in range(ROWS // GROUP)]
    prompt_ids = [prompts[row // GROUP] for row in range(ROWS)]
    completion, mask = random_completions(LENGTHS, vocab, g)
    rollout = Rollout(completion_ids=completion, completion_mask=mask, logprobs=None, finish_reasons=["stop"] * ROWS)
    batch = Batch(rows=[{"prompt": "x"}] * ROWS, prompt_ids=prompt_ids, rollout=rollout, completions=[""] * ROWS)
    batch.advantages = torch.randn(ROWS, generator=g)
    batch.ref_logp = -torch.rand(mask.shape, generator=g) * mask  # unlike the policy's: the KL term has a gradient
    return batch


def rows_of(batch: Batch, rows: slice) -> Batch:
    part = Batch(rows=batch.rows[rows], prompt_ids=batch.prompt_ids[rows],
                 rollout=Rollout(completion_ids=batch.rollout.completion_ids[rows],
                                 completion_mask=batch.rollout.completion_mask[rows], logprobs=None,
                                 finish_reasons=batch.rollout.finish_reasons[rows]),
                 completions=batch.completions[rows])
    part.advantages, part.ref_logp = batch.advantages[rows], batch.ref_logp[rows]
    return part


def captured_gradients(trainer, batch: Batch, full) -> dict:
    """The gradients of `trainer.update(batch)` by name, read at its optimizer step (switched off), made whole
    by `full`; its micro-batch count and loss."""
    seen = {}
    trainer.optimizer.step = lambda *a, **k: seen.update(
        {name: full(p.grad).clone() for name, p in trainer.train_model.named_parameters() if p.grad is not None})
    stats = trainer.update(batch)
    return {"gradients": seen, "micro_batches": stats["micro_batches"], "loss": stats["loss"]}


def sharding_checks(rank: int) -> dict:
    """The sharded copy of a bf16 model with fp32 masters, and of an fp32 one, against the model; and whether a
    micro-batch that is not the last leaves reduce-scattered gradient shards behind."""
    parallel = Parallel(rank, WORLD)
    out = {}
    for name, model, masters in (("bf16", random_model(SMALL).to(torch.bfloat16), True),
                                 ("fp32", random_model(SMALL), False)):
        sharded = parallel.sharded_copy(model, master_weights=masters)
        params = dict(sharded.named_parameters())
        out[name] = {
            "names": (list(params), [n for n, _ in model.named_parameters()]),
            "dtypes": {str(p.dtype) for p in params.values()},
            "local": {n: p.to_local().numel() for n, p in params.items()},
            "shape": {n: tuple(p.shape) for n, p in params.items()},
            "error": max((p.full_tensor() - dict(model.named_parameters())[n].float()).abs().max().item()
                         for n, p in params.items()),
            "buffers": max(((b - dict(model.named_buffers())[n].to(b.dtype)).abs().max().item()
                            for n, b in sharded.named_buffers()), default=0.0),
        }
    sharded = parallel.sharded_copy(random_model(SMALL))
    ids = torch.randint(0, SMALL.vocab_size, (2, 7), generator=torch.Generator().manual_seed(rank))
    with parallel.no_sync(sharded, last=False):
        sharded(ids).float().square().mean().backward()
    out["synced_after_first"] = [n for n, p in sharded.named_parameters()
                                 if p.grad is not None and p.grad.to_local().shape == p.to_local().shape]
    return out


def run_rank(rank: int, folder: str, tiny_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD))
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))
    try:
        results = {"sharding": sharding_checks(rank)}
        trainer = update_trainer(tiny_dir, os.path.join(folder, f"out{rank}"), fsdp=True, device="cpu",
                                 max_tokens_per_micro_batch=MICRO_TOKENS, per_device_train_batch_size=ROWS // 2,
                                 gradient_accumulation_steps=1)
        half = ROWS // WORLD
        batch = rows_of(whole_batch(trainer.model.config.vocab_size), slice(rank * half, (rank + 1) * half))
        results["logprobs"] = trainer.policy_update.logprobs(trainer.train_model, batch)  # FSDP2 forwards
        results["update"] = captured_gradients(trainer, batch, lambda grad: grad.full_tensor())
        torch.save(results, os.path.join(folder, f"rank{rank}.pt"))
        dist.barrier()  # no rank tears gloo down while the other still uses it (std::terminate in its threads)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, tiny_dir):
    folder = tmp_path_factory.mktemp("fsdp_micro_batches")
    mp.spawn(run_rank, args=(str(folder), tiny_dir), nprocs=WORLD, join=True)
    return [torch.load(folder / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, tiny_dir):
    trainer = update_trainer(tiny_dir, tmp_path_factory.mktemp("one"), device="cpu",
                             max_tokens_per_micro_batch=MICRO_TOKENS, per_device_train_batch_size=ROWS // 2,
                             gradient_accumulation_steps=2)
    batch = whole_batch(trainer.model.config.vocab_size)
    logprobs = trainer.policy_update.logprobs(trainer.model, batch)
    return {"logprobs": logprobs, "update": captured_gradients(trainer, batch, lambda grad: grad)}


def test_the_sharded_copy_holds_the_models_values_a_shard_per_rank(ranks):
    for name in ("bf16", "fp32"):
        first, second = ranks[0]["sharding"][name], ranks[1]["sharding"][name]
        assert first["names"][0] == first["names"][1]  # the model's parameters, tied ones once
        assert first["dtypes"] == {"torch.float32"}  # bf16 weights widened, fp32 ones kept
        assert first["error"] == 0.0 and first["buffers"] == 0.0  # exact: the bf16 values widened
        for param, shape in first["shape"].items():  # each rank holds its half of the rows, nothing more
            numel = torch.Size(shape).numel()
            assert first["local"][param] + second["local"][param] == numel
            assert first["local"][param] == -(-shape[0] // WORLD) * (numel // shape[0])


def test_fsdp2_reduce_scatters_every_micro_batch(ranks):
    """After a micro-batch that is not the last, every weight already has its reduced gradient shard: no
    rank keeps whole unsharded gradients across micro-batches."""
    names = ranks[0]["sharding"]["fp32"]["names"][0]
    for result in ranks:
        assert result["sharding"]["synced_after_first"] == names


def test_ranks_that_plan_different_micro_batch_counts_finish_with_one_process_s_update(ranks, one_process):
    assert [r["update"]["micro_batches"] for r in ranks] == [2, 1]  # the case is what it means to be
    expected = one_process["update"]["gradients"]
    for result in ranks:
        got = result["update"]["gradients"]
        assert got.keys() == expected.keys()
        assert max(e.abs().max().item() for e in expected.values()) > 100 * TOLERANCE
        worst = max((got[n] - expected[n]).abs().max().item() for n in expected)
        assert worst <= TOLERANCE, worst
    # the step's loss is the ranks' average (`Parallel.mean_metrics`)
    assert sum(r["update"]["loss"] for r in ranks) / WORLD == pytest.approx(one_process["update"]["loss"], abs=TOLERANCE)


def test_the_log_prob_pass_of_ranks_with_different_plans_equals_one_process(ranks, one_process):
    got = torch.cat([r["logprobs"] for r in ranks])
    expected = one_process["logprobs"]
    assert expected.abs().sum() > 0
    assert (got - expected[:, : got.shape[1]]).abs().max().item() <= TOLERANCE
