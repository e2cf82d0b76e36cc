"""Each metric against values computed by hand (the arithmetic is in the comments)."""

import pytest

from forecastkv.eval import metrics as m


def test_string_match_all_and_part():
    # 123 and 456 found, 789 not: 2 of 3; matching ignores case
    assert m.string_match_all("The numbers are 123 and 456.", ["123", "456", "789"]) == pytest.approx(2 / 3)
    assert m.string_match_all("ABC def", ["abc"]) == 1.0
    assert m.string_match_part("The numbers are 123 and 456.", ["789", "456"]) == 1.0
    assert m.string_match_part("nothing", ["789"]) == 0.0
    with pytest.raises(ValueError, match="at least one reference"):
        m.string_match_all("x", [])


def test_qa_f1():
    # pred -> [eiffel, tower, in, paris] (punctuation and "the" dropped); ref -> [eiffel, tower, paris, france]
    # overlap 3: P = R = 3/4 -> F1 = 0.75
    assert m.qa_f1_score("The Eiffel Tower, in Paris!", "Eiffel tower Paris France") == pytest.approx(0.75)
    # multiset overlap: pred [x, y, y, z], ref [y, y, y, x] -> x1 + y2 = 3 -> P = R = 3/4
    assert m.qa_f1_score("x y y z", "y y y x") == pytest.approx(0.75)
    # P = 1, R = 1/2 -> F1 = 2/3
    assert m.qa_f1_score("cat", "cat dog") == pytest.approx(2 / 3)
    assert m.qa_f1_score("an apple", "the") == 0.0  # both normalise to nothing useful


def test_rouge_l():
    # LCS "the cat on the mat" = 5 of 6 tokens each side -> F = 5/6
    assert m.rouge_l_score("the cat sat on the mat", "the cat lay on the mat") == pytest.approx(5 / 6)
    # LCS "b d" = 2: P = 2/4, R = 2/3 -> F = 2 * (1/3) / (7/6) = 4/7
    assert m.rouge_l_score("a b c d", "b d e") == pytest.approx(4 / 7)
    assert m.rouge_l_score("", "b d e") == 0.0
    assert m.lcs_length("abcbdab", "bdcaba") == 4  # the textbook example (e.g. "bcba")


def test_classification():
    classes = ["City", "Country", "Individual"]
    # City and Country both named -> 1/2
    assert m.classification_score("City or Country", "City", all_classes=classes) == 0.5
    assert m.classification_score("Individual", "City", all_classes=classes) == 0.0
    # "Hockey" is a strict substring of the truth "Ice Hockey" and is not counted -> 1
    assert m.classification_score("Ice Hockey", "Ice Hockey", all_classes=["Hockey", "Ice Hockey"]) == 1.0


def test_retrieval_and_count():
    # numbers 3 and 5, one equals the truth's paragraph 3 -> 1/2
    assert m.retrieval_score("Paragraph 3, maybe paragraph 5", "Paragraph 3") == 0.5
    assert m.retrieval_score("none of them", "Paragraph 3") == 0.0
    assert m.retrieval_zh_score("段落2", "段落2") == 1.0
    with pytest.raises(ValueError, match="Paragraph N"):
        m.retrieval_score("1", "the first")
    # 12 and 13 -> one right of two
    assert m.count_score("There are 12 unique, not 13", 12) == 0.5


def test_code_similarity():
    # the fenced first line is skipped; the second equals the truth
    assert m.code_sim_score("```python\n    return total\n", "    return total") == 1.0
    # "# ..." skipped; "return x+1" (10 chars) vs "return x + 1" (12): matches "return x", "+", "1" = 10 chars
    # ratio 2 * 10 / 22 = 0.909 -> round(90.9) / 100 = 0.91
    assert m.code_sim_score("# comment\nreturn x+1", "return x + 1") == pytest.approx(0.91)


def test_zh_metrics_use_characters():
    # 北京大学 vs 北京: overlap 2 chars, P = 2/4, R = 1 -> F1 = 2/3
    assert m.qa_f1_zh_score("北京大学。", "北京") == pytest.approx(2 / 3)
    assert m.rouge_l_zh_score("北京大学", "北京") == pytest.approx(2 / 3)


