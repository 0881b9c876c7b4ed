"""Sampling on ranks of their own (`--rollout_gpus`): trainers and samplers in one torchrun job (gloo on
the CPU) train exactly what one process with asynchronous rollouts trains, and resume exactly."""

import shutil
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from cohort_grpo.config.grpo_config import GRPOConfig
from cohort_grpo.errors import CohortError
from cohort_grpo.parallel.disaggregation import RolloutLink
from cohort_grpo.parallel.placement import Placement
from test_distributed import REWARD_MODULE, environment, run, step_records, torchrun, train_options

TOLERANCE = 1e-5


def test_a_groups_leader_relays_each_request_so_its_ranks_make_the_same_calls_and_only_it_replies():
    """Trainers 0 and 1, one sampling group of ranks 2 (leader) and 3: rank 3 reads every request, a
    resumed trainer's pool included, from rank 2, makes the same sample calls, and sends nothing back."""
    import pickle
    import queue
    import threading
    from types import SimpleNamespace

    from cohort_grpo.rollout import remote
    from cohort_grpo.rollout.remote import RESTORE, ROLLOUT, SAMPLE, STOP, RolloutServer

    placement = Placement(world_size=4, rollout_gpus=2, split=2)
    wire = {(a, b): queue.Queue() for a in range(4) for b in range(4)}
    calls = {2: [], 3: []}

    def server(rank):
        def sample(rows, seed, sequence_offset):
            calls[rank].append((tuple(r["prompt"] for r in rows), seed, sequence_offset))
            kept = list(rows)  # no engine: the rows stand for the rollout
            return SimpleNamespace(rows=kept, rollout_metrics=None, state=lambda: {"rows": kept})

        return RolloutServer(QueueLink(placement, rank, wire, None), None, sample, group_size=1)

    servers = {rank: server(rank) for rank in (2, 3)}
    assert servers[2].trainers == servers[3].trainers == [0, 1]
    assert servers[2].followers == [3] and servers[3].followers == [] and servers[3].leader == 2
    for server_ in servers.values():
        server_.use_weights_of = lambda version: 0.0  # no weights travel in this test
        server_.engine_calls = lambda trainers, requests: [[t] for t in trainers]
    wire[(0, 2)].put(pickle.dumps((RESTORE, remote.GroupPool().state_dict())))
    for step, trainer in ((1, 0), (1, 1), (2, 0), (2, 1)):
        rows = [{"prompt": f"p{step}{trainer}"}]
        wire[(trainer, 2)].put(pickle.dumps((SAMPLE, step, 0, rows, 7, trainer)))
    for trainer in (0, 1):
        wire[(trainer, 2)].put(pickle.dumps((STOP,)))
    threads = {rank: threading.Thread(target=lambda r=rank: calls.setdefault(f"served{r}", servers[r].serve()))
               for rank in (2, 3)}
    for thread in threads.values():
        thread.start()
    for thread in threads.values():
        thread.join(timeout=30)
    assert calls[2] == calls[3] == [(("p10",), 7, 0), (("p11",), 7, 1), (("p20",), 7, 0), (("p21",), 7, 1)]
    assert calls["served2"] == calls["served3"] == 4
    replies = {t: [] for t in (0, 1)}
    for trainer in (0, 1):
        while not wire[(2, trainer)].empty():
            replies[trainer].append(pickle.loads(wire[(2, trainer)].get())[:2])
        assert wire[(3, trainer)].empty()  # the follower sends nothing to the trainers
    assert replies == {0: [(ROLLOUT, 1), (ROLLOUT, 2)], 1: [(ROLLOUT, 1), (ROLLOUT, 2)]}


