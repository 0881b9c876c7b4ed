"""Qwen3-MoE across processes (gloo on the CPU, float32): DDP, FSDP2, FSDP2 ranks sampling as one tensor-parallel
group and a sampling rank train exactly what one process trains, with routing replay on (the default), and FSDP2 resumes exactly; the pieces they rely on
(FSDP2's units, the weight stream into a sampling copy) checked in process first."""

import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from cohort_grpo.models import CausalLM, ModelConfig, from_pretrained
from cohort_grpo.models.resharding import full_parameters, update_shard_
from cohort_grpo.models.tiny import build_tokenizer
from cohort_grpo.parallel.sharding import decoder_layers
from test_distributed import REWARD_MODULE, run, step_records, train_options

TOLERANCE = 1e-5


def tiny_moe_config(tokenizer) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                          num_experts=8, num_experts_per_tok=3, norm_topk_prob=True, max_position_embeddings=256,
                          pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    """A random Qwen3-MoE saved by transformers (one matrix per expert in the checkpoint). Its weights are
    wider than transformers' init so that the experts, and so the routing, change the completions; the routers
    have no near-ties, whose flips would depend on the batch a rank's engine happens to run."""
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_moe_config(tokenizer), dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(std=0.2)
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_()
    path = tmp_path_factory.mktemp("moe") / "model"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_fsdp_units_are_the_decoder_layers_not_the_expert_blocks_inside_them(moe_dir):
    ours = from_pretrained(moe_dir)
    theirs = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    for model in (ours, theirs):  # both hold a `*SparseMoeBlock` inside each `*DecoderLayer`
        assert any(type(m).__name__.endswith("SparseMoeBlock") for m in model.modules())
        assert [id(m) for m in decoder_layers(model)] == [id(m) for m in model.model.layers]


def test_a_sampling_copy_takes_the_stacked_expert_weights_in_place():
    """What a sampling rank does with each new version: every parameter, the [E, 2I, H] and [E, H, I] expert
    stacks included, copied into its own tensors (the addresses a CUDA-graph engine captured stay)."""
    config = ModelConfig(model_type="qwen3_moe", vocab_size=40, hidden_size=16, intermediate_size=24,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                         num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, mlp_only_layers=[1])
    torch.manual_seed(1)
    trained, sampler = CausalLM(config), CausalLM(config)
    addresses = {name: p.data_ptr() for name, p in sampler.named_parameters()}
    update_shard_(sampler, full_parameters(trained))
    ids = torch.randint(0, 40, (2, 7))
    with torch.no_grad():
        assert torch.equal(sampler(ids), trained(ids))
    assert {name: p.data_ptr() for name, p in sampler.named_parameters()} == addresses
    assert "model.layers.0.mlp.experts.gate_up_proj" in addresses


# ---- real processes ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def root(tmp_path_factory):
    folder = tmp_path_factory.mktemp("moe_ranks")
    (folder / "rewardmod.py").write_text(REWARD_MODULE)
    return folder


def options(model: str, out: Path, accumulation: int, *extra: str) -> list[str]:
    """test_distributed's run (16 completions a step: one process in 4 micro-batches, each of 2 trainers in 2),
    3 steps, a checkpoint after each."""
    return train_options(model, out, accumulation, "--max_steps", "3", "--save_steps", "1", "--save_total_limit", "0",
                         *extra)


def launcher(processes: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "cohort_grpo", "train", "--nproc_per_node", str(processes), *args]


