"""Judging: answer extraction, QA metrics, math equivalence (threads, timeouts), Wilson and bootstrap CIs."""
import time
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal

import pytest

from unison.config import LabelConfig
from unison.judge import score
from unison.judge.answers import extract_answer, last_boxed, split_answers
from unison.judge.math_equivalence import math_score, to_number
from unison.judge.qa import exact_match, qa_scores, substring_match, token_f1
from unison.judge.stats import bootstrap_ci, mcnemar_exact, wilson_interval
from unison.protocol import normalize_answer as normalize

PARAMS = LabelConfig(qa_metric="subem", f1_threshold=0.8, first_only=False, math_timeout_s=5)
# Gold answers copied from MATH-500 (tests/fixtures/data/math500_test.jsonl, rows 0-2).
POLAR = r"\left( 3, \frac{\pi}{2} \right)"
P_MINUS_Q = "p - q"
FOURTEEN_THIRDS = r"\frac{14}{3}"
# A prediction sympy would try to evaluate for ever.
TOWER = r"9^{9^{9^{9}}}"


# --- extraction -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<think>capital?</think><answer>Paris</answer>", "Paris"),
        ("<answer>Lyon</answer> on reflection <answer> Paris </answer>", "Paris"),
        ("<search>x</search><result>y</result><answer>Paris", "Paris"),  # stopped at </answer>
        (r"<answer>The final answer is \[ \boxed{\frac{1}{\sqrt{2}}} \]</answer>", r"\frac{1}{\sqrt{2}}"),
        (r"so \boxed{1}, no: \boxed{\left( 3, \frac{\pi}{2} \right)}", POLAR),
        (r"\boxed{5} then <answer>7</answer>", "7"),  # the answer tag wins over a boxed outside it
        ("Agent 2 agrees.\nFinal Answer: 42.\n", "42"),
        ("**Final Answer:** Marie Curie", "Marie Curie"),
        ("I am not sure.", None),
        ("<answer>  </answer>", None),
        ("", None),
        (None, None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_last_boxed_balances_nested_braces_and_rejects_unclosed():
    assert last_boxed(r"\boxed{\frac{a}{b^{2}}} tail") == r"\frac{a}{b^{2}}"
    assert last_boxed(r"\boxed{\frac{1}{2}") is None
    assert last_boxed("no box") is None


def test_split_answers():
    assert split_answers(" Paris | London |  ") == ["Paris", "London"]
    assert split_answers("Paris | London", first_only=True) == ["Paris"]
    assert split_answers(None) == []


# --- QA -----------------------------------------------------------------------------------------


def test_normalize_squad():
    assert normalize("The  Quick, brown fox!") == "quick brown fox"
    assert normalize("An apple a day") == "apple day"
    assert normalize("Theatre") == "theatre"  # articles are whole words only


def test_exact_and_substring_match():
    assert exact_match("the Eiffel Tower", "Eiffel tower.") == 1.0
    assert exact_match("Eiffel Tower, Paris", "Eiffel Tower") == 0.0
    assert substring_match("It is the Eiffel Tower in Paris", "eiffel tower") == 1.0
    # containment is on word boundaries, not raw characters
    assert substring_match("in 1990", "1") == 0.0
    assert substring_match("Martin", "art") == 0.0
    assert substring_match("anything", "the") == 0.0  # a gold that normalises to nothing matches nothing


def test_subem_refuses_predictions_far_longer_than_the_gold():
    passage = "Doc 1 (Title: Paris) Paris is the capital and largest city of France, on the Seine."
    assert substring_match(passage, "Paris") == 0.0  # a pasted passage contains the gold but is not an answer
    assert substring_match("Paris, Lyon, Marseille, Nice, Lille, Nantes", "Paris") == 0.0  # nor is a list of guesses
    assert substring_match("the city of Paris, France", "Paris") == 1.0  # 4 tokens: within SUBEM_MAX_LENGTH_RATIO
    assert substring_match("one two three four Paris", "Paris") == 1.0  # exactly 5x the gold still counts
    assert substring_match("one two three four five Paris", "Paris") == 0.0
    assert substring_match(passage, "Paris is the capital and largest city") == 1.0  # 6-token gold: up to 30 allowed
    assert qa_scores(passage, ["Paris"])["subem"] == 0.0
    assert score("qa", f"<answer>{passage}</answer>", ["Paris"], PARAMS)[0] is False  # label.qa_metric subem, the default


def test_token_f1_hand_computed():
    # "cat sat on mat" vs "cat on mat": 3 common, P = 3/4, R = 1 -> 2 * .75 / 1.75
    assert token_f1("the cat sat on the mat", "a cat on a mat") == pytest.approx(6 / 7)
    assert token_f1("Paris", "London") == 0.0


def test_scores_take_the_best_gold():
    # vs "Obama": P=1/2 R=1 -> 2/3; vs "Michelle Obama": 1/2; vs "Barack Hussein Obama": P=1 R=2/3 -> 0.8
    golds = ["Obama", "Michelle Obama", "Barack Hussein Obama"]
    assert qa_scores("Barack Obama", golds) == {"em": 0.0, "subem": 1.0, "f1": pytest.approx(0.8)}


def test_yes_no_must_match_exactly():
    assert token_f1("no", "no way") == 0.0
    assert substring_match("yes or no", "yes") == 0.0  # hedging both ways earns nothing
    assert qa_scores("Yes.", ["yes"]) == {"em": 1.0, "subem": 1.0, "f1": 1.0}


def test_multi_answer_rules():
    assert qa_scores("Paris | London", ["paris", "london"])["em"] == 1.0
    assert qa_scores("Paris | London", ["paris"])["em"] == 0.0  # train rule: every item must be gold
    assert qa_scores("Paris | London", ["paris"], first_only=True)["em"] == 1.0  # eval rule
    assert qa_scores("London | Paris", ["paris"], first_only=True)["em"] == 0.0
    assert qa_scores(None, ["paris"]) == {"em": 0.0, "subem": 0.0, "f1": 0.0}


def test_score_qa_metric_decides_correct():
    text = "<answer>Barack Obama</answer>"
    golds = ["Barack Hussein Obama"]
    assert score("qa", text, golds, PARAMS.model_copy(update={"qa_metric": "em"})) == (False, 0.0, "qa:em")
    assert score("qa", text, golds, PARAMS.model_copy(update={"qa_metric": "f1"})) == (True, pytest.approx(0.8), "qa:f1")
    assert score("qa", text, golds, PARAMS.model_copy(update={"qa_metric": "f1", "f1_threshold": 0.9}))[0] is False
    assert score("qa", "Barack Hussein Obama", golds, PARAMS) == (True, 1.0, "qa:subem")  # untagged = answer
    assert score("qa", "<answer></answer>", golds, PARAMS) == (False, 0.0, "no-answer")
    with pytest.raises(ValueError, match="qa_metric"):
        LabelConfig(qa_metric="bleu")  # refused when params load, before anything is scored
    with pytest.raises(ValueError, match="no scorer"):
        score("code", text, golds, PARAMS)


# --- math ---------------------------------------------------------------------------------------


def test_to_number():
    assert to_number("1,000") == to_number("1000") == Decimal(1000)
    assert to_number("$18.00") == to_number(r"\$18") == Decimal(18)
    assert to_number(r"50\%") == Decimal(50)
    assert to_number("1{,}000") == Decimal(1000)
    assert to_number("-3.5") == Decimal("-3.5")
    assert to_number("1,2") is None  # a pair, not a thousands separator
    assert to_number(r"\frac{1}{2}") is None


@pytest.mark.parametrize("prediction", ["18", "18.0", "$18.00", r"\$18", r"<answer>\boxed{18}</answer>"])
def test_gsm8k_style_numbers_are_equal_without_math_verify(prediction):
    # Decided: currency signs and trailing zeros don't matter ("$18.00" = "18").
    assert score("math", prediction, ["18"], PARAMS) == (True, 1.0, "math:numeric")


def test_numeric_mismatch():
    assert score("math", "17", ["18"], PARAMS) == (False, 0.0, "math:numeric")
    assert score("math", "1,000", ["1000"], PARAMS) == (True, 1.0, "math:numeric")


@pytest.mark.parametrize(
    "gold, prediction, correct",
    [
        (POLAR, r"(3, \pi/2)", True),
        (POLAR, r"\left(3,\frac{\pi}{2}\right)", True),
        (POLAR, r"(3, \pi)", False),
        (FOURTEEN_THIRDS, "14/3", True),
        (FOURTEEN_THIRDS, r"4\frac{2}{3}", True),
        (FOURTEEN_THIRDS, "4.67", False),
        (P_MINUS_Q, "p-q", True),
        (P_MINUS_Q, "q - p", False),
    ],
)
def test_math500_equivalence(gold, prediction, correct):
    assert score("math", f"<answer>{prediction}</answer>", [gold], PARAMS) == (
        correct, float(correct), "math-verify"
    )


def test_math_verify_works_from_threads():
    cases = [(POLAR, r"(3, \pi/2)", True), (FOURTEEN_THIRDS, "14/3", True), (P_MINUS_Q, "q-p", False)] * 2
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda case: math_score(case[1], [case[0]], 5)[0], cases))
    assert results == [correct for _, _, correct in cases]