def test_settings_that_cannot_work_are_refused():
    with pytest.raises(CohortError, match="pass async_rollouts=True"):
        GRPOConfig(rollout_gpus=1).validate()
    with pytest.raises(CohortError, match="with fsdp is not supported"):
        GRPOConfig(rollout_gpus=1, async_rollouts=True, fsdp=True).validate()
    with pytest.raises(CohortError, match="rollout_gpus=-1 is negative"):
        GRPOConfig(rollout_gpus=-1).validate()
    with pytest.raises(CohortError, match="partial_rollouts runs on sampling ranks"):
        GRPOConfig(partial_rollouts=True, async_rollouts=True, max_staleness=2).validate()
    with pytest.raises(CohortError, match="give max_staleness=2 or more"):
        GRPOConfig(partial_rollouts=True, async_rollouts=True, rollout_gpus=1, max_staleness=1).validate()
    GRPOConfig(partial_rollouts=True, async_rollouts=True, rollout_gpus=1, max_staleness=2).validate()
    with pytest.raises(CohortError, match="rollout_tensor_parallel_size=3 does not divide rollout_gpus=4"):
        GRPOConfig(rollout_gpus=4, async_rollouts=True, rollout_tensor_parallel_size=3).validate()
    with pytest.raises(CohortError, match="rollout_tensor_parallel_size=0: give the number"):
        GRPOConfig(rollout_tensor_parallel_size=0).validate()


def test_one_process_cannot_sample_on_other_ranks(tiny_dir, tmp_path):
    from cohort_grpo import GRPOTrainer

    with pytest.raises(CohortError, match="rollout_gpus=1 needs ranks that train besides the ones that sample"):
        GRPOTrainer(tiny_dir, lambda completions, **_: [0.0] * len(completions), [{"prompt": "1+1="}] * 4,
                    args=GRPOConfig(rollout_gpus=1, async_rollouts=True, output_dir=str(tmp_path / "x"),
                                    device="cpu", quiet=True))


def test_the_last_ranks_sample_and_each_side_refuses_the_other_s_rank(tiny_dir, tmp_path, monkeypatch):
    """With rollout_gpus=1 of 3 ranks, rank 2 alone samples: a GRPOTrainer built there, or a SamplingRank built
    on a trainer rank, stops at once with a line that says what to run instead."""
    from cohort_grpo import GRPOTrainer, SamplingRank, is_sampling_rank

    args = GRPOConfig(rollout_gpus=1, async_rollouts=True, output_dir=str(tmp_path / "x"), device="cpu", quiet=True)
    monkeypatch.setenv("WORLD_SIZE", "3")
    ranks = []
    for rank in range(3):
        monkeypatch.setenv("RANK", str(rank))
        ranks.append(is_sampling_rank(args))
    assert ranks == [False, False, True]
    assert not is_sampling_rank(GRPOConfig(output_dir=str(tmp_path / "x")))
    with pytest.raises(CohortError, match=r"GRPOTrainer on a rank that only samples .*SamplingRank\(model, args\)"):
        GRPOTrainer(tiny_dir, lambda completions, **_: [0.0] * len(completions), [{"prompt": "1+1="}] * 4, args=args)
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(CohortError, match="SamplingRank on a rank that trains"):
        SamplingRank(tiny_dir, args)
    assert not (tmp_path / "x").exists()  # neither got as far as the output folder


# ---- real processes --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def root(tmp_path_factory):
    folder = tmp_path_factory.mktemp("rollout_ranks")
    (folder / "rewardmod.py").write_text(REWARD_MODULE)
    return folder


def options(model: str, out: Path, accumulation: int, *extra: str) -> list[str]:
    """test_distributed's run (16 completions a step: one process in 4 micro-batches of 4, each of 2 trainers
    in 2; β > 0 and μ = 2) with rollouts 1 update behind, 3 steps, a checkpoint after each."""
    return train_options(model, out, accumulation, "--async_rollouts", "true", "--max_staleness", "1",
                         "--max_steps", "3", "--save_steps", "1", "--save_total_limit", "0", *extra)


def three_ranks(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3", "-m", "cohort_grpo",
            "train", *args]


def assert_same_training(out: Path, reference: Path, steps: slice = slice(None)) -> None:
    got, expected = step_records(out)[steps], step_records(reference)[steps]
    assert [r["step"] for r in got] == [r["step"] for r in expected] and got
    for mine, theirs in zip(got, expected):
        assert abs(mine["reward"] - theirs["reward"]) <= TOLERANCE  # the same completions were sampled
        assert abs(mine["loss"] - theirs["loss"]) <= TOLERANCE, (mine["step"], mine["loss"], theirs["loss"])
        assert mine["async/staleness"] == theirs["async/staleness"]
    weights, expected_weights = load_file(out / "model.safetensors"), load_file(reference / "model.safetensors")
    worst = max((weights[k] - expected_weights[k]).abs().max().item() for k in weights)
    assert worst <= TOLERANCE, worst


