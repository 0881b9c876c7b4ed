"""The fast sampler (cohort_grpo/rollout/) against transformers' generate and independent computations.

Tiny random models of each family are built with transformers, saved, and loaded with
cohort_grpo.models.from_pretrained, so both implementations hold the same weights. CPU, float32.
"""

import math

import pytest
import torch
import transformers

from cohort_grpo.rollout import Engine, make_sampler
from cohort_grpo.rollout.sampling import gumbel_noise, min_p_filter, sample_from_logits, top_k_filter, top_p_filter
from cohort_grpo.rollout.scheduler import Scheduler
from cohort_grpo.rollout.sequence import Sequence
from cohort_grpo.errors import CohortError
from cohort_grpo.models import from_pretrained
from cohort_grpo.rollout.sampler import HFGenerateSampler, SamplingParams, apply_stop_strings, find_stop_string
from helpers import ENGINE_FAMILIES as FAMILIES, ENGINE_TINY as TINY, CharTokenizer

torch.set_num_threads(1)

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [42]]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_pair(request, tmp_path_factory):
    """(transformers model, cohort model) with identical weights."""
    config_class, model_class, extra = FAMILIES[request.param]
    torch.manual_seed(0)
    hf_model = model_class(config_class(**TINY, **extra)).eval()
    folder = tmp_path_factory.mktemp(request.param)
    hf_model.save_pretrained(folder)
    return hf_model, from_pretrained(folder)


@pytest.fixture(scope="module")
def qwen_pair(tmp_path_factory):
    config_class, model_class, extra = FAMILIES["qwen2"]
    torch.manual_seed(1)
    hf_model = model_class(config_class(**TINY, **extra)).eval()
    folder = tmp_path_factory.mktemp("qwen2_shared")
    hf_model.save_pretrained(folder)
    return hf_model, from_pretrained(folder)


def hf_greedy(hf_model, prompt, new_tokens):
    out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                            eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def greedy(max_new_tokens=12, **kwargs):
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, **kwargs)


# ---- greedy equals transformers -----------------------------------------------------------------
def test_greedy_matches_transformers_generate(family_pair):
    hf_model, model = family_pair
    rollout = Engine(model, max_batch_size=8, check_interval=5).generate(PROMPTS, 2, greedy(20))
    for i, prompt in enumerate(PROMPTS):
        expected = hf_greedy(hf_model, prompt, 20)
        assert rollout.completion_ids[2 * i].tolist() == expected
        assert rollout.completion_ids[2 * i + 1].tolist() == expected
    assert rollout.completion_mask.sum().item() == 20 * 2 * len(PROMPTS)
    assert rollout.finish_reasons == ["length"] * 2 * len(PROMPTS)


def test_samples_the_live_weights_and_restores_train_mode(qwen_pair):
    hf_model, model = qwen_pair
    engine = Engine(model, max_batch_size=4)
    model.train()
    first = engine.generate(PROMPTS[:2], 1, greedy(8))
    assert model.training, "generate must restore the caller's training mode"
    with torch.no_grad():  # an optimizer step changes the weights in place: the next rollout must see it
        theirs = dict(hf_model.named_parameters())
        for name, ours in model.named_parameters():  # the same names as transformers' (Model contract)
            noise = 0.05 * torch.randn_like(ours)
            ours.add_(noise)
            theirs[name].add_(noise)
    second = engine.generate(PROMPTS[:2], 1, greedy(8))
    model.eval()
    assert not torch.equal(first.completion_ids, second.completion_ids)
    for i, prompt in enumerate(PROMPTS[:2]):
        assert second.completion_ids[i].tolist() == hf_greedy(hf_model, prompt, 8)


