"""The host-side chain acceptance rule and the round commit (stop and budget cuts)."""

from dflash_iree.acceptance import accept_length, commit_round, tau_histogram


def test_accept_length_is_the_agreeing_prefix():
    assert accept_length([5, 6, 7], [5, 6, 7, 8]) == 3
    assert accept_length([5, 6, 7], [5, 9, 7, 8]) == 1
    assert accept_length([5, 6, 7], [1, 6, 7, 8]) == 0  # later agreement does not count


def test_commit_adds_the_bonus_token():
    r = commit_round([5, 6, 7], [5, 6, 9, 8], 2, frozenset(), budget=10)
    assert r.tokens == [5, 6, 9] and r.accepted == 2 and not r.done


def test_commit_cuts_at_stop_and_budget():
    r = commit_round([5, 6, 7], [5, 6, 7, 8], 3, frozenset({6}), budget=10)
    assert r.tokens == [5, 6] and r.accepted == 2 and r.done
    r = commit_round([5, 6, 7], [5, 6, 7, 8], 3, frozenset(), budget=2)
    assert r.tokens == [5, 6] and r.accepted == 2 and r.done
    r = commit_round([5, 6, 7], [5, 6, 7, 8], 3, frozenset({8}), budget=10)
    assert r.tokens == [5, 6, 7, 8] and r.accepted == 3 and r.done


def test_tau_histogram():
    assert tau_histogram([0, 0, 3, 7], 8) == [2, 0, 0, 1, 0, 0, 0, 1]


def _device_rule_disagreements(rule) -> int:
    """Random rounds where `rule` (the device count of export/aot.py's verify_draft) differs from
    accept_length, over a small vocab so that matches and later agreements are common."""
    import torch

    g = torch.Generator().manual_seed(0)
    S, B, wrong = 64, 8, 0
    block = torch.randint(0, 3, (S, B), generator=g)
    chosen = torch.randint(0, 3, (S, B), generator=g)
    n_draft = torch.randint(1, B, (S,), generator=g)
    # and the edges: every draft right with all B - 1 drafts or with fewer (the padding matching
    # too), and the first draft wrong
    chosen[:3, :-1] = block[:3, 1:]
    n_draft[:3] = torch.tensor([B - 1, 3, 1])
    chosen[3, 0] = block[3, 1] + 1
    got = rule(block, chosen, n_draft)
    for s in range(S):
        n = int(n_draft[s])
        wrong += int(got[s]) != accept_length(block[s, 1:1 + n].tolist(), chosen[s, :n + 1].tolist())
    return wrong


def test_device_count_is_accept_length():
    from dflash_iree.export.entry_points import accepted_drafts

    assert _device_rule_disagreements(accepted_drafts) == 0


def test_planted_control_fails_device_count_check():
    """A device count that also counts matches after the first miss must fail the same check."""
    import torch

    def counts_every_match(block, chosen, n_draft):
        i = torch.arange(block.shape[1] - 1)[None, :]
        return ((block[:, 1:] == chosen[:, :-1]) & (i < n_draft[:, None])).sum(1)

    assert _device_rule_disagreements(counts_every_match) > 0