@pytest.fixture(scope="module")
def reference(root, tiny_dir):
    """One process with asynchronous rollouts: what every placement below must train."""
    out = root / "one"
    run(root, [sys.executable, "-m", "cohort_grpo", "train", *options(tiny_dir, out, 4)], timeout=600)
    assert [r["async/staleness"] for r in step_records(out)] == [0.0, 1.0, 1.0]
    return out


@pytest.mark.slow
def test_two_trainers_and_a_sampler_train_what_one_process_trains_and_resume(root, tiny_dir, reference):

    split = root / "split"
    output = run(root, three_ranks(*options(tiny_dir, split, 2, "--rollout_gpus", "1")), timeout=600)
    # (3 steps + step 4's, which a longer run samples ahead before update 3, for the last checkpoint) × 2 trainers
    assert "cohort: rank 2 sampled 8 rollouts for trainer rank(s) 0, 1" in output
    assert_same_training(split, reference)
    assert not (split / "rank2").exists() and (split / "summary.json").is_file()

    # Resume at step 2: the rollout of step 3, sampled ahead before the checkpoint, comes back from it.
    resumed = root / "resumed"
    resumed.mkdir()
    shutil.copytree(split / "checkpoint-2", resumed / "checkpoint-2")
    output = run(root, three_ranks(*options(tiny_dir, resumed, 2, "--rollout_gpus", "1", "--resume", "true")),
                 timeout=600)
    assert "cohort: rank 2 sampled 0 rollouts" in output  # step 3's came back from the checkpoint
    assert_same_training(resumed, reference, slice(-1, None))


@pytest.mark.slow
def test_a_tensor_parallel_sampling_group_trains_what_one_process_trains(root, tiny_dir, reference):
    """One trainer, and ranks 1 and 2 as one sampling group over a 2-way split of the model (4 heads, 2 KV
    heads, the vocabulary): the engine's tokens are one process's, its log-probs within float32 rounding."""
    out = root / "tensor_parallel"
    output = run(root, three_ranks(*options(tiny_dir, out, 4, "--rollout_gpus", "2",
                                             "--rollout_tensor_parallel_size", "2")), timeout=600)
    assert ("rollouts: sampled on 2 rank(s) in 1 tensor-parallel group(s) of 2 (rollout_tensor_parallel_size), "
            "max_staleness 1") in output
    assert "cohort: rank 1 sampled 4 rollouts for trainer rank(s) 0" in output  # 3 steps + step 4's, sampled ahead
    assert "cohort: rank 2 sampled 4 rollouts for trainer rank(s) 0" in output  # the same calls, not sent
    assert_same_training(out, reference)
    # Version 0 arrives for step 1 and serves step 2 too (0.0: nothing to receive); version 1 arrives for step 3.
    synced = [r["time/weight_sync"] for r in step_records(out)]
    assert synced[0] > 0 and synced[1] == 0.0 and synced[2] > 0, synced


@pytest.mark.slow
@pytest.mark.parametrize("placement", [("--fsdp", "true"), ("--fsdp", "true", "--rollout_tensor_parallel_size", "2")],
                         ids=["whole_copies", "tensor_parallel_group"])
def test_fsdp2_ranks_sample_ahead_on_their_engines_own_copy_and_resume(root, tiny_dir, reference, placement):
    """Two FSDP2 ranks with asynchronous rollouts and no sampling ranks: each rank's engine (a whole copy, or its
    shard of a tensor-parallel group of 2) samples the next step's rollout during the update, on the copy the
    trainer refreshes in place once it is done; one process's run, and a resumed one, come out."""
    out = root / f"in_place_{len(placement)}"
    output = run(root, torchrun(*options(tiny_dir, out, 2, *placement)), timeout=600)
    if "--rollout_tensor_parallel_size" in placement:  # the step log says where and when the group samples
        assert ("in 1 tensor-parallel group(s) of 2" in output
                and "the next step's rollout is sampled during the update, one update behind" in output)
    assert_same_training(out, reference)
    resumed = root / f"in_place_resumed_{len(placement)}"
    resumed.mkdir()
    shutil.copytree(out / "checkpoint-2", resumed / "checkpoint-2")
    run(root, torchrun(*options(tiny_dir, resumed, 2, *placement, "--resume", "true")), timeout=600)
    assert_same_training(resumed, reference, slice(-1, None))


