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
