from collections import defaultdict

import pytest
import torch

from genrl.data.sampler import PromptGroupSampler, check_batch_sizes, trained_samples_per_epoch


def _all_ranks(num_processes, *, num_prompts=13, group_size=4, batch_size=6, batches_per_epoch=2, seed=7):
    return [
        PromptGroupSampler(num_prompts, group_size, batch_size, batches_per_epoch, num_processes, rank, seed)
        for rank in range(num_processes)
    ]


@pytest.mark.parametrize("num_processes", [1, 2, 4])
def test_groups_are_whole_on_one_rank(num_processes):
    # 5 prompts, 3 groups per rank: with 2 or 4 ranks some prompts are drawn twice in an epoch.
    K = 4
    samplers = _all_ranks(num_processes, num_prompts=5)
    for epoch in range(3):
        draw = samplers[0].epoch_groups(epoch)
        copies = defaultdict(list)  # (rank, prompt) -> indices in group seen on that rank
        for s in samplers:
            for batch in s.batches(epoch):
                for prompt, k in batch:
                    copies[(s.rank, prompt)].append(k)
        for (rank, prompt), ks in copies.items():
            # Whole groups only: each index 0..K-1 appears equally often on the rank.
            assert len(ks) % K == 0
            assert sorted(ks) == sorted(list(range(K)) * (len(ks) // K))
        for prompt in set(draw):
            total = sum(len(ks) for (_, p), ks in copies.items() if p == prompt)
            assert total == K * draw.count(prompt)


@pytest.mark.parametrize("num_processes", [1, 2, 4])
def test_each_group_is_contiguous_and_complete(num_processes):
    # Without repeats (G <= num_prompts) every group is one prompt on one rank, indices 0..K-1 in order.
    samplers = _all_ranks(num_processes, num_prompts=100, group_size=3, batch_size=4, batches_per_epoch=3)
    seen = {}
    for s in samplers:
        flat = [pair for batch in s.batches(0) for pair in batch]
        for start in range(0, len(flat), 3):
            group = flat[start : start + 3]
            prompts = {p for p, _ in group}
            assert len(prompts) == 1
            assert [k for _, k in group] == [0, 1, 2]
            prompt = prompts.pop()
            assert prompt not in seen, "a prompt was drawn twice while prompts remained"
            seen[prompt] = s.rank


@pytest.mark.parametrize("num_prompts", [2, 100])
def test_group_ids_name_each_samples_group_in_batch_order(num_prompts):
    # With 2 prompts and 6 groups per epoch a prompt is drawn three times: each draw is its own
    # group, so the advantage of a sample is never normalised against another draw's samples.
    samplers = _all_ranks(2, num_prompts=num_prompts, group_size=3, batch_size=3, batches_per_epoch=3)
    all_ids = []
    for s in samplers:
        flat = [pair for batch in s.batches(0) for pair in batch]
        ids = s.group_ids()
        assert ids.dtype == torch.long and ids.shape == (len(flat),)
        draw = s.epoch_groups(0)
        for (prompt, k), group in zip(flat, ids.tolist()):
            assert draw[group] == prompt
        assert [k for _, k in flat] == [i % 3 for i in range(len(flat))]
        all_ids.append(ids)
    assert torch.cat(all_ids).tolist() == [g for g in range(6) for _ in range(3)]


@pytest.mark.parametrize("num_processes", [1, 2, 4])
def test_every_rank_gets_same_batches_and_union_is_global_draw(num_processes):
    samplers = _all_ranks(num_processes)
    for epoch in range(2):
        draws = [s.epoch_groups(epoch) for s in samplers]
        assert all(d == draws[0] for d in draws), "ranks disagree on the epoch's draw"
        assert len(draws[0]) == num_processes * 2 * 6 // 4
        dealt = []
        for s in samplers:
            batches = s.batches(epoch)
            assert len(batches) == 2
            assert all(len(b) == 6 for b in batches)
            flat = [pair for b in batches for pair in b]
            dealt.extend(p for p, k in flat if k == 0)
        assert dealt == draws[0]


def test_draw_is_without_replacement_while_prompts_last():
    # 4 ranks x 12 samples / 4 = 12 groups from 13 prompts: no repeats.
    draw = _all_ranks(4)[0].epoch_groups(0)
    assert len(set(draw)) == len(draw) == 12
    # 3 groups from 2 prompts: the first two are a permutation, then a fresh one starts.
    s = PromptGroupSampler(2, 2, 3, 2, 1, 0, seed=1)
    draw = s.epoch_groups(5)
    assert len(draw) == 3 and sorted(draw[:2]) == [0, 1]


def test_deterministic_per_epoch_and_changes_across_epochs():
    a = PromptGroupSampler(50, 4, 8, 2, 2, 1, seed=3)
    b = PromptGroupSampler(50, 4, 8, 2, 2, 1, seed=3)
    assert a.batches(4) == b.batches(4)
    assert a.batches(4) != a.batches(5)
    assert a.batches(4) != PromptGroupSampler(50, 4, 8, 2, 2, 1, seed=4).batches(4)


@pytest.mark.parametrize("num_processes", [1, 8])
def test_check_batch_sizes_accepts_exactly_the_sizes_that_keep_groups_and_steps_whole(num_processes):
    """Over a grid of sizes: accepted iff one rank's epoch holds whole prompt groups and whole
    micro batches (neither a false refusal nor a size that would split a group)."""
    for group_size in range(2, 7):
        for rollout in range(1, 13):
            for batches in (1, 2, 3):
                for micro in (1, 2, 4, 6):
                    per_rank = rollout * batches
                    whole = per_rank % group_size == 0 and per_rank % micro == 0
                    try:
                        check_batch_sizes(group_size=group_size, train_batch_size=rollout, num_processes=num_processes,
                                          batches_per_epoch=batches, num_prompts=10, train_micro_batch_size=micro)
                        accepted = True
                    except ValueError:
                        accepted = False
                    assert accepted == whole, (group_size, rollout, batches, micro)


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(group_size=1), r"--group_size must be at least 2.*got 1"),
        (dict(train_batch_size=3), r"--rollout_batch_size 3 × --rollout_batches_per_epoch 2 = 6 samples per process.*"
                                   r"not a multiple of --group_size 4.*use e\.g\. --rollout_batch_size 4\.$"),
        (dict(batches_per_epoch=3, train_batch_size=2), r"2 × .* 3 = 6 samples.*--group_size 4.*--rollout_batch_size 4\.$"),
        (dict(num_prompts=0), r"prompt set is empty \(num_prompts=0\)"),
        (dict(train_micro_batch_size=3), r"--train_batch_size × --gradient_accumulation_steps = 3 does not divide the .* 8 "
                                         r"samples.*e\.g\. --train_batch_size 2 --gradient_accumulation_steps 1\.$"),
        (dict(num_processes=0), r"number of processes \(--num_processes\) must be a positive integer, got 0"),
        (dict(train_samples_per_group=5), r"--train_samples_per_group must be between 2 .* --group_size 4 \(which trains every sample\), got 5\.$"),
        (dict(train_samples_per_group=1), r"--train_samples_per_group must be between 2 .*, got 1\.$"),
        (dict(train_samples_per_group=3, train_micro_batch_size=4), r"--train_samples_per_group 3 of each of the 2 groups "
                                                                    r"per process per epoch is 6 samples, not a multiple.* = 4;"),
    ],
)
def test_check_batch_sizes_refuses_bad_sizes(kwargs, pattern):
    sizes = dict(group_size=4, train_batch_size=4, num_processes=2, batches_per_epoch=2, num_prompts=10)
    sizes.update(kwargs)
    with pytest.raises(ValueError, match=pattern):
        check_batch_sizes(**sizes)


