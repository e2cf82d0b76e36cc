"""Scoring functions: RULER string match and LongBench v1's metrics, each on one prediction.

Every function maps (prediction: str, reference: str | list[str], ...) to a float in [0, 1];
reports multiply by 100.  LongBench's scorer takes the max over an example's references
(`best_over_references`); RULER's `string_match_all` scores all references at once.

Semantics follow the official scripts (RULER `scripts/eval/synthetic/constants.py`, LongBench
`metrics.py` / `eval.py`).  Two deliberate differences, both documented where they apply:
ROUGE-L is the plain LCS F1 over whitespace tokens (LongBench calls the `rouge` package, whose
summary-level variant splits sentences and counts unique words), and classification removes *every*
matched class that is a strict substring of the truth (the official loop removes while iterating
and can skip one).
"""

from __future__ import annotations

import difflib
import re
import string
from collections import Counter
from typing import Callable, Sequence

from ..errors import ConfigError, DataError

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = set(string.punctuation)


# ----------------------------------------------------------------------------------------------
# RULER
# ----------------------------------------------------------------------------------------------


def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """Share of the references found (case-insensitive substring) in the prediction."""
    if not references:
        raise DataError("string_match_all needs at least one reference")
    text = prediction.lower()
    return sum(ref.lower() in text for ref in references) / len(references)


def string_match_part(prediction: str, references: Sequence[str]) -> float:
    """1.0 if any reference occurs (case-insensitive substring) in the prediction, else 0.0."""
    text = prediction.lower()
    return float(any(ref.lower() in text for ref in references))


# ----------------------------------------------------------------------------------------------
# LongBench v1
# ----------------------------------------------------------------------------------------------


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower case, drop punctuation, drop articles, squeeze whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def token_f1(prediction_tokens: Sequence[str], reference_tokens: Sequence[str]) -> float:
    """Bag-of-tokens F1 (multiset overlap)."""
    same = sum((Counter(prediction_tokens) & Counter(reference_tokens)).values())
    if same == 0:
        return 0.0
    precision = same / len(prediction_tokens)
    recall = same / len(reference_tokens)
    return 2 * precision * recall / (precision + recall)


def qa_f1_score(prediction: str, reference: str, **_) -> float:
    """LongBench `qa_f1_score`: token F1 after `normalize_answer`."""
    return token_f1(normalize_answer(prediction).split(), normalize_answer(reference).split())


def lcs_length(a: Sequence, b: Sequence) -> int:
    """Length of the longest common subsequence (O(len(a) * len(b)) time, O(len(b)) memory)."""
    previous = [0] * (len(b) + 1)
    for x in a:
        current = [0]
        for j, y in enumerate(b):
            current.append(previous[j] + 1 if x == y else max(previous[j + 1], current[j]))
        previous = current
    return previous[-1]


def rouge_l_score(prediction: str, reference: str, **_) -> float:
    """ROUGE-L F1: LCS of the whitespace tokens, F = 2PR / (P + R) (0 when either side is empty)."""
    pred, ref = prediction.split(), reference.split()
    if not pred or not ref:
        return 0.0
    common = lcs_length(pred, ref)
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def classification_score(prediction: str, reference: str, all_classes: Sequence[str] = (), **_) -> float:
    """LongBench `classification_score`: the class names found in the prediction, minus those that
    are strict substrings of the truth; 1/len(found) if the truth is among them, else 0."""
    found = [name for name in all_classes if name in prediction]
    found = [name for name in found if not (name in reference and name != reference)]
    return 1.0 / len(found) if reference in found else 0.0


def _share_equal(numbers: list[str], target: str) -> float:
    return 0.0 if not numbers else sum(n == target for n in numbers) / len(numbers)


def retrieval_score(prediction: str, reference: str, **_) -> float:
    """LongBench `retrieval_score`: of the numbers in the prediction, the share equal to the truth's
    paragraph number ("Paragraph N")."""
    match = re.search(r"Paragraph (\d+)", reference)
    if match is None:
        raise DataError(f"retrieval reference {reference!r} has no 'Paragraph N'")
    return _share_equal(re.findall(r"\d+", prediction), match.group(1))


def count_score(prediction: str, reference: str, **_) -> float:
    """LongBench `count_score`: of the numbers in the prediction, the share equal to the truth."""
    return _share_equal(re.findall(r"\d+", prediction), str(reference))


def code_sim_score(prediction: str, reference: str, **_) -> float:
    """LongBench `code_sim_score`: the first prediction line without a backtick, '#' or '//',
    compared with the truth by fuzzywuzzy's `ratio` (round(100 * difflib ratio)) / 100."""
    line = next((l for l in prediction.lstrip("\n").split("\n") if "`" not in l and "#" not in l and "//" not in l), "")
    return round(100 * difflib.SequenceMatcher(None, line, reference).ratio()) / 100


_ZH_PUNCTUATION = set(string.punctuation) | set(
    "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
)


def normalize_zh_answer(text: str) -> str:
    """Lower case, drop ASCII and CJK punctuation and all whitespace."""
    return "".join(ch for ch in "".join(text.lower().split()) if ch not in _ZH_PUNCTUATION)


def qa_f1_zh_score(prediction: str, reference: str, **_) -> float:
    """Token F1 over characters of the normalised texts (LongBench segments words with jieba)."""
    return token_f1(list(normalize_zh_answer(prediction)), list(normalize_zh_answer(reference)))