def test_best_over_references_and_dispatch():
    assert m.score_prediction("qa_f1", "Lovelace", ["Ada Lovelace", "Lovelace"]) == 1.0
    assert m.score_prediction("string_match_all", "12 34", ["12", "99"]) == 0.5
    with pytest.raises(ValueError, match="unknown metric 'bleu'"):
        m.score_prediction("bleu", "x", ["y"])


@pytest.mark.parametrize(
    "successes, trials, low, high",
    # Newcombe (1998), Statistics in Medicine 17:857, Table II, method 3 (the score interval)
    [(81, 263, 0.2553, 0.3662), (15, 148, 0.0624, 0.1605), (0, 20, 0.0, 0.1611), (0, 10, 0.0, 0.2775),
     (5, 10, 0.2366, 0.7634), (10, 10, 0.7225, 1.0)],  # fmt: skip
)
def test_wilson_interval_against_a_known_table(successes, trials, low, high):
    got = m.wilson_interval(successes, trials)
    assert got == pytest.approx((low, high), abs=5e-5)


@pytest.mark.parametrize("trials", [1, 7, 50, 1000])
def test_wilson_interval_holds_an_accuracy_of_0_and_1_exactly(trials):
    """At no (every) success the lower (upper) bound is the accuracy itself, not a rounding away from it."""
    assert m.wilson_interval(0, trials)[0] == 0.0 and m.wilson_interval(trials, trials)[1] == 1.0


def test_wilson_interval_rejects_bad_counts():
    with pytest.raises(ValueError, match=r"successes must be an integer in \[0, trials=4\], got 5"):
        m.wilson_interval(5, 4)
    with pytest.raises(ValueError, match="trials must be a positive integer, got 0"):
        m.wilson_interval(0, 0)


def test_bootstrap_interval_of_a_mean_is_near_the_normal_one_and_reproducible():
    """Half the examples right: mean 0.5, its 95% interval about 0.5 +- 1.96 * sqrt(0.25 / 50) = [0.361, 0.639];
    constant values give no spread; the same seed gives the same interval."""
    estimate, low, high = m.bootstrap_interval([0.0, 1.0] * 25)
    assert estimate == 0.5 and low == pytest.approx(0.361, abs=0.02) and high == pytest.approx(0.639, abs=0.02)
    assert m.bootstrap_interval([0.3] * 7) == pytest.approx((0.3, 0.3, 0.3))
    assert m.bootstrap_interval([0.1, 0.9, 0.4], seed=3) == m.bootstrap_interval([0.1, 0.9, 0.4], seed=3)


def test_bootstrap_interval_pools_weighted_examples():
    """A recall per example weighted by its rows: the estimate is sum(w v) / sum(w), an example with no row moves
    nothing, and every resample lies within the examples' range."""
    values, rows = [0.9, 0.5, 0.0], [30, 10, 0]
    estimate, low, high = m.bootstrap_interval(values, rows)
    assert estimate == pytest.approx((0.9 * 30 + 0.5 * 10) / 40)
    assert 0.5 <= low <= estimate <= high <= 0.9


def test_a_paired_bootstrap_difference_removes_what_the_examples_share():
    """The same examples under two cells: a constant shift is found exactly (no spread) though the examples
    themselves vary widely; identical cells differ by nothing; unequal example counts are refused."""
    values = [0.0, 1.0, 0.2, 0.9, 0.5, 0.7]
    assert m.bootstrap_interval(values, other=[v - 0.1 for v in values]) == pytest.approx((0.1, 0.1, 0.1))
    assert m.bootstrap_interval(values, other=values) == (0.0, 0.0, 0.0)
    spread = m.bootstrap_interval(values)
    assert spread[2] - spread[1] > 0.3  # unpaired, the examples' own spread
    with pytest.raises(ValueError, match="other has 2 examples, values 6"):
        m.bootstrap_interval(values, other=[0.0, 1.0])