def assert_same_training(out: Path, reference: Path) -> None:
    """Each step `out` ran has the reference's loss and reward, replay mismatch reported (the sampler's routes
    reached the trainer) and equal; the final weights equal (≤ 1e-5)."""
    expected = {r["step"]: r for r in step_records(reference)}
    got = step_records(out)
    assert got and all(r["step"] in expected for r in got)
    for mine in got:
        theirs = expected[mine["step"]]
        assert abs(mine["reward"] - theirs["reward"]) <= TOLERANCE  # the same completions were sampled
        assert abs(mine["loss"] - theirs["loss"]) <= TOLERANCE, (mine["step"], mine["loss"], theirs["loss"])
        assert abs(mine["routing/replay_mismatch"] - theirs["routing/replay_mismatch"]) <= TOLERANCE
    weights, expected_weights = load_file(out / "model.safetensors"), load_file(reference / "model.safetensors")
    assert weights.keys() == expected_weights.keys()
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in weights  # saved as transformers names them
    worst = max((weights[k] - expected_weights[k]).abs().max().item() for k in weights)
    assert worst <= TOLERANCE, worst


def one_process(root: Path, moe_dir: str, name: str, *extra: str) -> Path:
    out = root / name
    run(root, [sys.executable, "-m", "cohort_grpo", "train", *options(moe_dir, out, 4, *extra)])
    initial, final = load_file(Path(moe_dir) / "model.safetensors"), load_file(out / "model.safetensors")
    moved = max((final[k] - initial[k]).abs().max().item() for k in final if "experts" in k)
    assert moved > 100 * TOLERANCE, "training must move the expert weights"
    assert all("routing/replay_mismatch" in r for r in step_records(out))
    return out


@pytest.fixture(scope="module")
def reference(root, moe_dir) -> Path:
    """One process, synchronous: what every placement below must train."""
    return one_process(root, moe_dir, "one")


@pytest.mark.slow
def test_ddp_and_fsdp2_ranks_train_what_one_process_trains_and_fsdp2_resumes(root, moe_dir, reference):

    ddp = root / "ddp"
    output = run(root, launcher(2, *options(moe_dir, ddp, 2)))
    assert output.count("Step 3/3") == 1
    assert_same_training(ddp, reference)

    fsdp = root / "fsdp"
    run(root, launcher(2, *options(moe_dir, fsdp, 2, "--fsdp", "true")))
    assert_same_training(fsdp, reference)
    for later in ("checkpoint-2", "checkpoint-3"):  # resume from the first checkpoint: two steps after it
        shutil.rmtree(fsdp / later)
    output = run(root, launcher(2, *options(moe_dir, fsdp, 2, "--fsdp", "true", "--resume", "true")))
    assert "checkpoint-1 at step 1" in output and output.count("Step 3/3") == 1
    assert_same_training(fsdp, reference)


@pytest.mark.slow
def test_fsdp2_ranks_sampling_as_one_tensor_parallel_group_train_what_one_process_trains(root, moe_dir, reference):
    """`--fsdp true --rollout_tensor_parallel_size 2`: both ranks sample as one group, each holding half of every
    expert's columns; they route alike, record the routes the trainer replays, and train what one process does."""
    grouped = root / "tensor_parallel"
    output = run(root, launcher(2, *options(moe_dir, grouped, 2, "--fsdp", "true",
                                            "--rollout_tensor_parallel_size", "2")))
    assert "1 tensor-parallel group(s) of 2" in output
    assert_same_training(grouped, reference)


@pytest.mark.slow
def test_a_sampling_rank_ships_its_routes_and_trains_what_one_process_trains(root, moe_dir):
    """Two trainers and a sampling rank (`--rollout_gpus 1`): the expert routes it samples with travel with each
    rollout (its `routed_experts`), and the new weights, expert stacks included, reach it after each update."""
    asynchronous = ("--async_rollouts", "true", "--max_staleness", "1")
    reference = one_process(root, moe_dir, "async_one", *asynchronous)
    split = root / "split"
    output = run(root, launcher(3, *options(moe_dir, split, 2, *asynchronous, "--rollout_gpus", "1")))
    assert "cohort: rank 2 sampled 8 rollouts for trainer rank(s) 0, 1" in output  # (3 steps + 1 ahead) × 2 trainers
    assert_same_training(split, reference)
    assert [r["async/staleness"] for r in step_records(split)] == [0.0, 1.0, 1.0]
