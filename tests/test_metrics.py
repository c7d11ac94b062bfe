"""Acceptance tests of weightstream.metrics.

Every metric is checked against an independent reference: scikit-learn where it
has the metric, a plain numpy or math computation written here otherwise. Data
is random, weighted (with zero weights masking tokens) and fed in several
update() calls of different sizes, so the streaming accumulation is what is
tested. Tolerances: 1e-12 where both sides compute the same formula in float64
(only the summation order differs); for AUC see the tests' comments.
"""

from __future__ import annotations

import gc
import io
import itertools
import math

import numpy as np
import pytest
import torch
from sklearn.metrics import (
    accuracy_score,
    auc,
    balanced_accuracy_score,
    f1_score,
    fbeta_score,
    jaccard_score,
    precision_recall_curve,
    recall_score,
    roc_auc_score,
)

import weightstream.metrics as metrics
from weightstream.metrics.auc import auc_thresholds

SEEDS = [0, 1, 2]
# float64 on both sides, only the order of summation differs.
EXACT = {"rel": 1e-12, "abs": 1e-12}


# -- data -------------------------------------------------------------------------------


def _chunks(n: int, rng: np.random.Generator, parts: int = 4) -> list[slice]:
    """``parts`` consecutive slices of uneven sizes covering range(n)."""
    cuts = np.sort(rng.choice(np.arange(1, n), size=parts - 1, replace=False))
    bounds = [0, *cuts.tolist(), n]
    return [slice(a, b) for a, b in itertools.pairwise(bounds)]


def _classification(rng, num_classes, rows=64, cols=12, absent=()):
    """Labels, predictions (right ~60% of the time) and weights, shape [rows, cols].

    About 15% of tokens have weight 0 and label -100 (padding); the others have
    weights in [0.2, 2]. Classes in ``absent`` never occur as labels.
    """
    present = np.array([c for c in range(num_classes) if c not in absent])
    labels = rng.choice(present, size=(rows, cols))
    noise = rng.integers(0, num_classes, size=(rows, cols))
    predictions = np.where(rng.random((rows, cols)) < 0.6, labels, noise)
    weights = rng.uniform(0.2, 2.0, size=(rows, cols))
    pad = rng.random((rows, cols)) < 0.15
    weights[pad] = 0.0
    labels[pad] = -100
    return labels, predictions, weights


def _stream(metric, rng, labels, predictions, weights, *, keywords=True, pred_dtype=None):
    """Feed the rows to ``metric`` in uneven chunks; return ``metric.compute()``."""
    for s in _chunks(len(labels), rng):
        lab = torch.from_numpy(labels[s])
        pred = torch.from_numpy(predictions[s])
        if pred_dtype is not None:
            pred = pred.to(pred_dtype)
        w = None if weights is None else torch.from_numpy(weights[s])
        if keywords:
            metric(labels=lab, predictions=pred, weights=w)
        else:
            metric.update(lab, pred, w)
    return metric.compute()


def _kept(labels, predictions, weights):
    """The tokens with weight > 0, flattened (what sklearn must see)."""
    keep = weights > 0
    return labels[keep], predictions[keep], weights[keep]


# -- accuracy ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_accuracy_matches_sklearn_weighted(seed):
    rng = np.random.default_rng(seed)
    labels, predictions, weights = _classification(rng, num_classes=5)
    metric = metrics.AccuracyMetric("accuracy", compute_on_system=True)
    value = _stream(metric, rng, labels, predictions, weights, pred_dtype=torch.int32)
    y, p, w = _kept(labels, predictions, weights)
    assert float(value) == pytest.approx(accuracy_score(y, p, sample_weight=w), **EXACT)
    assert float(metric) == float(value)