# ---- sampling: seeds, log-probs ---------------------------------------------------------------
def test_fixed_seed_reproduces_and_seeds_differ(qwen_pair):
    _, model = qwen_pair
    engine = Engine(model, max_batch_size=8, check_interval=3)
    params = dict(max_new_tokens=16, temperature=1.0, top_p=0.95, top_k=50)
    a = engine.generate(PROMPTS, 3, SamplingParams(seed=7, **params))
    b = engine.generate(PROMPTS, 3, SamplingParams(seed=7, **params))
    c = engine.generate(PROMPTS, 3, SamplingParams(seed=8, **params))
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.completion_ids, c.completion_ids)
    assert len({tuple(row) for row in a.completion_ids.tolist()}) > 1, "samples of one prompt should differ"


def test_sampling_logprobs_equal_the_full_forwards_truncated_distribution(qwen_pair):
    _, model = qwen_pair
    temperature = 0.7
    rollout = Engine(model, max_batch_size=3, check_interval=4).generate(
        PROMPTS, 2, SamplingParams(max_new_tokens=14, temperature=temperature, top_p=0.9, seed=3))
    for row in range(rollout.completion_ids.shape[0]):
        prompt = PROMPTS[row // 2]
        count = int(rollout.completion_mask[row].sum())
        completion = rollout.completion_ids[row, :count]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + completion.tolist()]))[0].float()
        # logits at position t predict token t + 1: the completion's tokens are predicted from len(prompt) - 1 on;
        # the log-prob is of the distribution drawn from, renormalised over the top-p set
        expected = torch.log_softmax(top_p_filter(logits[len(prompt) - 1: -1] / temperature, 0.9), dim=-1)
        expected = expected.gather(-1, completion[:, None]).squeeze(-1)
        torch.testing.assert_close(rollout.logprobs[row, :count], expected, atol=1e-4, rtol=0)
        assert (rollout.logprobs[row, count:] == 0).all()


# ---- stopping -----------------------------------------------------------------------------------
def test_eos_ends_the_mask_at_the_first_eos(qwen_pair):
    _, model = qwen_pair
    engine = Engine(model, max_batch_size=8, check_interval=4)
    free = engine.generate(PROMPTS, 1, greedy(16))
    eos = free.completion_ids[0, 5].item()  # a token the first completion emits at step 6
    stopped = engine.generate(PROMPTS, 1, greedy(16, eos_token_ids=[eos], pad_token_id=299))
    for row, tokens in enumerate(free.completion_ids.tolist()):
        expected_len = tokens.index(eos) + 1 if eos in tokens else 16
        mask = stopped.completion_mask[row]
        assert mask.sum().item() == expected_len and mask[:expected_len].all()
        assert stopped.completion_ids[row, :expected_len].tolist() == tokens[:expected_len]
        assert (stopped.completion_ids[row, expected_len:] == 299).all()
        assert stopped.finish_reasons[row] == ("stop" if eos in tokens else "length")
    assert stopped.finish_reasons[0] == "stop"


def test_stop_string_cuts_after_the_completing_token(qwen_pair):
    _, model = qwen_pair
    tokenizer = CharTokenizer()
    engine = Engine(model, tokenizer=tokenizer, max_batch_size=8, check_interval=3)
    free = engine.generate(PROMPTS, 1, greedy(20))
    tokens0 = free.completion_ids[0].tolist()
    stop = tokenizer.decode(tokens0[6:8])[-3:]  # ends inside token 8's text: spans tokens 7-8 or one of them
    stopped = engine.generate(PROMPTS, 1, greedy(20, stop=[stop]))
    for row, tokens in enumerate(free.completion_ids.tolist()):
        text, expected_len, found = "", 20, False
        for t, token in enumerate(tokens):  # independent: grow the text one token at a time
            text += tokenizer.decode([token])
            if stop in text:
                expected_len, found = t + 1, True
                break
        assert stopped.completion_mask[row].sum().item() == expected_len
        assert stopped.completion_ids[row, :expected_len].tolist() == tokens[:expected_len]
        assert stopped.finish_reasons[row] == ("stop" if found else "length")
    assert stopped.completion_mask[0].sum().item() <= 8