def test_check_batch_sizes_counts_only_the_trained_samples_of_each_group():
    """With --train_samples_per_group the micro batches divide the trained samples, not the sampled
    ones: 2 groups of 8 per rank keep 3 each (6), which micro batches of 6 divide and of 4 do not."""
    sizes = dict(group_size=8, train_batch_size=8, num_processes=2, batches_per_epoch=2, num_prompts=10)
    check_batch_sizes(**sizes, train_micro_batch_size=6, train_samples_per_group=3)
    with pytest.raises(ValueError, match="does not divide"):
        check_batch_sizes(**sizes, train_micro_batch_size=6)
    with pytest.raises(ValueError, match="is 6 samples, not a multiple"):
        check_batch_sizes(**sizes, train_micro_batch_size=4, train_samples_per_group=3)


def test_trained_samples_per_epoch_counts_groups_times_the_kept_samples():
    """The count the log line and the progress bar use: 32 x 8 samples in groups of 16 are 16
    groups, 8 kept of each (the default run) is 128; without down-sampling every sample trains."""
    assert trained_samples_per_epoch(32, 8, 16, 8) == 128
    assert trained_samples_per_epoch(32, 8, 16) == 256
    assert trained_samples_per_epoch(8, 2, 8, 3) == 6


def test_sampler_refuses_bad_sizes_and_rank():
    with pytest.raises(ValueError, match="not a multiple of --group_size 4"):
        PromptGroupSampler(10, 4, 3, 1, 2, 0, seed=0)
    with pytest.raises(ValueError, match=r"rank 2 is outside \[0, 2\)"):
        PromptGroupSampler(10, 4, 4, 1, 2, 2, seed=0)


@pytest.mark.parametrize("group_size, rollout, batches, micro", [(3, 4, 2, 4), (3, 8, 1, 8), (5, 8, 2, 16), (6, 32, 4, 64)])
def test_the_suggested_rollout_batch_size_passes_every_check(group_size, rollout, batches, micro):
    """The value an error suggests must not fail again on the next check."""
    with pytest.raises(ValueError, match="--rollout_batch_size") as error:
        check_batch_sizes(group_size=group_size, train_batch_size=rollout, num_processes=1, batches_per_epoch=batches,
                          train_micro_batch_size=micro)
    suggested = int(str(error.value).rsplit("--rollout_batch_size ", 1)[1].rstrip("."))
    check_batch_sizes(group_size=group_size, train_batch_size=suggested, num_processes=1, batches_per_epoch=batches,
                      train_micro_batch_size=micro)


def test_an_epoch_with_more_groups_than_prompts_says_so_and_names_the_count_that_avoids_it():
    # 2 ranks x 3 groups = 6 groups an epoch: 5 prompts repeat one (with the same images), 6 do not.
    five, six = (_all_ranks(2, num_prompts=n, group_size=4, batch_size=6, batches_per_epoch=2)[0] for n in (5, 6))
    message = five.repeats_warning()
    assert "6 prompt groups" in message and "from 5 prompts" in message and "at least 6 prompts" in message
    assert six.repeats_warning() is None
