"""The run's `Placement` (cohort_grpo/parallel/placement.py): which ranks train and which sample, in which groups, on
which copy of the weights, and every refusal that needs both the config and the process count, against
expectations worked out by hand."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cohort_grpo import GRPOConfig
from cohort_grpo.errors import CohortError
from cohort_grpo.parallel.placement import ASYNC_MODES, Placement
from cohort_grpo.plans.training_plan import RankShape
from cohort_grpo.trainer.ppo_trainer import PPOConfig

ROOT = Path(__file__).resolve().parents[1]


def placed(world_size: int, **options) -> Placement:
    return Placement.from_config(GRPOConfig(**options).validate(), world_size)


# ---- which ranks train and which sample ----------------------------------------------------------------------

@pytest.mark.parametrize("world, options, trainers, samplers", [
    (1, {}, [0], []),  # one process trains and samples
    (4, {}, [0, 1, 2, 3], []),  # DDP: every rank trains and samples on its own copy
    (4, dict(fsdp=True), [0, 1, 2, 3], []),
    (4, dict(rollout_gpus=1, async_rollouts=True), [0, 1, 2], [3]),  # the last K ranks only sample
    (8, dict(rollout_gpus=3, async_rollouts=True), [0, 1, 2, 3, 4], [5, 6, 7]),
])
def test_the_first_ranks_train_and_the_last_rollout_gpus_only_sample(world, options, trainers, samplers):
    placement = placed(world, **options)
    assert list(placement.training_ranks) == trainers and placement.trainers == len(trainers)
    assert list(placement.sampling_ranks) == samplers
    assert [r for r in range(world) if placement.samples_here(r)] == samplers


def test_sampling_ranks_serve_blocks_of_consecutive_trainers():
    four = Placement(world_size=4, rollout_gpus=2)
    assert [four.server_of(t) for t in range(2)] == [2, 3] and four.served_by(2) == [0] and four.served_by(3) == [1]
    assert Placement(world_size=3, rollout_gpus=1).served_by(2) == [0, 1]
    eight = Placement(world_size=8, rollout_gpus=2)  # blocks of consecutive trainers: their completions follow
    assert eight.served_by(6) == [0, 1, 2] and eight.served_by(7) == [3, 4, 5]
    seven = Placement(world_size=7, rollout_gpus=2)  # 5 trainers over 2 groups: 3 and 2
    assert seven.served_by(5) == [0, 1, 2] and seven.served_by(6) == [3, 4]


def test_tensor_parallel_sampling_groups_are_consecutive_ranks_led_by_their_first():
    six = Placement(world_size=6, rollout_gpus=4, split=2)  # 2 trainers, 2 groups of 2
    assert six.groups == 2 and six.group_ranks(0) == [2, 3] and six.group_ranks(1) == [4, 5]
    assert [six.server_of(t) for t in range(2)] == [2, 4]  # the leaders
    assert six.served_by(2) == six.served_by(3) == [0] and six.served_by(4) == six.served_by(5) == [1]
    assert [six.leader_of(r) for r in range(2, 6)] == [2, 2, 4, 4] and six.group_of(5) == [4, 5]
    five = Placement(world_size=5, rollout_gpus=2, split=2)  # 3 trainers, one group serves all
    assert five.served_by(3) == five.served_by(4) == [0, 1, 2] and five.server_of(2) == 3
    plain = Placement(world_size=4, rollout_gpus=2)
    assert [plain.leader_of(r) for r in (2, 3)] == [2, 3] and plain.groups == 2


def test_colocated_training_ranks_sample_in_groups_of_t():
    """FSDP2 ranks without sampling ranks and T = 2 of 6: groups (0, 1), (2, 3), (4, 5); none only samples."""
    six = placed(6, fsdp=True, rollout_tensor_parallel_size=2)
    assert six.colocated and six.fsdp_ranks_sample and six.sharded
    assert six.groups == 3 and [six.group_ranks(g) for g in range(3)] == [[0, 1], [2, 3], [4, 5]]
    assert [six.leader_of(r) for r in range(6)] == [0, 0, 2, 2, 4, 4] and six.group_of(3) == [2, 3]
    assert not any(six.samples_here(r) for r in range(6))
    assert placed(6, fsdp=True, rollout_tensor_parallel_size=6).group_ranks(0) == [0, 1, 2, 3, 4, 5]


def test_auto_is_settled_once_the_model_is_loaded():
    """`auto` T: neither colocated nor grouped until settled; a memory plan takes the widest split it may choose."""
    auto = placed(4, fsdp=True)
    assert auto.split == "auto" and not auto.colocated and auto.widest_split == 4
    with pytest.raises(RuntimeError, match="settle it first"):
        auto.groups  # noqa: B018
    assert auto.settled(2).colocated and auto.settled(2).groups == 2 and auto.settled(2).group_ranks(1) == [2, 3]
    assert not auto.settled(1).colocated and auto.settled(1).groups == 4
    assert auto.settled(2).widest_split == 2 and placed(4).widest_split == 1  # DDP: every rank a whole copy
    assert placed(1, fsdp=True).widest_split == 1  # FSDP2 in one process shards nothing
    assert not placed(1, fsdp=True).sharded and not placed(1, fsdp=True).fsdp_ranks_sample
    ranks = placed(3, rollout_gpus=2, async_rollouts=True)
    assert ranks.widest_split == 1 and ranks.settled(2).groups == 1 and ranks.settled(2).group_ranks(0) == [1, 2]


# ---- which copy samples, and what is released -----------------------------------------------------------------

@pytest.mark.parametrize("world, options, mode", [
    (1, {}, "sync"),
    (2, dict(fsdp=True), "sync"),
    (1, dict(async_rollouts=True), "producer_copy"),  # one process: the producer thread's own copy
    (4, dict(async_rollouts=True), "producer_copy"),  # DDP alike
    (2, dict(async_rollouts=True, fsdp=True), "in_place"),  # max_staleness None settles to 1 there
    (2, dict(async_rollouts=True, fsdp=True, max_staleness=1), "in_place"),
    (2, dict(async_rollouts=True, fsdp=True, max_staleness=2), "producer_copy"),  # the copy keeps older weights
    (4, dict(async_rollouts=True, fsdp=True, rollout_tensor_parallel_size=2), "in_place"),  # on the shard
    (1, dict(async_rollouts=True, fsdp=True), "in_place"),  # FSDP2 asked for in one process: as on several
    (3, dict(async_rollouts=True, rollout_gpus=1), "remote"),
    (3, dict(async_rollouts=True, rollout_gpus=1, max_staleness=3), "remote"),
])
def test_the_asynchronous_mode_says_which_copy_samples_ahead(world, options, mode):
    placement = placed(world, **options)
    assert placement.async_mode == mode and mode in ASYNC_MODES
    assert placement.samples_in_place is (mode == "in_place")
    assert placement.producer_copy is (mode == "producer_copy")


def test_a_split_auto_settles_to_samples_on_the_shards_in_place():
    """Two updates behind on a whole copy keeps a producer copy; were `auto` to split the engine over the FSDP2
    ranks, the shard the trainer refreshes is the only copy, so that run is refused when the split settles."""
    placement = placed(2, async_rollouts=True, fsdp=True, max_staleness=2)
    assert placement.settled(1).async_mode == "producer_copy"
    with pytest.raises(CohortError, match=r"async_rollouts with rollout_tensor_parallel_size=2 on the training ranks "
                                          r".*1 update behind; pass (--max_staleness 1|max_staleness=1)"):
        placement.settled(2)


@pytest.mark.parametrize("options, released", [
    (dict(fsdp=True, free_sampling_memory=True), True),
    (dict(fsdp=True, free_sampling_memory=True, async_rollouts=True), False),  # the engine samples during the update
    (dict(fsdp=True, free_sampling_memory=True, use_peft=True), False),  # π_ref is that copy, adapters off
    (dict(fsdp=True), False),
    (dict(free_sampling_memory=True), False),  # DDP: the engine samples the trained weights themselves
])
def test_the_engine_is_released_in_the_update_only_under_fsdp_freeing_sampling_memory(options, released):
    assert placed(2, **options).engine_released_in_update is released


@pytest.mark.parametrize("world, options, layout", [
    (1, {}, RankShape()),
    (4, {}, RankShape(ranks=4)),  # DDP: whole copies, the engine one of them
    (4, dict(fsdp=True), RankShape(ranks=4, fsdp=True, sampling_split=4)),  # auto: planned at its widest
    (4, dict(fsdp=True, rollout_tensor_parallel_size=2), RankShape(ranks=4, fsdp=True, sampling_split=2)),
    (4, dict(fsdp=True, free_sampling_memory=True),
     RankShape(ranks=4, fsdp=True, sampling_split=4, engine_in_update=False)),
    (1, dict(fsdp=True, free_sampling_memory=True), RankShape()),  # one process: nothing sharded
    (3, dict(rollout_gpus=1, async_rollouts=True), RankShape(ranks=2, samples=False)),  # a trainer's own engine idles
])
def test_a_training_rank_s_memory_layout_follows_the_placement(world, options, layout):
    assert RankShape.of(placed(world, **options)) == layout


# ---- the refusals ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("world, k, fix", [(1, 1, "--rollout_gpus 0"), (2, 2, "--rollout_gpus 1"),
                                           (4, 5, "--rollout_gpus 1 to 3")])
def test_sampling_ranks_must_leave_a_rank_that_trains(world, k, fix):
    with pytest.raises(CohortError) as refused:
        placed(world, rollout_gpus=k, async_rollouts=True)
    assert refused.value.args[0] == (f"rollout_gpus={k} needs ranks that train besides the ones that sample, and "
                                     f"{world} process(es) leave none; start {k + 1} or more processes "
                                     f"(--nproc_per_node), or give {fix}")


def test_sampling_groups_must_divide_the_sampling_ranks_and_each_serve_a_trainer():
    with pytest.raises(CohortError) as refused:
        Placement(world_size=5, rollout_gpus=3, split=2)
    assert refused.value.args[0] == ("rollout_tensor_parallel_size=2 with rollout_gpus=3: the sampling ranks form "
                                     "groups of that many ranks, so it must divide rollout_gpus (e.g. "
                                     "--rollout_gpus 2)")
    with pytest.raises(CohortError) as refused:
        placed(5, rollout_gpus=4, async_rollouts=True, rollout_tensor_parallel_size=2)
    assert refused.value.args[0] == ("rollout_gpus=4 in 2 sampling group(s) for 1 trainer rank(s): a group would serve "
                                     "no trainer; use fewer sampling ranks or a larger --rollout_tensor_parallel_size")
    placed(6, rollout_gpus=4, async_rollouts=True, rollout_tensor_parallel_size=2)  # 2 groups for 2 trainers


@pytest.mark.parametrize("world, split", [(2, 3), (3, 2), (6, 4), (1, 2)])
def test_a_colocated_split_must_divide_the_training_ranks(world, split):
    with pytest.raises(CohortError) as refused:
        placed(world, fsdp=True, rollout_tensor_parallel_size=split)
    assert refused.value.args[0] == (f"rollout_tensor_parallel_size={split} does not divide the {world} training "
                                  f"rank(s), which sample in groups of that many (--fsdp without --rollout_gpus); give "
                                  f"a divisor of {world}, or start a multiple of {split} processes")


@pytest.mark.parametrize("world, options", [
    (2, dict(fsdp=True, rollout_tensor_parallel_size=2)),  # colocated groups
    (3, dict(rollout_gpus=2, async_rollouts=True, rollout_tensor_parallel_size=2)),  # a group of sampling ranks
])
def test_lora_adapters_cannot_be_split_over_a_sampling_group(world, options):
    """Refused from the options alone (before torchrun starts a rank), not in each rank once the model is loaded."""
    with pytest.raises(CohortError) as refused:
        placed(world, use_peft=True, **options)
    assert refused.value.args[0] == ("rollout_tensor_parallel_size=2 with LoRA adapters is not supported (their layers "
                                     "are not split); use --rollout_tensor_parallel_size 1 (LoRA's memory need is the "
                                     "base model's, bf16) or train the full model")
    placed(world, **options)  # the full model splits
    placed(world, use_peft=True, **{**options, "rollout_tensor_parallel_size": 1})  # one whole copy a rank
    assert placed(world, use_peft=True, **{**options, "rollout_tensor_parallel_size": "auto"}).split == "auto"


@pytest.mark.parametrize("options, what", [
    (dict(scale_rewards="batch"), "scale_rewards='batch' with 2 ranks would divide by each rank's own reward std"),
    (dict(dynamic_sampling=True), "dynamic_sampling with 2 ranks is not supported"),
    (dict(rm_updates_per_step=1), "training a reward model online with 2 ranks is not supported"),
])
def test_options_that_need_batch_wide_statistics_are_refused_on_several_training_ranks(options, what):
    with pytest.raises(CohortError, match=f"^{what}"):
        placed(2, **options)
    placed(1, **options)  # one process: fine
    placed(2, **options, rollout_gpus=1, async_rollouts=True)  # one trainer, one sampling rank: fine
    with pytest.raises(CohortError, match=f"^{what.replace('2 ranks', '3 ranks')}"):
        placed(4, **options, rollout_gpus=1, async_rollouts=True)  # counted over the trainers


def test_ppo_on_several_ranks_is_refused():
    with pytest.raises(CohortError, match="^PPO with 2 ranks is not supported"):
        Placement.from_config(PPOConfig().validate(), 2)
    assert Placement.from_config(PPOConfig().validate(), 1).trainers == 1


def test_cohort_train_refuses_a_placement_before_torchrun_starts(tmp_path):
    """`cohort-grpo train --nproc_per_node 2 --fsdp true --rollout_tensor_parallel_size 3`: one line naming the option
    and the fix, exit code 2, and nothing from the launcher (no rank was started, nothing written)."""
    out = tmp_path / "out"
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-m", "cohort_grpo", "train", "--nproc_per_node", "2", "--fsdp", "true",
                           "--rollout_tensor_parallel_size", "3", "--output_dir", str(out)],
                          env=dict(os.environ, PYTHONPATH=path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=120, cwd=tmp_path)
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 2, done.stdout
    assert len(lines) <= 2, done.stdout
    assert lines[-1] == ("cohort: error: rollout_tensor_parallel_size=3 does not divide the 2 training rank(s), which "
                         "sample in groups of that many (--fsdp without --rollout_gpus); give a divisor of 2, or start "
                         "a multiple of 3 processes")
    for launcher_word in ("torchrun", "WARNING", "SIGTERM", "--resume", "OMP_NUM_THREADS"):
        assert launcher_word not in done.stdout
    assert not out.exists()


@pytest.mark.parametrize("options, message", [
    (["--use_peft", "true"], "rollout_tensor_parallel_size=2 with LoRA adapters is not supported (their layers are "
                             "not split); use --rollout_tensor_parallel_size 1 (LoRA's memory need is the base "
                             "model's, bf16) or train the full model"),
    (["--task", "calculator"], "rollout_tensor_parallel_size=2 with tools is not supported (every rank of a sampling "
                               "group would run each tool call); use --rollout_tensor_parallel_size 1"),
])
def test_cohort_train_refuses_a_split_the_options_rule_out_before_torchrun_starts(options, message, tmp_path):
    """LoRA adapters and tool calls cannot be split over a sampling group; both are known from the options, so the
    launcher refuses them in one line (exit 2), not each rank once its model is loaded (exit 1, with a --resume
    hint that does not apply)."""
    out = tmp_path / "out"
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-m", "cohort_grpo", "train", "--nproc_per_node", "2", "--fsdp", "true",
                           "--rollout_tensor_parallel_size", "2", "--device", "cpu", *options, "--output_dir", str(out)],
                          env=dict(os.environ, PYTHONPATH=path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2, done.stdout[-3000:]
    assert done.stdout.strip().splitlines()[-1] == f"cohort: error: {message}", done.stdout[-3000:]
    for launcher_word in ("torchrun", "--resume", "OMP_NUM_THREADS"):
        assert launcher_word not in done.stdout
    assert not out.exists()