def test_find_stop_string_scans_only_new_tokens_and_the_lookback():
    tokenizer = CharTokenizer()  # 0 -> "a", 1 -> "bb", 2 -> "ccc", 13 -> "dd"
    assert find_stop_string(tokenizer, [0, 1, 2], 0, ["bc"]) == 3
    assert find_stop_string(tokenizer, [0, 1, 2], 0, ["zz"]) is None
    assert find_stop_string(tokenizer, [0, 1, 2, 13], 3, ["cd"]) == 4  # spans the previous check
    assert find_stop_string(tokenizer, [0, 1, 2], 3, ["bc"]) is None  # nothing new to scan


def test_find_stop_string_cuts_at_the_shortest_prefix_holding_a_stop_string():
    """The bisection's cut equals a scan of every prefix, on random token strings."""
    tokenizer, generator = CharTokenizer(), torch.Generator().manual_seed(0)
    for _ in range(200):
        tokens = torch.randint(0, 10, (int(torch.randint(1, 30, (1,), generator=generator)),),
                               generator=generator).tolist()
        stop = ["".join("abcdefghij"[int(i)] for i in torch.randint(0, 10, (2,), generator=generator))]
        expected = next((n for n in range(1, len(tokens) + 1) if stop[0] in tokenizer.decode(tokens[:n])), None)
        assert find_stop_string(tokenizer, tokens, 0, stop) == expected


class ByteTokenizer:
    """One token per UTF-8 byte: a character like "é" spans two tokens."""

    def decode(self, ids, skip_special_tokens=False):
        return bytes(ids).decode("utf-8", errors="replace")


def test_hf_fallback_stop_strings_decode_characters_split_over_tokens():
    """The HF fallback cuts where the engine would: after the token completing the first stop
    string, with the tokens decoded together (decoded one by one, "é" would be two "�")."""
    texts = ["abc café! more", "no stop here", "é!é!", "!"]
    rows = [list(text.encode()) for text in texts]
    ids = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, tokens in enumerate(rows):
        ids[row, : len(tokens)] = torch.tensor(tokens)
        mask[row, : len(tokens)] = 1
    cut_mask, stopped = apply_stop_strings(ids, mask, ["é!"], ByteTokenizer())
    assert stopped.tolist() == [True, False, True, False]
    kept = [ByteTokenizer().decode(ids[row, : int(cut_mask[row].sum())].tolist()) for row in range(len(rows))]
    assert kept == ["abc café!", "no stop here", "é!", "!"]


def test_max_seq_len_caps_the_completion(qwen_pair):
    _, model = qwen_pair
    rollout = Engine(model, max_batch_size=4, max_seq_len=16).generate(PROMPTS, 1, greedy(10))
    lengths = rollout.completion_mask.sum(1).tolist()
    assert lengths == [min(10, 16 - len(p)) for p in PROMPTS]
    assert rollout.finish_reasons == ["length"] * len(PROMPTS)


# ---- continuous batching ------------------------------------------------------------------------
@pytest.mark.parametrize("bucketed", [False, True], ids=["exact-width", "graph-buckets"])
def test_continuous_batching_matches_one_big_batch(qwen_pair, bucketed):
    """bucketed: pad steps to the CUDA-graph widths / KV lengths (run eagerly here on the CPU)."""
    _, model = qwen_pair
    prompts = [[(7 * i + j) % 300 for j in range(1 + i % 5)] for i in range(9)]
    big = Engine(model, max_batch_size=64).generate(prompts, 2, greedy(14))
    eos = big.completion_ids[0, 4].item()  # finishing at different steps exercises retire/admit/compact
    params = greedy(14, eos_token_ids=[eos])
    expected = Engine(model, max_batch_size=64).generate(prompts, 2, params)
    small_engine = Engine(model, max_batch_size=5 if bucketed else 3, check_interval=2)
    small_engine.bucketed = bucketed
    small = small_engine.generate(prompts, 2, params)
    assert torch.equal(small.completion_ids, expected.completion_ids)
    assert torch.equal(small.completion_mask, expected.completion_mask)
    assert small.finish_reasons == expected.finish_reasons
    assert len(set(expected.completion_mask.sum(1).tolist())) > 1
    # Rows are retired within one check interval of finishing: decode work is bounded by the
    # tokens generated (the first comes from prefill) plus one interval per sequence.
    generated = small.completion_mask.sum().item()
    stats = small_engine.stats
    assert stats["slot_moves"] > 0, "the tail of the run should have packed the survivors"
    if not bucketed:
        assert stats["decode_row_steps"] <= generated - len(small.finish_reasons) + 2 * len(small.finish_reasons)