@pytest.mark.parametrize("seed", SEEDS)
def test_accuracy_with_mask_is_correct_over_unmasked_tokens(seed):
    # The reference's definition with a 0/1 mask: correct tokens / tokens with weight > 0.
    rng = np.random.default_rng(seed)
    labels, predictions, weights = _classification(rng, num_classes=3)
    mask = (weights > 0).astype(np.float32)
    metric = metrics.AccuracyMetric("accuracy")
    value = _stream(metric, rng, labels, predictions, mask, keywords=False)
    expected = ((labels == predictions) & (mask > 0)).sum() / (mask > 0).sum()
    assert float(value) == pytest.approx(expected, **EXACT)


def test_accuracy_unweighted_and_seed_example():
    # The seed's evaluation step: labels=targets.clone(), predictions=outputs.argmax(-1).int().
    rng = np.random.default_rng(7)
    accuracy = metrics.AccuracyMetric("accuracy", compute_on_system=True)
    all_t, all_p = [], []
    with torch.no_grad():
        for _ in range(3):
            outputs = torch.from_numpy(rng.normal(size=(16, 4)))
            targets = torch.from_numpy(rng.integers(0, 4, size=16))
            accuracy(labels=targets.clone(), predictions=outputs.argmax(-1).int())
            all_t.append(targets.numpy())
            all_p.append(outputs.argmax(-1).numpy())
    expected = accuracy_score(np.concatenate(all_t), np.concatenate(all_p))
    assert float(accuracy) == pytest.approx(expected, **EXACT)


@pytest.mark.parametrize("seed", SEEDS)
def test_mean_per_class_accuracy_matches_sklearn(seed):
    rng = np.random.default_rng(seed)
    labels, predictions, weights = _classification(rng, num_classes=6, absent=(4,))
    metric = metrics.MeanPerClassAccuracyMetric(6)
    value = _stream(metric, rng, labels, predictions, weights)
    y, p, w = _kept(labels, predictions, weights)
    seen = sorted(set(y.tolist()))
    assert 4 not in seen  # class 4 never labelled: left out of the mean
    expected = recall_score(y, p, labels=seen, average="macro", sample_weight=w, zero_division=0)
    assert float(value) == pytest.approx(expected, **EXACT)


def test_mean_per_class_accuracy_is_balanced_accuracy():
    rng = np.random.default_rng(11)
    labels, predictions, weights = _classification(rng, num_classes=4)
    metric = metrics.MeanPerClassAccuracyMetric(num_classes=4, name="mpca")
    value = _stream(metric, rng, labels, predictions, weights)
    y, p, w = _kept(labels, predictions, weights)
    assert float(value) == pytest.approx(balanced_accuracy_score(y, p, sample_weight=w), **EXACT)


