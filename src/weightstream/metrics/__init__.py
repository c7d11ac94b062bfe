"""Evaluation metrics, used as ``import weightstream.metrics as metrics``.

Each metric is an ``nn.Module``: call it on a batch (``update`` then
``compute``), read it with ``float(metric)``, clear it with ``reset()``. Its state
is in float64 buffers that are saved with ``state_dict()`` and that a trainer
all-reduces across data-parallel ranks (``Metric.accumulators()``); see Note
[metric state] in :mod:`weightstream.metrics.base`. Every metric created is
listed, weakly, by :func:`get_all_metrics`.
"""

from weightstream.metrics.accuracy import AccuracyMetric, MeanPerClassAccuracyMetric
from weightstream.metrics.auc import AUCMetric
from weightstream.metrics.base import Metric
from weightstream.metrics.confusion import ConfusionMatrixMetric
from weightstream.metrics.fbeta import FBetaScoreMetric
from weightstream.metrics.mean import MeanMetric
from weightstream.metrics.perplexity import PerplexityMetric
from weightstream.metrics.ranking import PrecisionAtKMetric, RecallAtKMetric
from weightstream.metrics.registry import MetricRegistry, get_all_metrics
from weightstream.metrics.segmentation import DiceCoefficientMetric, MeanIOUMetric

__all__ = [
    "AUCMetric",
    "AccuracyMetric",
    "ConfusionMatrixMetric",
    "DiceCoefficientMetric",
    "FBetaScoreMetric",
    "MeanIOUMetric",
    "MeanMetric",
    "MeanPerClassAccuracyMetric",
    "Metric",
    "MetricRegistry",
    "PerplexityMetric",
    "PrecisionAtKMetric",
    "RecallAtKMetric",
    "get_all_metrics",
]