def test_a_shared_prompt_is_prefilled_once_and_each_completion_samples_as_if_alone(qwen_pair):
    """G completions of a prompt: one prefill row per distinct prompt, its keys and values copied
    to the others. Against an engine with one slot, which prefills every sequence on its own."""
    _, model = qwen_pair
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0]]  # a prompt repeated across the list is shared too
    params = SamplingParams(max_new_tokens=9, temperature=1.0, seed=11)
    engine = Engine(model, max_batch_size=16)
    shared = engine.generate(prompts, 4, params)
    assert engine.stats["prefill_shared_rows"] == 12 - 2  # 12 sequences, 2 distinct prompts
    lens = engine.cache.prefix_lens.tolist()  # each prompt's own length, not the chunk's padded width
    assert sorted(lens)[-10:] == [len(PROMPTS[1])] * 3 + [len(PROMPTS[0])] * 7 and lens.count(0) == len(lens) - 10
    assert engine.stats["prefill_tokens"] == 2 * len(PROMPTS[0])  # one chunk, padded to the longer prompt
    alone_engine = Engine(model, max_batch_size=1)
    alone = alone_engine.generate(prompts, 4, params)
    assert alone_engine.stats["prefill_shared_rows"] == 0
    assert torch.equal(shared.completion_ids, alone.completion_ids)
    assert torch.allclose(shared.logprobs, alone.logprobs, atol=1e-5)
    assert len({tuple(row) for row in shared.completion_ids[:4].tolist()}) > 1, "one prompt's draws must differ"

def test_kv_cache_prefix_table_follows_shares_rewrites_and_moves():
    from cohort_grpo.models.cache import KVCache

    cache = KVCache(2, 6, 1, 8, 4)
    for keys in cache.k_layers:
        keys.copy_(torch.randn_like(keys))
    t = torch.tensor
    cache.share_prefix(t([0, 0]), t([1, 2]), 5, t([3, 3]))
    cache.share_prefix(t([4]), t([5]), 5, t([2]))
    assert cache.prefix_rows.tolist() == [0, 0, 0, 3, 4, 4] and cache.prefix_lens.tolist() == [0, 3, 3, 0, 0, 2]
    for keys in cache.k_layers:  # every row keeps its own copy too (paths that ignore the table read it)
        assert torch.equal(keys[1, :, :5], keys[0, :, :5]) and torch.equal(keys[5, :, :5], keys[4, :, :5])
        assert not torch.equal(keys[1, :, 5:], keys[0, :, 5:])
    cache.own_rows(t([0, 3]))  # rows 0 and 3 are about to be prefilled anew: 1 and 2 lose their source
    assert cache.prefix_rows.tolist() == [0, 1, 2, 3, 4, 4] and cache.prefix_lens.tolist() == [0, 0, 0, 0, 0, 2]
    cache.move_rows(t([5]), t([3]))  # compaction: nobody reads another row afterwards
    assert cache.prefix_rows.tolist() == list(range(6)) and cache.prefix_lens.tolist() == [0] * 6