# -- confusion-matrix metrics -----------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("average", ["micro", "macro"])
@pytest.mark.parametrize("beta", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("ignore", [None, [0], [1, 3]])
def test_fbeta_matches_sklearn(seed, average, beta, ignore):
    num_classes = 5
    rng = np.random.default_rng(seed)
    labels, predictions, weights = _classification(rng, num_classes, absent=(2,))
    metric = metrics.FBetaScoreMetric(
        num_classes, beta=beta, average_type=average, ignore_labels=ignore
    )
    value = _stream(metric, rng, labels, predictions, weights)
    y, p, w = _kept(labels, predictions, weights)
    kept = [c for c in range(num_classes) if c not in (ignore or [])]
    expected = fbeta_score(
        y, p, beta=beta, average=average, labels=kept, sample_weight=w, zero_division=0
    )
    assert float(value) == pytest.approx(expected, **EXACT)


def _present(y, p, ignore):
    return [c for c in sorted(set(y.tolist()) | set(p.tolist())) if c not in (ignore or [])]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("ignore", [None, [0], [2, 4]])
def test_mean_iou_matches_sklearn_jaccard(seed, ignore):
    rng = np.random.default_rng(seed)
    # Class 5 never occurs (absent from labels and predictions): left out of the mean.
    labels, predictions, weights = _classification(rng, num_classes=5)
    metric = metrics.MeanIOUMetric(num_classes=6, ignore_classes=ignore)
    value = _stream(metric, rng, labels, predictions, weights)
    y, p, w = _kept(labels, predictions, weights)
    per_class = jaccard_score(
        y, p, labels=_present(y, p, ignore), average=None, sample_weight=w, zero_division=0
    )
    assert float(value) == pytest.approx(per_class.mean(), **EXACT)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("ignore", [None, [1]])
def test_dice_matches_sklearn_per_class_f1(seed, ignore):
    rng = np.random.default_rng(seed)
    labels, predictions, weights = _classification(rng, num_classes=4)
    metric = metrics.DiceCoefficientMetric(num_classes=5, ignore_classes=ignore)
    value = _stream(metric, rng, labels, predictions, weights)
    y, p, w = _kept(labels, predictions, weights)
    per_class = f1_score(
        y, p, labels=_present(y, p, ignore), average=None, sample_weight=w, zero_division=0
    )
    assert float(value) == pytest.approx(per_class.mean(), **EXACT)


# -- AUC --------------------------------------------------------------------------------


def _binary(rng, n=2000):
    """Binary labels, float32 scores in (0, 1) correlated with them, weights (15% zero)."""
    labels = (rng.random(n) < 0.4).astype(np.int64)
    logits = 1.2 * (2 * labels - 1) + rng.normal(size=n)
    scores = (1 / (1 + np.exp(-logits))).astype(np.float32)
    weights = np.where(rng.random(n) < 0.15, 0.0, rng.uniform(0.2, 2.0, size=n))
    return labels, scores, weights


def _buckets(scores, num_thresholds):
    """The metric's bucket of each score: the number of thresholds below it."""
    thresholds = auc_thresholds(num_thresholds).numpy()
    return np.searchsorted(thresholds, scores.astype(np.float64), side="left")


def _roc_discretisation_bound(y, bucket, w):
    # Within one bucket the metric's curve is the chord of a box of width
    # (weight of the bucket's negatives / N) and height (positives / P), while the
    # exact curve is a monotone staircase inside that box: the areas differ by at
    # most half the box. Summed: 0.5 * sum_b P_b N_b / (P N).
    pos = np.bincount(bucket, weights=w * (y == 1))
    neg = np.bincount(bucket, weights=w * (y == 0))
    return 0.5 * (pos * neg).sum() / (pos.sum() * neg.sum())


def _pr_point(selected, y, w, positives):
    tp = w[selected & (y == 1)].sum()
    fp = w[selected & (y == 0)].sum()
    return tp / positives, (tp / (tp + fp) if tp + fp > 0 else 1.0)


def _pr_discretisation_bound(y, scores, bucket, w):
    # Between the metric's points for "bucket >= b" and "bucket > b", the exact
    # curve passes through the points of the raw thresholds inside bucket b. Both
    # trapezoid sums over that recall span lie within [span * min precision,
    # span * max precision] of those points, so they differ by at most
    # span * (max - min). Summed over buckets.
    positives = w[y == 1].sum()
    bound = 0.0
    for b in np.unique(bucket):
        r_high, p_high = _pr_point(bucket >= b, y, w, positives)
        r_low, p_low = _pr_point(bucket > b, y, w, positives)
        inside = [
            _pr_point(scores >= v, y, w, positives)[1] for v in np.unique(scores[bucket == b])
        ]
        precisions = [p_high, p_low, *inside]
        bound += (r_high - r_low) * (max(precisions) - min(precisions))
    return bound


def _sklearn_auc(curve, y, s, w):
    if curve == "ROC":
        return roc_auc_score(y, s, sample_weight=w)
    precision, recall, _ = precision_recall_curve(y, s, sample_weight=w)
    return auc(recall, precision)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("curve", ["ROC", "PR"])
@pytest.mark.parametrize("num_thresholds", [200, 37])
def test_auc_matches_sklearn(seed, curve, num_thresholds):
    rng = np.random.default_rng(seed)
    labels, scores, weights = _binary(rng)
    metric = metrics.AUCMetric(num_thresholds=num_thresholds, curve=curve)
    value = float(_stream(metric, rng, labels, scores, weights))
    y, s, w = _kept(labels, scores, weights)
    bucket = _buckets(s, num_thresholds)

    # 1. Exact: the metric is the AUC of the scores rounded to their bucket (Note
    #    [AUC by thresholds]); the same float64 sums in another order.
    assert value == pytest.approx(_sklearn_auc(curve, y, bucket, w), **EXACT)

    # 2. Against the raw scores: within the discretisation bound computed from
    #    this data (plus float rounding). The bound is checked to be small, so the
    #    comparison is not vacuous.
    if curve == "ROC":
        bound = _roc_discretisation_bound(y, bucket, w)
    else:
        bound = _pr_discretisation_bound(y, s, bucket, w)
    assert bound < (0.005 if num_thresholds == 200 else 0.02)
    assert abs(value - _sklearn_auc(curve, y, s, w)) <= bound + 1e-12


def test_auc_is_nan_until_both_classes_seen_and_clamps_scores():
    metric = metrics.AUCMetric()
    assert math.isnan(float(metric))
    metric.update(torch.tensor([1, 1]), torch.tensor([0.3, 0.9]))
    assert math.isnan(float(metric))  # no negative yet: ROC undefined
    metric.update(torch.tensor([0, 0]), torch.tensor([-3.0, 0.1]))  # -3 counts as 0
    assert float(metric) == pytest.approx(1.0)
    assert float(metrics.AUCMetric(curve="PR")(torch.tensor([1]), torch.tensor([2.0]))) == 1.0


# -- precision@k / recall@k -------------------------------------------------------------


def _ranking(rng, rows=80, num_classes=10, max_labels=4):
    """Scores [rows, C]; labels [rows, max_labels] distinct ids, padded with -1; row weights."""
    scores = rng.normal(size=(rows, num_classes)).astype(np.float32)
    labels = np.full((rows, max_labels), -1, dtype=np.int64)
    for i in range(rows):
        n = rng.integers(1, max_labels + 1)
        labels[i, :n] = rng.choice(num_classes, size=n, replace=False)
    weights = np.where(rng.random(rows) < 0.1, 0.0, rng.uniform(0.2, 2.0, size=rows))
    return labels, scores, weights


def _numpy_at_k(labels, scores, weights, k):
    """Precision@k and recall@k written out row by row."""
    num_classes = scores.shape[1]
    hits_w = retrieved_w = relevant_w = 0.0
    for lab, sc, w in zip(labels, scores, weights):
        if w <= 0:
            continue
        top_k = set(np.argsort(-sc)[:k].tolist())
        relevant = {int(c) for c in lab if 0 <= c < num_classes}
        hits_w += w * len(top_k & relevant)
        retrieved_w += w * k
        relevant_w += w * len(relevant)
    return hits_w / retrieved_w, hits_w / relevant_w


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("k", [1, 3, 10])
def test_precision_and_recall_at_k_match_numpy(seed, k):
    rng = np.random.default_rng(seed)
    labels, scores, weights = _ranking(rng)
    precision = _stream(metrics.PrecisionAtKMetric(k), rng, labels, scores, weights)
    recall = _stream(metrics.RecallAtKMetric(k=k), rng, labels, scores, weights, keywords=False)
    expected_precision, expected_recall = _numpy_at_k(labels, scores, weights, k)
    assert float(precision) == pytest.approx(expected_precision, **EXACT)
    assert float(recall) == pytest.approx(expected_recall, **EXACT)


def test_at_k_accepts_one_label_per_row_and_no_weights():
    rng = np.random.default_rng(3)
    scores = rng.normal(size=(30, 6))
    labels = rng.integers(0, 6, size=30)
    metric = metrics.RecallAtKMetric(2)
    metric(torch.from_numpy(labels), torch.from_numpy(scores))
    expected = _numpy_at_k(labels[:, None], scores, np.ones(30), 2)[1]
    assert float(metric) == pytest.approx(expected, **EXACT)


# -- perplexity and mean ----------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_perplexity_per_token_and_summed_loss(seed):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 100, size=(24, 16))
    loss = rng.uniform(0.0, 6.0, size=(24, 16))
    weights = np.where(rng.random((24, 16)) < 0.2, 0.0, 1.0)
    expected = math.exp((weights * loss).sum() / weights.sum())

    per_token = metrics.PerplexityMetric("ppl")
    summed = metrics.PerplexityMetric("ppl_summed")
    for s in _chunks(len(labels), rng):
        lab, w = torch.from_numpy(labels[s]), torch.from_numpy(weights[s])
        token_loss = torch.from_numpy(loss[s]).requires_grad_()  # detached by the metric
        per_token(labels=lab, loss=token_loss, weights=w)
        summed.update(lab, (token_loss * w).sum(), w)  # the reference's form
    assert float(per_token) == pytest.approx(expected, **EXACT)
    assert float(summed) == pytest.approx(expected, **EXACT)


def test_perplexity_weighted_and_unweighted():
    rng = np.random.default_rng(5)
    loss = rng.uniform(0.0, 4.0, size=(8, 5))
    weights = rng.uniform(0.5, 3.0, size=(8, 5))
    weighted = metrics.PerplexityMetric()
    weighted.update(torch.zeros(8, 5), torch.from_numpy(loss), torch.from_numpy(weights))
    plain = metrics.PerplexityMetric()
    plain.update(torch.zeros(8, 5), torch.from_numpy(loss))
    assert float(weighted) == pytest.approx(
        math.exp((weights * loss).sum() / weights.sum()), **EXACT
    )
    assert float(plain) == pytest.approx(math.exp(loss.mean()), **EXACT)


def test_mean_metric_is_weighted_mean():
    rng = np.random.default_rng(9)
    values = rng.normal(size=50)
    weights = np.where(rng.random(50) < 0.2, 0.0, rng.uniform(0.1, 2.0, size=50))
    metric = metrics.MeanMetric("eval/loss")
    for s in _chunks(50, rng):
        metric(torch.from_numpy(values[s]), weights=torch.from_numpy(weights[s]))
    metric.update(2.5)  # a plain number, weight 1
    expected = np.average(np.append(values, 2.5), weights=np.append(weights, 1.0))
    assert float(metric) == pytest.approx(expected, **EXACT)


# -- state: state_dict, reset, data-parallel sum ----------------------------------------


def _batches(kind, rng):
    """Two batches of update() arguments for a metric of ``kind``."""
    out = []
    for _ in range(2):
        if kind == "classes":
            lab, pred, w = _classification(rng, 4, rows=8, cols=5)
            out.append((torch.from_numpy(lab), torch.from_numpy(pred), torch.from_numpy(w)))
        elif kind == "binary":
            lab, sc, w = _binary(rng, n=60)
            out.append((torch.from_numpy(lab), torch.from_numpy(sc), torch.from_numpy(w)))
        elif kind == "ranking":
            lab, sc, w = _ranking(rng, rows=12, num_classes=6)
            out.append((torch.from_numpy(lab), torch.from_numpy(sc), torch.from_numpy(w)))
        elif kind == "loss":
            loss = torch.from_numpy(rng.uniform(0, 3, size=(4, 6)))
            out.append((torch.zeros(4, 6), loss, torch.from_numpy(rng.uniform(0, 1, (4, 6)))))
        else:  # "values"
            out.append((torch.from_numpy(rng.normal(size=7)), torch.from_numpy(rng.random(7))))
    return out


FACTORIES = {
    "accuracy": (lambda: metrics.AccuracyMetric("a"), "classes"),
    "mean_per_class": (lambda: metrics.MeanPerClassAccuracyMetric(4), "classes"),
    "fbeta": (lambda: metrics.FBetaScoreMetric(4, average_type="macro"), "classes"),
    "iou": (lambda: metrics.MeanIOUMetric(4, ignore_classes=[0]), "classes"),
    "dice": (lambda: metrics.DiceCoefficientMetric(4), "classes"),
    "auc_roc": (lambda: metrics.AUCMetric(50), "binary"),
    "auc_pr": (lambda: metrics.AUCMetric(50, curve="PR"), "binary"),
    "precision_at_k": (lambda: metrics.PrecisionAtKMetric(2), "ranking"),
    "recall_at_k": (lambda: metrics.RecallAtKMetric(2), "ranking"),
    "perplexity": (lambda: metrics.PerplexityMetric(), "loss"),
    "mean": (lambda: metrics.MeanMetric(), "values"),
}


@pytest.mark.parametrize("which", sorted(FACTORIES))
def test_state_dict_round_trip_continues_exactly(which):
    factory, kind = FACTORIES[which]
    first, second = _batches(kind, np.random.default_rng(0))
    original = factory()
    original.update(*first)

    buffer = io.BytesIO()
    torch.save(original.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer)
    assert list(state) == [name for name, _ in original.named_buffers() if name in state]
    assert all(t.dtype == torch.float64 for t in state.values())
    restored = factory()
    restored.load_state_dict(state)
    assert float(restored) == float(original)

    original.update(*second)
    restored.update(*second)
    assert float(restored) == float(original)


@pytest.mark.parametrize("which", sorted(FACTORIES))
def test_reset_forgets_everything(which):
    factory, kind = FACTORIES[which]
    first, second = _batches(kind, np.random.default_rng(1))
    metric = factory()
    metric.update(*first)
    metric.reset()
    assert math.isnan(float(metric))
    assert all(bool((t == 0).all()) for t in metric.accumulators())
    fresh = factory()
    metric.update(*second)
    fresh.update(*second)
    assert float(metric) == float(fresh)


@pytest.mark.parametrize("which", sorted(FACTORIES))
def test_summed_accumulators_equal_one_metric_on_all_data(which):
    # What a data-parallel all-reduce (SUM) of accumulators() does, with two ranks.
    factory, kind = FACTORIES[which]
    first, second = _batches(kind, np.random.default_rng(2))
    rank0, rank1, single = factory(), factory(), factory()
    rank0.update(*first)
    rank1.update(*second)
    single.update(*first)
    single.update(*second)
    for a, b in zip(rank0.accumulators(), rank1.accumulators()):
        a.add_(b)
    assert float(rank0) == pytest.approx(float(single), **EXACT)


def test_forward_returns_value_accumulated_since_reset():
    metric = metrics.AccuracyMetric()
    assert float(metric(torch.tensor([1, 1]), torch.tensor([1, 0]))) == 0.5
    assert float(metric(torch.tensor([2, 2]), torch.tensor([2, 2]))) == 0.75
    assert math.isnan(float(metrics.FBetaScoreMetric(3)))  # nothing seen yet


# -- registry ---------------------------------------------------------------------------


def test_registry_lists_live_metrics_and_drops_dead_ones():
    a = metrics.AccuracyMetric("reg_test")
    b = metrics.PerplexityMetric("reg_test")
    c = metrics.MeanMetric("reg_test_alone")
    listed = {name: m for name, m in metrics.get_all_metrics() if "reg_test" in name}
    assert listed == {"reg_test.0": a, "reg_test.1": b, "reg_test_alone": c}
    assert b in metrics.registry.default_registry
    del b, listed  # the last references: the registry must not keep b alive
    gc.collect()
    names = [name for name, _ in metrics.get_all_metrics() if "reg_test" in name]
    assert names == ["reg_test", "reg_test_alone"]
    assert metrics.AccuracyMetric().name == "AccuracyMetric"


# -- errors -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda: metrics.FBetaScoreMetric(1),
        lambda: metrics.MeanIOUMetric(num_classes=0),
        lambda: metrics.DiceCoefficientMetric(1),
        lambda: metrics.MeanPerClassAccuracyMetric(1),
    ],
)
def test_num_classes_below_two_is_rejected(make):
    with pytest.raises(ValueError, match=r"num_classes must be at least 2, got \d.*number of"):
        make()