class QueueLink:
    """Two ends of a `RolloutLink` in one process: messages through queues (pickled, as on the wire), the
    weights broadcast through a shared list."""

    def __init__(self, placement, rank, wire, weights):
        self.placement, self.rank, self.wire, self.weights = placement, rank, wire, weights

    def send(self, obj, dst):
        import pickle

        self.wire[(self.rank, dst)].put(pickle.dumps(obj))

    def receive(self, src):
        import pickle

        return pickle.loads(self.wire[(src, self.rank)].get(timeout=30))

    def publish_weights(self, tensors, version=None):
        self.weights.put([t.clone() for t in tensors])

    def receive_weights(self, tensors, version=None):
        for target, source in zip(tensors, self.weights.get(timeout=30)):
            target.copy_(source)

    def flush(self):
        pass


def test_a_trainer_and_its_sampling_rank_exchange_requests_weights_and_rollouts():
    import queue
    import threading

    import torch

    from cohort_grpo.rollout.batch import Batch
    from cohort_grpo.rollout.remote import RemoteRollouts, RolloutServer
    from cohort_grpo.rollout.sampler import Rollout

    placement = Placement(world_size=2, rollout_gpus=1)
    wire = {(a, b): queue.Queue() for a in range(2) for b in range(2)}
    weights = queue.Queue()
    policy = torch.nn.Linear(2, 1, bias=False)
    seen = []

    def sample(rows, seed, sequence_offset):  # the rollout says which weights and request made it
        value = float(policy.weight.sum())
        seen.append((seed, value))
        ids = torch.full((len(rows), 3), seed)
        return Batch(rows=rows, prompt_ids=[[1]] * len(rows), rollout=Rollout(
            ids, torch.ones_like(ids), torch.full((len(rows), 3), value), ["stop"] * len(rows)),
            completions=["x"] * len(rows), rollout_metrics={"offset": sequence_offset})

    server = RolloutServer(QueueLink(placement, 1, wire, weights), policy, sample)
    served = []
    thread = threading.Thread(target=lambda: served.append(server.serve()))
    thread.start()
    trainer = RemoteRollouts(QueueLink(placement, 0, wire, weights), rank=0, max_staleness=1)
    assert trainer.steps_ahead(0) == [1, 2]
    v0 = {"weight": torch.full((1, 2), 0.5)}
    for step in (1, 2):
        trainer.submit(step, 0, v0, [{"prompt": "a"}, {"prompt": "b"}], seed=10 + step, sequence_offset=4)
    batch, version = trainer.take(1)
    assert version == 0 and batch.rollout.completion_ids.tolist() == [[11] * 3] * 2
    assert batch.rollout_metrics.pop("time/weight_sync") > 0  # version 0 arrived for this rollout
    assert batch.rollout.completion_ids.device.type == "cpu" and batch.rollout_metrics == {"offset": 4}
    assert trainer.steps_ahead(1) == [3]
    trainer.submit(3, 1, {"weight": torch.full((1, 2), 2.0)}, [{"prompt": "c"}], seed=13, sequence_offset=0)
    saved = trainer.state_dict()  # waits for steps 2 and 3, as a checkpoint does
    assert [item["step"] for item in saved["pending"]] == [2, 3]
    second = trainer.take(2)
    assert second[1] == 0 and second[0].rollout_metrics["time/weight_sync"] == 0.0  # it had version 0 already
    assert trainer.take(3)[0].rollout.logprobs[0, 0].item() == 4.0
    trainer.close()
    thread.join(timeout=30)
    assert served == [3] and seen == [(11, 1.0), (12, 1.0), (13, 4.0)]  # version 1's weights loaded for step 3
    with pytest.raises(CohortError, match="no rollout was requested for step 4"):
        trainer.take(4)