def rouge_l_zh_score(prediction: str, reference: str, **_) -> float:
    """ROUGE-L F1 over characters (LongBench segments words with jieba)."""
    return rouge_l_score(" ".join("".join(prediction.split())), " ".join("".join(reference.split())))


def retrieval_zh_score(prediction: str, reference: str, **_) -> float:
    """`retrieval_score` for the Chinese reference format "段落N"."""
    match = re.search(r"段落(\d+)", reference)
    if match is None:
        raise DataError(f"retrieval reference {reference!r} has no '段落N'")
    return _share_equal(re.findall(r"\d+", prediction), match.group(1))


METRICS: dict[str, Callable[..., float]] = {
    "qa_f1": qa_f1_score,
    "rouge_l": rouge_l_score,
    "classification": classification_score,
    "retrieval": retrieval_score,
    "count": count_score,
    "code_sim": code_sim_score,
    "qa_f1_zh": qa_f1_zh_score,
    "rouge_l_zh": rouge_l_zh_score,
    "retrieval_zh": retrieval_zh_score,
}


def best_over_references(
    metric: str, prediction: str, references: Sequence[str], all_classes: Sequence[str] = ()
) -> float:
    """LongBench's per-example score: the max of `metric` over the references."""
    if metric not in METRICS:
        raise ConfigError(f"unknown metric {metric!r}; known: {sorted(METRICS)}")
    return max((METRICS[metric](prediction, ref, all_classes=all_classes) for ref in references), default=0.0)


def score_prediction(metric: str, prediction: str, references: Sequence[str], all_classes: Sequence[str] = ()) -> float:
    """One example's score in [0, 1] for any metric name the tasks use."""
    if metric == "string_match_all":
        return string_match_all(prediction, references)
    if metric == "string_match_part":
        return string_match_part(prediction, references)
    return best_over_references(metric, prediction, references, all_classes)


# ----------------------------------------------------------------------------------------------
# intervals
# ----------------------------------------------------------------------------------------------

Z_95 = 1.959963984540054  # the standard normal's 97.5% quantile


def wilson_interval(successes: int, trials: int, z: float = Z_95) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion successes / trials (95% by default): the
    interval an accuracy over `trials` examples is reported with.  Unlike the normal approximation
    it stays inside [0, 1] and is not empty at 0 or `trials` successes (Newcombe 1998, method 3)."""
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise ValueError(f"trials must be a positive integer, got {trials!r}")
    if isinstance(successes, bool) or not isinstance(successes, int) or not 0 <= successes <= trials:
        raise ValueError(f"successes must be an integer in [0, trials={trials}], got {successes!r}")
    p = successes / trials
    scale = 1 + z * z / trials
    centre = (p + z * z / (2 * trials)) / scale
    half = z * (p * (1 - p) / trials + z * z / (4 * trials * trials)) ** 0.5 / scale
    # at 0 (or all) successes the bound is exactly 0 (1): centre - half rounds to about 1e-17 there
    low = 0.0 if successes == 0 else max(0.0, centre - half)
    high = 1.0 if successes == trials else min(1.0, centre + half)
    return low, high


BOOTSTRAP_RESAMPLES = 10_000


def bootstrap_interval(
    values: Sequence[float], weights: Sequence[float] | None = None, other: Sequence[float] | None = None,
    other_weights: Sequence[float] | None = None, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0,
) -> tuple[float, float, float]:
    """(estimate, low, high): a percentile bootstrap 95% interval over independent examples.

    values [N]: one number per example (a score, or a recall with `weights` [N]: its rows, so the estimate is
    the pooled mean sum(w v) / sum(w), and a resample draws whole examples with their rows).  With `other`
    [N] (and `other_weights`), the same examples under another cell: the estimate is the paired difference
    mean(values) - mean(other), each resample drawing the same examples for both.  `resamples` draws with a
    seeded generator, so a summary is reproducible."""
    import numpy as np

    v = np.asarray(values, dtype=np.float64)
    if v.ndim != 1 or v.size == 0:
        raise ValueError(f"values must be a non-empty list of numbers, got shape {v.shape}")
    if other is not None and len(other) != v.size:
        raise ValueError(f"other has {len(other)} examples, values {v.size}: a paired difference needs the same ones")
    if isinstance(resamples, bool) or not isinstance(resamples, int) or resamples < 1:
        raise ValueError(f"resamples must be a positive integer, got {resamples!r}")

    def pooled(x, w, draws):  # the (weighted) mean of each draw's examples
        x = np.asarray(x, dtype=np.float64)
        w = np.ones_like(x) if w is None else np.asarray(w, dtype=np.float64)
        if (w < 0).any() or w.sum() <= 0:
            raise ValueError("weights must be non-negative with a positive sum")
        total = w[draws].sum(-1)
        return np.divide((x * w)[draws].sum(-1), total, out=np.full(total.shape, np.nan), where=total > 0)

    everyone = np.arange(v.size)[None]
    draws = np.random.default_rng(seed).integers(0, v.size, size=(resamples, v.size))
    estimate, spread = pooled(v, weights, everyone)[0], pooled(v, weights, draws)
    if other is not None:
        estimate = estimate - pooled(other, other_weights, everyone)[0]
        spread = spread - pooled(other, other_weights, draws)
    low, high = np.nanpercentile(spread, [2.5, 97.5])
    return tuple(round(float(x), 6) for x in (estimate, low, high))