def test_bad_constructor_arguments_say_the_fix():
    with pytest.raises(ValueError, match=r"average_type must be one of \['micro', 'macro'\]"):
        metrics.FBetaScoreMetric(3, average_type="weighted")
    with pytest.raises(ValueError, match="beta must be > 0"):
        metrics.FBetaScoreMetric(3, beta=0)
    with pytest.raises(ValueError, match=r"curve must be one of \['ROC', 'PR'\], got 'AP'"):
        metrics.AUCMetric(curve="AP")
    with pytest.raises(ValueError, match="num_thresholds must be >= 2"):
        metrics.AUCMetric(num_thresholds=1)
    with pytest.raises(ValueError, match="k must be >= 1"):
        metrics.PrecisionAtKMetric(0)
    with pytest.raises(ValueError, match=r"ignore_labels contains 7.*\[0, 3\)"):
        metrics.FBetaScoreMetric(3, ignore_labels=[7])
    with pytest.raises(ValueError, match=r"ignores all 2 classes.*ignore fewer"):
        metrics.MeanIOUMetric(2, ignore_classes=[0, 1])
    with pytest.raises(TypeError, match="name must be a non-empty string"):
        metrics.AccuracyMetric(3)


@pytest.mark.parametrize(
    "metric",
    [
        metrics.AccuracyMetric(),
        metrics.MeanPerClassAccuracyMetric(3),
        metrics.FBetaScoreMetric(3),
        metrics.MeanIOUMetric(3),
        metrics.DiceCoefficientMetric(3),
    ],
    ids=lambda m: type(m).__name__,
)
def test_shape_mismatch_is_rejected_with_hint(metric):
    logits = torch.zeros(4, 3)
    with pytest.raises(ValueError, match=r"labels has shape \(4,\) but predictions has shape "):
        metric.update(torch.zeros(4, dtype=torch.int64), logits)
    with pytest.raises(ValueError, match=r"argmax"):
        metric.update(labels=torch.zeros(4, dtype=torch.int64), predictions=logits)


