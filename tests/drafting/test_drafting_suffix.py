"""Suffix automaton and group draft context vs brute-force n-gram counting."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seer_jax.drafting import Draft, DraftConfig, GroupDraftContext, SuffixAutomaton
from seer_jax.drafting.draft import merge_drafts
from seer_jax.errors import ConfigError, InputError


def plain_config(**kw) -> DraftConfig:
    """Plain suffix drafting: the longest match only, frequency ratios, one context per mode (the
    defaults add the request's own context, several match lengths, a prior and merged trees)."""
    base = dict(min_prob=0.1, match_candidates=1, prior=0.0, own_context=False, merge_trees=False)
    return DraftConfig(**{**base, **kw})


# -- brute force -----------------------------------------------------------------------------------


def occurrences(x: tuple, prompt: list, responses: list[list]) -> int:
    """End positions of x in the tree of texts: the prompt once, then each response continuing
    the prompt (occurrences ending inside the response part)."""
    n = len(x)
    if n == 0:
        return len(prompt) + sum(len(r) for r in responses)
    total = 0
    for e in range(n - 1, len(prompt)):
        if tuple(prompt[e - n + 1 : e + 1]) == x:
            total += 1
    for r in responses:
        text = prompt + r
        for e in range(max(len(prompt), n - 1), len(text)):
            if tuple(text[e - n + 1 : e + 1]) == x:
                total += 1
    return total


def continuations(x: tuple, prompt: list, responses: list[list], alphabet: int) -> dict:
    out = {}
    for c in range(alphabet):
        k = occurrences(x + (c,), prompt, responses)
        if k:
            out[c] = k
    return out


def brute_match(text: list, prompt, responses, alphabet, max_len) -> int:
    """Longest suffix (≤ max_len) of text followed by some token somewhere (0 if none)."""
    for n in range(min(max_len, len(text)), 0, -1):
        if continuations(tuple(text[len(text) - n :]), prompt, responses, alphabet):
            return n
    return 0


ALPHABET = 3


@st.composite
def group_history(draw):
    prompt = draw(st.lists(st.integers(0, ALPHABET - 1), max_size=8))
    g = draw(st.integers(1, 4))
    # interleaved appends: (request index, chunk)
    appends = draw(
        st.lists(
            st.tuples(st.integers(0, g - 1), st.lists(st.integers(0, ALPHABET - 1), min_size=1,
                                                      max_size=5)),
            max_size=12,
        )
    )
    max_len = draw(st.integers(1, 6))
    return prompt, g, appends, max_len


def replay(prompt, g, appends, max_len, mode="group"):
    ctx = GroupDraftContext(plain_config(mode=mode, max_match_len=max_len, min_prob=0.0), prompt)
    responses = [[] for _ in range(g)]
    for i in range(g):
        ctx.start_request(f"r{i}")
    for i, chunk in appends:
        ctx.append(f"r{i}", chunk)
        responses[i].extend(chunk)
    return ctx, responses


# -- properties ------------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(group_history())
def test_group_match_and_counts_equal_brute_force(hist):
    prompt, g, appends, max_len = hist
    ctx, responses = replay(prompt, g, appends, max_len)
    sam = ctx._sam
    for i in range(g):
        text = prompt + responses[i]
        seq = ctx._requests[f"r{i}"]
        state, length = sam.suffix_state(seq, max_len)
        assert length == min(max_len, len(text))
        # the state's count is the number of occurrences of that suffix
        suffix = tuple(text[len(text) - length :])
        assert sam.count(state) == occurrences(suffix, prompt, responses)
        state, length = sam.with_continuation(state, length)
        assert length == brute_match(text, prompt, responses, ALPHABET, max_len)
        got = {t: sam.count(s) for t, s in sam.children(state).items()}
        want = continuations(tuple(text[len(text) - length :]), prompt, responses, ALPHABET)
        if length == 0 and not got:
            continue
        assert got == want
        # maintained continuation statistics: total and most frequent child
        assert sam.continuation_total(state) == sum(want.values())
        assert want[sam.best_child(state)] == max(want.values())


@settings(max_examples=150, deadline=None)
@given(group_history())
def test_every_context_state_keeps_exact_statistics(hist):
    """For every distinct substring x (|x| ≤ max_len) of the group's texts: its state's count is
    the brute-force number of occurrences, its children counts the brute-force continuation counts,
    `continuation_total` their sum and `best_child` a most frequent one."""
    prompt, g, appends, max_len = hist
    ctx, responses = replay(prompt, g, appends, max_len)
    sam = ctx._sam
    texts = [prompt] + [prompt + r for r in responses]
    subs = {tuple(t[i:j]) for t in texts for i in range(len(t))
            for j in range(i + 1, min(len(t), i + max_len) + 1)}
    for x in subs:
        v = 0
        for tok in x:
            v = sam.children(v)[tok]
        assert sam.count(v) == occurrences(x, prompt, responses)
        want = continuations(x, prompt, responses, ALPHABET)
        assert {t: sam.count(s) for t, s in sam.children(v).items()} == want
        assert sam.continuation_total(v) == sum(want.values())
        if want:
            assert want[sam.best_child(v)] == max(want.values())
        else:
            assert sam.best_child(v) == -1


@settings(max_examples=100, deadline=None)
@given(group_history())
def test_per_request_mode_sees_only_own_text(hist):
    prompt, g, appends, max_len = hist
    ctx, responses = replay(prompt, g, appends, max_len, mode="per_request")
    for i in range(g):
        sam = ctx._own[f"r{i}"]
        text = prompt + responses[i]
        state, length = sam.with_continuation(*sam.suffix_state(0, max_len))
        assert length == brute_match(text, text, [], ALPHABET, max_len)
        got = {t: sam.count(s) for t, s in sam.children(state).items()}
        want = continuations(tuple(text[len(text) - length :]), text, [], ALPHABET)
        if length or got:
            assert got == want


@settings(max_examples=100, deadline=None)
@given(group_history(), st.lists(st.integers(0, ALPHABET - 1), max_size=10))
def test_pattern_match_is_longest_occurring_suffix(hist, pattern):
    prompt, g, appends, max_len = hist
    ctx, responses = replay(prompt, g, appends, max_len)
    sam = ctx._sam
    _, length = sam.match(pattern, max_len)
    want = 0
    for n in range(min(max_len, len(pattern)), 0, -1):
        if occurrences(tuple(pattern[len(pattern) - n :]), prompt, responses):
            want = n
            break
    assert length == want


@settings(max_examples=100, deadline=None)
@given(group_history(), st.integers(1, 4))
def test_draft_probabilities_follow_counts(hist, width):
    """Every draft node's path probability equals the product of brute-force count ratios along
    its path, with the context kept to the last max_len tokens; chains take the top count."""
    prompt, g, appends, max_len = hist
    ctx, responses = replay(prompt, g, appends, max_len)
    for i in range(g):
        text = prompt + responses[i]
        d = ctx.speculate(f"r{i}", max_nodes=6, max_depth=4, width=width, min_prob=0.0)
        d.validate()
        m = d.match_len
        assert m == brute_match(text, prompt, responses, ALPHABET, max_len)
        for node in range(len(d)):
            path = d.path_to(node)
            context = list(text[len(text) - m :]) if m else []
            prob = 1.0
            for tok in path:
                cont = continuations(tuple(context), prompt, responses, ALPHABET)
                assert tok in cont
                prob *= cont[tok] / sum(cont.values())
                context = (context + [tok])[-max_len:]
            assert d.probs[node] == pytest.approx(prob, rel=1e-5)
        if width == 1 and len(d):
            context = tuple(text[len(text) - m :])
            cont = continuations(context, prompt, responses, ALPHABET)
            assert cont[int(d.tokens[0])] == max(cont.values())


# -- examples --------------------------------------------------------------------------------------


def test_siblings_text_drives_group_drafts_but_not_per_request():
    prompt = [1, 2, 3]
    sibling = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
    for mode, expect in [("group", [13, 14, 15, 16, 17]), ("per_request", [])]:
        ctx = GroupDraftContext(plain_config(mode=mode), prompt)
        ctx.append("a", sibling)
        ctx.append("b", [10, 11, 12])
        d = ctx.speculate("b", max_nodes=5, max_depth=5)
        assert d.tokens.tolist() == expect
        if expect:
            assert d.parents.tolist() == [-1, 0, 1, 2, 3]
            assert d.match_len == 6  # prompt + [10, 11, 12]
            assert d.probs.tolist() == [1.0] * 5


def test_frequency_scoring_picks_majority_and_min_prob_stops():
    ctx = GroupDraftContext(plain_config(min_prob=0.5), [7])
    ctx.append("a", [1, 2, 3, 4])
    ctx.append("b", [1, 2, 3, 4])
    ctx.append("c", [1, 2, 5, 6])
    ctx.append("q", [9, 1, 2])
    d = ctx.speculate("q", max_nodes=4, max_depth=4)
    # after "1 2": 3 twice, 5 once -> 3 with p=2/3, then 4 (p stays 2/3), then nothing follows.
    assert d.tokens.tolist() == [3, 4]
    np.testing.assert_allclose(d.probs, [2 / 3, 2 / 3], rtol=1e-6)
    strict = ctx.speculate("q", max_nodes=4, max_depth=4, min_prob=0.7)
    assert len(strict) == 0


def test_multipath_tree_keeps_top_branches_within_budget():
    ctx = GroupDraftContext(plain_config(min_prob=0.0), [0])
    ctx.append("a", [1, 2, 3, 4])
    ctx.append("b", [1, 2, 3, 4])
    ctx.append("c", [1, 2, 5, 6])
    ctx.append("d", [1, 2, 7, 8])
    ctx.append("q", [1, 2])
    tree = ctx.speculate("q", max_nodes=4, max_depth=4, width=2)
    tree.validate()
    assert len(tree) == 4
    assert tree.tokens.tolist()[:2] == [3, 4]  # the majority path first (p=0.5, 0.5)
    assert set(tree.tokens.tolist()) <= {3, 4, 5, 6, 7, 8}
    assert not tree.is_chain
    # top-2 at the fork: the third branch (7) never appears with width 2
    wide = ctx.speculate("q", max_nodes=10, max_depth=4, width=2)
    assert 7 not in wide.tokens.tolist() and 5 in wide.tokens.tolist()
    assert len(ctx.speculate("q", max_nodes=10, max_depth=4, width=3)) == 6
    # node budget respected, depth respected
    assert len(ctx.speculate("q", max_nodes=3, max_depth=4, width=3)) == 3
    assert ctx.speculate("q", max_nodes=10, max_depth=1, width=3).depth == 1


def test_accepted_length_on_tree():
    d = Draft(np.array([5, 6, 7, 8], np.int32), np.array([-1, 0, -1, 2], np.int32),
              np.ones(4, np.float32))
    assert d.accepted_length([7, 8, 9]) == 2
    assert d.accepted_length([5, 9]) == 1
    assert d.accepted_length([1]) == 0
    assert Draft.chain([1, 2, 3]).accepted_length([1, 2, 3, 4]) == 3
    assert d.truncate(2).tokens.tolist() == [5, 6]


def test_pattern_speculation_matches_request_speculation():
    ctx = GroupDraftContext(plain_config(), [4, 4])
    ctx.append("a", [1, 2, 3, 1, 2, 3, 9])
    ctx.append("b", [1, 2])
    by_id = ctx.speculate("b")
    by_pattern = ctx.speculate_pattern([4, 4, 1, 2])
    assert by_id.tokens.tolist() == by_pattern.tokens.tolist() == [3, 1, 2, 3, 9]


def test_max_spec_factor_caps_depth_by_match_length():
    ctx = GroupDraftContext(plain_config(max_spec_factor=1.0, min_prob=0.0))
    ctx.append("a", list(range(20)))
    ctx.append("b", [5, 6])
    assert len(ctx.speculate("b", max_nodes=8, max_depth=8)) == 2


def test_bad_inputs_raise_project_errors():
    with pytest.raises(ConfigError, match="mode"):
        GroupDraftContext(DraftConfig(mode="bogus"))
    with pytest.raises(ConfigError, match="min_prob"):
        DraftConfig(min_prob=2.0).validate()
    ctx = GroupDraftContext(DraftConfig(), [1])
    ctx.append("a", [2])
    with pytest.raises(InputError, match="prompt"):
        ctx.set_prompt([3])
    with pytest.raises(InputError):
        SuffixAutomaton(0)


def test_match_candidates_prefers_the_better_scoring_shorter_context():
    def make(k):
        ctx = GroupDraftContext(plain_config(min_prob=0.1, match_candidates=k), [0])
        ctx.append("a", [5, 1, 2, 9])
        ctx.append("b", [1, 2, 3, 4, 5, 6])
        ctx.append("c", [1, 2, 3, 4, 5, 6])
        ctx.append("q", [5, 1, 2])
        return ctx

    longest = make(1).speculate("q")
    assert longest.tokens.tolist() == [9] and longest.match_len == 4  # "0 5 1 2"
    best = make(2).speculate("q")  # "1 2" -> 3 (2 of 3), 4, 5, 6: expected 2.67 > 1
    assert best.tokens.tolist() == [3, 4, 5, 6] and best.match_len == 2
    np.testing.assert_allclose(best.probs, [2 / 3] * 4, rtol=1e-6)
    with pytest.raises(ConfigError, match="match_candidates"):
        DraftConfig(match_candidates=0).validate()


def test_own_context_keeps_the_request_statistics_undiluted_by_siblings():
    # After "1 2 3 4" the siblings wrote 8 (twice) and the request itself 9 then "6 1 2 3 4".
    # The group context's majority is 8 (p = 2/3, then the siblings' texts end); the request's
    # own context repeats its loop with p = 1, a higher expected accepted length.
    def make(own: bool, mode: str = "group") -> GroupDraftContext:
        ctx = GroupDraftContext(plain_config(mode=mode, own_context=own, min_prob=0.1), [0])
        ctx.append("b", [1, 2, 3, 4, 8])
        ctx.append("c", [1, 2, 3, 4, 8])
        ctx.append("q", [1, 2, 3, 4, 9, 6, 1, 2, 3, 4])
        return ctx

    pooled = make(False).speculate("q", max_nodes=6, max_depth=6)
    assert pooled.tokens.tolist() == [8]
    np.testing.assert_allclose(pooled.probs, [2 / 3], rtol=1e-6)
    own = make(True).speculate("q", max_nodes=6, max_depth=6)
    assert own.tokens.tolist() == [9, 6, 1, 2, 3, 4]
    assert own.probs.tolist() == [1.0] * 6
    # the same draft as per-request mode here; the siblings still win where they know more
    assert make(False, "per_request").speculate("q", 6, 6).tokens.tolist() == [9, 6, 1, 2, 3, 4]
    ctx = make(True)
    ctx.append("r", [1, 2, 3])
    assert ctx.speculate("r", 6, 6).tokens.tolist() == [4, 8]
    # own automata are freed with the request; the group keeps its tokens
    n = ctx.num_tokens()
    ctx.finish_request("q")
    assert ctx.num_tokens() == n - (1 + 10)


def test_prior_discounts_rarely_seen_continuations():
    ctx = GroupDraftContext(plain_config(min_prob=0.0, prior=1.0), [0])
    ctx.append("a", [1, 2, 3, 4])
    ctx.append("b", [1, 2, 3, 5])
    ctx.append("q", [7, 2])
    d = ctx.speculate("q", max_nodes=3, max_depth=3)
    # "2" was followed by 3 twice: 2 / (2 + 1); then "2 3" by 4 and 5 once each: 1 / (2 + 1)
    assert d.tokens.tolist()[:2] == [3, 4] or d.tokens.tolist()[:2] == [3, 5]
    np.testing.assert_allclose(d.probs[:2], [2 / 3, 2 / 9], rtol=1e-6)
    # with min_prob 0.55 a continuation seen once (p = 1 / 2 with prior 1) is not drafted
    once = GroupDraftContext(plain_config(min_prob=0.55, prior=1.0), [0])
    once.append("a", [1, 2, 3])
    once.append("q", [1, 2])
    assert len(once.speculate("q")) == 0
    plain = GroupDraftContext(plain_config(min_prob=0.55), [0])
    plain.append("a", [1, 2, 3])
    plain.append("q", [1, 2])
    assert plain.speculate("q").tokens.tolist() == [3]
    with pytest.raises(ConfigError, match="prior"):
        DraftConfig(prior=-1.0).validate()


def test_merge_drafts_shares_equal_paths_and_keeps_the_most_probable_nodes():
    a = Draft.chain([3, 4, 5], [0.9, 0.6, 0.3], match_len=2)
    b = Draft(np.array([3, 7, 8], np.int32), np.array([-1, 0, -1], np.int32),
              np.array([0.95, 0.5, 0.2], np.float32), match_len=5)
    m = merge_drafts([a, Draft.empty(), b], max_nodes=10)
    m.validate()
    paths = sorted(tuple(m.path_to(i)) for i in range(len(m)))
    assert paths == [(3,), (3, 4), (3, 4, 5), (3, 7), (8,)]
    assert m.match_len == 5
    probs = {tuple(m.path_to(i)): float(m.probs[i]) for i in range(len(m))}
    assert probs[(3,)] == pytest.approx(0.95)  # the higher of the two drafts' estimates
    top3 = merge_drafts([a, b], max_nodes=3)
    top3.validate()
    assert sorted(tuple(top3.path_to(i)) for i in range(3)) == [(3,), (3, 4), (3, 7)]
    assert merge_drafts([a], max_nodes=2).tokens.tolist() == [3, 4]
    assert len(merge_drafts([], 4)) == 0


def test_merge_trees_unites_own_and_group_candidates():
    # four siblings wrote 8 after "1 2 3 4", the request 9 (group: p(9) = 1/5 < min_prob)
    texts = [(r, [1, 2, 3, 4, 8]) for r in "bcde"] + [("q", [1, 2, 3, 4, 9, 6, 1, 2, 3, 4])]

    def make(**kw) -> GroupDraftContext:
        ctx = GroupDraftContext(plain_config(own_context=True, min_prob=0.25, **kw), [0])
        for r, toks in texts:
            ctx.append(r, toks)
        return ctx

    tree = make(merge_trees=True).speculate("q", max_nodes=8, max_depth=4, width=2)
    tree.validate()
    firsts = {int(t) for t, p in zip(tree.tokens, tree.parents, strict=True) if p < 0}
    assert firsts == {8, 9}  # the siblings' majority and the request's own loop, side by side
    assert tree.path_to(len(tree) - 1) == [9, 6, 1, 2]
    best = make().speculate("q", max_nodes=8, max_depth=4, width=2)
    assert best.tokens.tolist() == [9, 6, 1, 2]  # own loop scores 4 > 0.8