def test_timeout_from_a_thread_returns_quickly_and_the_pool_recovers():
    math_score("p-q", [P_MINUS_Q], 5)  # a started worker, so start-up time is not measured
    with ThreadPoolExecutor(2) as pool:
        started = time.monotonic()
        result = pool.submit(math_score, TOWER, ["1"], 0.5).result()
        elapsed = time.monotonic() - started
    assert result == (False, 0.0, "math-verify:timeout")
    assert elapsed < 5
    assert math_score("14/3", [FOURTEEN_THIRDS], 5) == (True, 1.0, "math-verify")


def test_any_gold_can_match():
    assert math_score("0.5", ["1/3", r"\frac{1}{2}"], 5) == (True, 1.0, "math-verify")


# --- stats --------------------------------------------------------------------------------------


def test_bootstrap_ci_is_deterministic_and_contains_the_mean():
    values = [1, 0, 1, 1, 0, 1, 0, 1, 1, 1] * 5
    mean, lo, hi = bootstrap_ci(values, n=1000, seed=0)
    assert mean == pytest.approx(0.7)
    assert lo < mean < hi
    assert 0.5 < lo and hi < 0.85  # a 95% interval for p = .7, n = 50 is about +-0.13
    assert bootstrap_ci(values, n=1000, seed=0) == (mean, lo, hi)
    scores = [i / 37 % 1 for i in range(50)]  # continuous scores: another seed draws another interval
    assert bootstrap_ci(scores, seed=1)[1:] != bootstrap_ci(scores, seed=0)[1:]
    assert bootstrap_ci([0.5] * 7) == (0.5, 0.5, 0.5)
    with pytest.raises(ValueError):
        bootstrap_ci([])