def test_scheduler_admits_lowest_slots_and_compacts():
    scheduler = Scheduler(num_slots=4, buckets=[1, 2, 4])
    sequences = [Sequence(index=i, prompt=[1], limit=4) for i in range(5)]
    scheduler.add(sequences)
    assert [seq.slot for seq in scheduler.admit()] == [0, 1, 2, 3]
    scheduler.retire(sequences[0])
    scheduler.retire(sequences[1])
    assert [(seq.index, seq.slot) for seq in scheduler.admit()] == [(4, 0)]  # lowest free slot; 1 stays free
    assert scheduler.width() == 4
    scheduler.retire(sequences[2])
    scheduler.retire(sequences[4])  # running: index 3 in slot 3 only
    assert scheduler.width() == 4
    assert scheduler.compaction_moves() == [(3, 0)]
    scheduler.apply_moves([(3, 0)])
    assert sequences[3].slot == 0 and scheduler.width() == 1
    assert not scheduler.done
    scheduler.retire(sequences[3])
    assert scheduler.done and len(scheduler.finished) == 5


# ---- the sampling functions ---------------------------------------------------------------------
def probabilities(logits):
    return torch.softmax(logits.double(), dim=-1)


def test_top_k_keeps_the_k_largest():
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(0))
    kept = top_k_filter(logits, 5).isfinite()
    for row in range(6):
        order = sorted(range(40), key=lambda i: -logits[row, i].item())
        assert set(torch.nonzero(kept[row]).flatten().tolist()) == set(order[:5])


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(1)) * 2
    for top_p in (0.1, 0.5, 0.9):
        kept = top_p_filter(logits, top_p).isfinite()
        probs = probabilities(logits)
        for row in range(6):
            order = sorted(range(40), key=lambda i: -probs[row, i].item())
            expected, mass = set(), 0.0
            for i in order:  # add tokens from the most probable until the mass reaches top_p
                expected.add(i)
                mass += probs[row, i].item()
                if mass >= top_p:
                    break
            assert set(torch.nonzero(kept[row]).flatten().tolist()) == expected


def test_min_p_keeps_tokens_above_a_fraction_of_the_top():
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(2)) * 2
    kept = min_p_filter(logits, 0.1).isfinite()
    probs = probabilities(logits)
    for row in range(6):
        top = probs[row].max().item()
        expected = {i for i in range(40) if probs[row, i].item() >= 0.1 * top}
        assert set(torch.nonzero(kept[row]).flatten().tolist()) == expected


def test_sample_frequencies_follow_the_filtered_distribution():
    base = torch.tensor([2.0, 1.5, 1.0, 0.0, -1.0, -3.0])
    logits = base.expand(40000, 6)
    tokens, logprobs = sample_from_logits(logits, temperature=0.8, top_k=4, seed=torch.tensor(11))
    expected = probabilities(base / 0.8)[:4]
    expected = expected / expected.sum()
    counts = torch.bincount(tokens, minlength=6).double() / tokens.numel()
    assert counts[4:].sum() == 0, "tokens outside the top-k must never be sampled"
    assert torch.allclose(counts[:4], expected, atol=0.01)
    # log-probs are of the distribution drawn from: temperature-scaled, renormalised over the top-k
    assert torch.allclose(logprobs.double(), expected.log()[tokens], atol=1e-6)


def test_counter_based_noise_is_gumbel_and_keyed_by_seed_draw_and_row():
    rows = torch.arange(3000)
    noise = gumbel_noise(torch.tensor(5), torch.tensor(2), rows, 400).double()
    # Gumbel(0, 1): mean = Euler–Mascheroni constant, std = π/√6
    assert abs(noise.mean().item() - 0.5772157) < 0.01
    assert abs(noise.std().item() - math.pi / math.sqrt(6)) < 0.01
    uniform = torch.exp(-torch.exp(-noise))  # back to U(0, 1): every tenth of the range equally full
    counts = torch.histc(uniform.float(), bins=10, min=0, max=1) / uniform.numel()
    assert (counts - 0.1).abs().max() < 0.003
    # a row's numbers depend only on (seed, draw, row): the same whatever else is in the batch
    some = gumbel_noise(torch.tensor(5), torch.tensor(2), torch.tensor([7, 2999]), 400)
    assert torch.equal(some, noise[[7, 2999]].float())
    for other in (gumbel_noise(torch.tensor(6), torch.tensor(2), rows, 400),
                  gumbel_noise(torch.tensor(5), torch.tensor(3), rows, 400)):
        correlation = torch.corrcoef(torch.stack([noise.flatten().float(), other.flatten()]))[0, 1]
        assert abs(correlation.item()) < 0.01
    neighbours = torch.corrcoef(torch.stack([noise[:-1].flatten(), noise[1:].flatten()]))[0, 1]
    assert abs(neighbours.item()) < 0.01