def test_one_engine_call_for_a_block_of_trainers_samples_what_their_own_calls_do(tiny_dir):
    """A sampling rank serving two trainers samples a step's requests in one engine call; each trainer's
    part is what sampling its own rows at its own offset gives, token for token."""
    import torch

    from cohort_grpo import GRPOConfig
    from cohort_grpo.run.policy import load_policy
    from cohort_grpo.rollout import make_sampler
    from cohort_grpo.rollout.group_sampler import GroupSampler
    from cohort_grpo.rollout.remote import split_by_blocks

    model, tokenizer = load_policy(tiny_dir, device="cpu", log=lambda line: None)
    args = GRPOConfig(num_generations=4, max_completion_length=12, temperature=1.0)
    sample = GroupSampler(make_sampler(model, tokenizer), tokenizer, args, tokenizer.pad_token_id)
    first, second = [{"prompt": "12+34="}, {"prompt": "5+6="}], [{"prompt": "70+8="}, {"prompt": "1+99="}]
    merged = split_by_blocks(sample(first + second, seed=7, sequence_offset=8), [2, 2])
    for part, (rows, offset) in zip(merged, ((first, 8), (second, 16))):
        alone = sample(rows, seed=7, sequence_offset=offset)
        assert part.completions == alone.completions and part.rows == alone.rows
        assert torch.equal(part.rollout.completion_ids, alone.rollout.completion_ids)
        assert torch.equal(part.rollout.completion_mask, alone.rollout.completion_mask)
        assert torch.allclose(part.rollout.logprobs, alone.rollout.logprobs, atol=1e-5)
        assert part.rollout.finish_reasons == alone.rollout.finish_reasons
    assert merged[0].completions != merged[1].completions  # the blocks' noise differs

    from cohort_grpo.rollout.remote import SAMPLE, RolloutServer

    server = RolloutServer(QueueLink(Placement(3, 1), 2, {}, None), model, sample, group_size=4, merge_requests=True)
    requests = {0: (SAMPLE, 3, 1, first, 7, 8), 1: (SAMPLE, 3, 1, second, 7, 16)}
    assert server.engine_calls([0, 1], requests) == [[0, 1]]
    for changed in ((SAMPLE, 3, 1, second, 7, 20), (SAMPLE, 3, 2, second, 7, 16), (SAMPLE, 3, 1, second, 8, 16)):
        assert server.engine_calls([0, 1], {**requests, 1: changed}) == [[0], [1]]  # not one batch's block


def test_a_rank_keeps_at_most_its_window_of_messages_in_flight(monkeypatch):
    """gloo's is_completed() stays False until wait(): the link waits for its oldest message to a rank once
    more than `messages_in_flight` are kept, so a long run does not hold every rollout it ever sent."""
    import itertools

    import torch.distributed as dist

    waited, numbers = [], itertools.count()

    class Work:
        def __init__(self):
            self.number = next(numbers)

        def is_completed(self):
            return False

        def wait(self):
            waited.append(self.number)

    monkeypatch.setattr(dist, "isend", lambda tensor, dst, group=None: Work())
    link = RolloutLink(Placement(3, 1), 2, None, None, None, messages_in_flight=3)
    for step in range(5):
        link.send(("rollout", step), 0)
    link.send(("rollout", 0), 1)
    assert [len(link.in_flight[rank]) for rank in (0, 1)] == [3, 1]
    assert waited == [0, 1, 2, 3]  # the two oldest messages to rank 0, two works (size, payload) each
    link.flush()
    assert link.in_flight == {} and sorted(waited) == list(range(12))


@pytest.mark.slow
def test_partial_rollouts_on_a_sampling_rank_stay_within_max_staleness_and_resume_exactly(root, tiny_dir):
    """Two trainers and a sampler with partial rollouts: every step gets complete groups no more than
    max_staleness versions old, some carried over from an earlier call, and a run resumed from a checkpoint
    (the sampling rank's pool comes back from it) trains what the uninterrupted run trains."""
    partial = ("--rollout_gpus", "1", "--partial_rollouts", "true", "--max_staleness", "2",
               "--max_completion_length", "16", "--max_steps", "5")
    whole = root / "partial"
    output = run(root, three_ranks(*options(tiny_dir, whole, 2, *partial)), timeout=600)
    # 5 steps and the 2 after them, requested ahead for the last checkpoint, × 2 trainers, less the calls the
    # carried-over groups spared
    assert "cohort: rank 2 sampled 12 rollouts for trainer rank(s) 0, 1" in output
    records = step_records(whole)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert all(r["async/staleness"] <= 2 for r in records) and records[0]["async/staleness"] == 0.0
    assert any(r["async/carried_groups"] > 0 for r in records)  # some groups were continued in a later call
    assert all(r["async/dropped_groups"] == 0 for r in records)

    resumed = root / "partial_resumed"
    resumed.mkdir()
    shutil.copytree(whole / "checkpoint-2", resumed / "checkpoint-2")
    output = run(root, three_ranks(*options(tiny_dir, resumed, 2, *partial, "--resume", "true")), timeout=600)
    # Steps 3 and 4 come back from the checkpoint; step 5 is sampled from the pool it kept, then the 2 steps after
    # max_steps, as in the uninterrupted run.
    assert "cohort: rank 2 sampled 4 rollouts" in output
    assert_same_training(resumed, whole, slice(-3, None))