@pytest.mark.parametrize("successes,n,expected", [
    (0, 200, (0.0, 0.0, 0.01885)),  # z^2 / (n + z^2): an empty sample still leaves room above 0
    (14, 200, (0.07, 0.04215, 0.11405)),
    (200, 200, (1.0, 0.98115, 1.0)),
    (81, 263, (0.30798, 0.2553, 0.3662)),  # Newcombe (1998) Table I, method 3
    (15, 148, (0.10135, 0.0624, 0.1605)),
    (0, 20, (0.0, 0.0, 0.1611)),
    (1, 29, (0.03448, 0.0061, 0.1718)),
])
def test_wilson_interval_known_values(successes, n, expected):
    assert wilson_interval(successes, n) == pytest.approx(expected, abs=5e-5)


def test_wilson_interval_holds_its_estimate_exactly_at_none_and_all():
    """Rounding once put the bound of 0 of 5 at 2.8e-17 and the top of 13 of 13 at 0.99999..., past the estimate: a
    plot's error bar was then negative and matplotlib refused it."""
    for n in range(1, 400):
        for k in (0, n):
            p, lo, hi = wilson_interval(k, n)
            assert lo <= p <= hi and (lo, hi)[k == n] == p, (k, n, lo, hi)


def test_wilson_interval_rejects_no_trials_and_impossible_counts():
    with pytest.raises(ValueError, match="n >= 1"):
        wilson_interval(0, 0)
    with pytest.raises(ValueError, match="successes"):
        wilson_interval(3, 2)
    assert wilson_interval(14, 200, alpha=0.01)[1] < wilson_interval(14, 200)[1]  # 99% is wider than 95%


@pytest.mark.parametrize("only_first,only_second,expected", [
    (10, 30, 0.0022214),  # scipy.stats.binomtest(10, 40, 0.5).pvalue
    (1, 9, 0.0214844),  # 2 x 11 / 1024
    (0, 6, 0.03125),  # 2 / 64: six discordant questions all one way is the fewest that can reach p < 0.05
    (12, 8, 0.5034447),
    (5, 5, 1.0),
    (0, 0, 1.0),  # no discordant question: nothing tells the two systems apart
])
def test_mcnemar_exact_known_values_and_symmetry(only_first, only_second, expected):
    assert mcnemar_exact(only_first, only_second) == pytest.approx(expected, abs=5e-7)
    assert mcnemar_exact(only_second, only_first) == mcnemar_exact(only_first, only_second)


def test_mcnemar_exact_rejects_negative_counts():
    with pytest.raises(ValueError, match=">= 0"):
        mcnemar_exact(-1, 3)