def test_greedy_takes_the_argmax():
    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(3))
    tokens, logprobs = sample_from_logits(logits, temperature=0.0)
    assert tokens.tolist() == [max(range(30), key=lambda i: logits[r, i].item()) for r in range(5)]
    expected = [logits[r, tokens[r]].item() - math.log(logits[r].double().exp().sum().item()) for r in range(5)]
    assert torch.allclose(logprobs, torch.tensor(expected), atol=1e-5)


# ---- entry point and input errors ---------------------------------------------------------------
def test_make_sampler_picks_the_engine_or_the_fallback(qwen_pair, capsys):
    hf_model, model = qwen_pair
    assert isinstance(make_sampler(model, None, max_batch_size=4), Engine)
    assert capsys.readouterr().out == ""
    assert isinstance(make_sampler(hf_model, None), HFGenerateSampler)
    assert len(capsys.readouterr().out.strip().splitlines()) == 1


def test_bad_input_raises_cohort_error(qwen_pair):
    _, model = qwen_pair
    engine = Engine(model, max_batch_size=2, max_seq_len=8)
    with pytest.raises(CohortError, match="tokenizer"):
        engine.generate(PROMPTS, 1, SamplingParams(stop=["x"]))
    with pytest.raises(CohortError, match="prompt 1"):
        engine.generate([[1], []], 1, SamplingParams())
    with pytest.raises(CohortError, match="max_seq_len"):
        engine.generate([[1] * 8], 1, SamplingParams())


# ---- fused projections: one GEMM for q/k/v and for gate/up, no weight copy --------------------
def test_fused_projections_share_storage_and_follow_training(tmp_path):
    torch.manual_seed(3)
    config = transformers.Qwen2Config(**TINY, tie_word_embeddings=True)  # Qwen2: q/k/v carry biases
    transformers.Qwen2ForCausalLM(config).save_pretrained(tmp_path / "m")
    model = from_pretrained(tmp_path / "m")
    reference = from_pretrained(tmp_path / "m")
    ids = torch.tensor([PROMPTS[2]])
    names_before = list(model.state_dict())
    model.fuse_projections()
    attn = model.model.layers[0].self_attn
    weight, bias = attn.fused_qkv
    # q, k and v are consecutive slices of the fused matrix: the same memory, not a copy
    assert weight.data_ptr() == attn.q_proj.weight.data_ptr()
    assert torch.equal(weight, torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
    assert torch.equal(bias, torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]))
    assert list(model.state_dict()) == names_before
    with torch.no_grad():
        assert torch.allclose(model(ids), reference(ids), atol=1e-5)  # the fused path
    # training uses the separate parameters, and its in-place updates show in the fused view
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for net, opt in ((model, optimizer), (reference, reference_optimizer)):
        net(ids).logsumexp(-1).mean().backward()
        opt.step()
    assert attn.q_proj.weight.grad is not None
    assert torch.equal(attn.fused_qkv[0][: attn.q_proj.weight.shape[0]], attn.q_proj.weight)
    with torch.no_grad():
        assert torch.allclose(model(ids), reference(ids), atol=1e-5)
    model.save_pretrained(tmp_path / "saved")  # safetensors accepts the slices (saved as copies)
    assert torch.allclose(from_pretrained(tmp_path / "saved")(ids), reference(ids), atol=1e-5)
    # a parameter given its own storage again: the stale view is not used, and fusing re-points it
    attn.q_proj.weight.data = attn.q_proj.weight.data.clone() + 1.0
    with torch.no_grad():
        unfused = model(ids)
        model.fuse_projections()
        assert torch.allclose(model(ids), unfused, atol=1e-5)