EARLY_STOP = '''
import sys
from cohort_grpo import GRPOConfig, GRPOTrainer, SamplingRank, is_sampling_rank


class StopAfterOne:
    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop = True


args = GRPOConfig(output_dir=sys.argv[2], device="cpu", quiet=True, max_steps=4, async_rollouts=True, rollout_gpus=1,
                  max_staleness=int(sys.argv[3]), partial_rollouts=sys.argv[4] == "1", num_generations=4,
                  per_device_train_batch_size=8, max_completion_length=16, save_steps=0, eval_steps=0)
def say(line):  # one write of the whole line: the ranks share the pipe, and print's pieces interleaved with theirs
    sys.stdout.write(line + "\\n")
    sys.stdout.flush()


if is_sampling_rank(args):
    say(f"rollouts served: {SamplingRank(sys.argv[1], args).serve()}")
else:
    trainer = GRPOTrainer(sys.argv[1], lambda completions, **_: [float(len(c)) for c in completions],
                          [{"prompt": f"{a}+{a}="} for a in range(40)], args=args, callbacks=[StopAfterOne()])
    trainer.train()
    say(f"steps trained: {len(trainer.history)}")
'''


@pytest.mark.slow
@pytest.mark.parametrize("staleness, partial", [(1, "0"), (2, "1")])
def test_a_run_stopped_early_ends_cleanly_on_every_rank(root, tiny_dir, staleness, partial):
    """A callback stops the run after step 1 with later rollouts requested: the trainers take them before
    stopping, so the sampling rank's sends complete and every rank exits 0 (it used to fail in its flush)."""
    script = root / "early_stop.py"
    script.write_text(EARLY_STOP)
    out = root / f"early-{staleness}-{partial}"
    output = run(root, [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3",
                        str(script), str(tiny_dir), str(out), str(staleness), partial], timeout=300)
    assert output.count("steps trained: 1") == 2 and output.count("rollouts served: ") == 1  # 2 trainers, 1 sampler
    assert "cohort: rank 2 sampled" in output


@pytest.mark.slow
def test_sigterm_to_a_job_with_a_sampling_rank_saves_a_checkpoint_and_resumes(root, tiny_dir):
    """SIGTERM to `cohort-grpo train --nproc_per_node 3` with a sampling rank: torchrun passes it on to every rank
    (twice in a row); the trainers finish their step and save, the sampling rank serves them until then, the
    job exits 128 + 15, and --resume goes on from that checkpoint."""
    import json
    import signal
    import subprocess
    import time

    out = root / "sigterm"
    command = [sys.executable, "-m", "cohort_grpo", "train", "--nproc_per_node", "3",
               *train_options(tiny_dir, out, 2, "--async_rollouts", "true", "--rollout_gpus", "1",
                              "--max_steps", "400", "--logging_steps", "1")]
    process = subprocess.Popen(command, env=environment(root), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and process.poll() is None:
        if metrics.is_file() and sum('"loss"' in line for line in metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.5)
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 143, output[-3000:]
    stops = [line for line in output.splitlines() if line.startswith("cohort: stopped by SIGTERM after step")]
    assert len(stops) == 1, output[-3000:]  # rank 0 says it; every trainer rank saved with it
    step = int(stops[0].split("after step ")[1].split(";")[0])
    assert (out / f"checkpoint-{step}").is_dir() and 3 <= step < 400
    resumed = subprocess.run(command[:-4] + ["--max_steps", str(step + 2), "--logging_steps", "1", "--resume", "true"],
                             env=environment(root), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             timeout=300)
    assert resumed.returncode == 0 and f"resumed from {out / f'checkpoint-{step}'} at step {step}" in resumed.stdout, \
        resumed.stdout[-3000:]
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()
            if '"loss"' in line][-2:] == [step + 1, step + 2]