def test_bad_update_inputs_say_the_fix():
    labels = torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match=r"weights has shape \(2,\).*does not broadcast"):
        metrics.AccuracyMetric().update(labels, labels, torch.ones(2))
    with pytest.raises(ValueError, match=r"labels contains \[5\].*weight 0"):
        metrics.MeanIOUMetric(3).update(torch.tensor([0, 5]), torch.tensor([0, 1]))
    # ... while padding with weight 0 is allowed.
    metrics.MeanIOUMetric(3).update(torch.tensor([0, -100]), torch.tensor([0, 1]), [1.0, 0.0])
    with pytest.raises(TypeError, match=r"integer class ids.*argmax"):
        metrics.FBetaScoreMetric(3).update(labels, labels.float())
    with pytest.raises(ValueError, match=r"labels has shape \(3,\) but predictions"):
        metrics.AUCMetric().update(labels, torch.rand(3, 1))
    with pytest.raises(ValueError, match=r"k=4 is more than the 3 classes"):
        metrics.PrecisionAtKMetric(4).update(labels, torch.rand(3, 3))
    with pytest.raises(ValueError, match="same batch shape"):
        metrics.RecallAtKMetric(1).update(torch.zeros(2, 2, dtype=torch.int64), torch.rand(3, 3))
    with pytest.raises(ValueError, match=r"reduction=\"none\"\) or a scalar"):
        metrics.PerplexityMetric().update(torch.zeros(2, 3), torch.ones(2))
