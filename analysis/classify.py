"""Request-type classification from prefill expert counts (core paper §5.1, docs/analysis.md).

Per layer, a multinomial logistic regression maps a request's raw prefill count vector ``[E]`` to
its dataset. Protocol:

1. Balance: every dataset contributes the same number of requests, n = min over datasets of its
   request count (capped at ``max_requests_per_dataset``), drawn at random (seeded).
2. Split: 80:20 train:test, stratified by dataset, so both sides hold the datasets equally.
3. Features: the raw prefill token counts per expert, standardized per feature with the mean and
   standard deviation of the training split (a monotone rescaling that lets the solver converge;
   no information is added). Model: scikit-learn ``LogisticRegression`` (lbfgs, multinomial).
4. Report accuracy on the test split per layer and its mean over layers; chance = 1 / number of
   datasets (exact, as the test split is balanced); a shuffled-label control trains on permuted
   training labels and scores on the true test labels (it must land near chance; if it does not,
   the split leaks); confusion matrices (rows true, columns predicted, test counts) per layer.
   The control's solver stops after ``control_max_iter`` (50) iterations: permuted labels carry no
   signal, so it never converges; at the classifier's 300 it took ~95 % of the step's time
   (126 s of the README trace's analysis) for the same chance-level accuracy.

Shape legend (docs/architecture.md): R requests, L MoE layers, E logical experts per layer, D datasets.

Out of scope: predicting a cluster for routing at serving time (``placement``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl

from moetrace._deps import require
from moetrace.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class ClassifyResult:
    """Per-layer classification of datasets from prefill counts."""

    datasets: tuple[str, ...]  # class labels, sorted (axis D of the confusion matrices)
    layers: tuple[int, ...]  # MoE-layer ordinals (axis L)
    accuracy_L: np.ndarray  # float64 [L], test accuracy
    shuffled_accuracy_L: np.ndarray  # float64 [L], the shuffled-label control's test accuracy
    confusion_LDD: np.ndarray  # int64 [L, D, D], rows true dataset, columns predicted
    chance: float  # 1 / D
    num_train: int  # requests in the training split
    num_test: int  # requests in the test split

    @property
    def mean_accuracy(self) -> float:
        return float(self.accuracy_L.mean())

    @property
    def mean_shuffled_accuracy(self) -> float:
        return float(self.shuffled_accuracy_L.mean())


def balanced_split(
    label_R: np.ndarray, *, seed: int, test_fraction: float = 0.2, max_requests_per_dataset: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Row indices (train, test): equal requests per label, then a stratified split. int64 arrays."""
    rng = np.random.default_rng(seed)
    labels, inv = np.unique(label_R, return_inverse=True)
    if len(labels) < 2:
        raise ConfigError(f"classification needs at least 2 datasets in the trace, found {labels.tolist()}")
    sizes = np.bincount(inv)
    n = int(sizes.min()) if max_requests_per_dataset is None else min(int(sizes.min()), max_requests_per_dataset)
    n_test = int(round(n * test_fraction))
    if n_test < 1 or n - n_test < 1:
        raise ConfigError(
            f"dataset {str(labels[sizes.argmin()])!r} has only {sizes.min()} requests: too few for a {1 - test_fraction:.0%}:"
            f"{test_fraction:.0%} split; collect more requests of it"
        )
    train, test = [], []
    for d in range(len(labels)):
        pick = rng.permutation(np.flatnonzero(inv == d))[:n]
        test.append(pick[:n_test])
        train.append(pick[n_test:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def classify_layers(
    prefill_RLE: np.ndarray,
    label_R: np.ndarray,
    *,
    layers: tuple[int, ...] | None = None,
    seed: int = 0,
    test_fraction: float = 0.2,
    max_requests_per_dataset: int | None = 5000,
    max_iter: int = 300,
    control_max_iter: int = 50,
) -> ClassifyResult:
    """Train and score one classifier per layer (see the module docstring for the protocol).

    prefill_RLE: raw prefill counts ``[R, L, E]`` (any integer dtype); label_R: ``[R]`` dataset
    labels; layers: names of axis L for the result (default 0..L-1).
    """
    sklearn_lm = require("sklearn.linear_model", purpose="request-type classification")
    metrics = require("sklearn.metrics", purpose="request-type classification")
    label_R = np.asarray(label_R).astype(str)
    train, test = balanced_split(
        label_R, seed=seed, test_fraction=test_fraction, max_requests_per_dataset=max_requests_per_dataset
    )
    datasets = tuple(np.unique(label_R).tolist())
    y_tr, y_te = label_R[train], label_R[test]
    y_shuf = np.random.default_rng(seed + 1).permutation(y_tr)
    L = prefill_RLE.shape[1]
    acc = np.empty(L)
    acc_shuf = np.empty(L)
    conf = np.zeros((L, len(datasets), len(datasets)), dtype=np.int64)
    import warnings

    # one thread in every native pool (BLAS, and the OpenMP of scikit-learn's loss): these are small
    # dense problems, and OpenBLAS's spinning worker threads made one fit ~80x slower on the busy
    # 2-core machine (1.4 s -> 112 s measured)
    threadpoolctl = require("threadpoolctl", purpose="request-type classification")
    with threadpoolctl.threadpool_limits(limits=1):
        for l in range(L):
            x_tr = prefill_RLE[train, l].astype(np.float64)
            x_te = prefill_RLE[test, l].astype(np.float64)
            mu, sd = x_tr.mean(0), x_tr.std(0)
            sd[sd == 0] = 1.0
            x_tr = (x_tr - mu) / sd
            x_te = (x_te - mu) / sd
            with warnings.catch_warnings():
                # a solver stopping at max_iter still yields a valid (slightly less tuned) classifier
                warnings.filterwarnings("ignore", category=UserWarning)
                warnings.filterwarnings("ignore", message=".*converge.*")
                clf = sklearn_lm.LogisticRegression(max_iter=max_iter).fit(x_tr, y_tr)
                pred = clf.predict(x_te)
                ctl = sklearn_lm.LogisticRegression(max_iter=control_max_iter).fit(x_tr, y_shuf)
            acc[l] = float((pred == y_te).mean())
            acc_shuf[l] = float((ctl.predict(x_te) == y_te).mean())
            conf[l] = metrics.confusion_matrix(y_te, pred, labels=list(datasets))
    return ClassifyResult(
        datasets=datasets,
        layers=tuple(range(L)) if layers is None else tuple(layers),
        accuracy_L=acc,
        shuffled_accuracy_L=acc_shuf,
        confusion_LDD=conf,
        chance=1.0 / len(datasets),
        num_train=int(train.size),
        num_test=int(test.size),
    )


def classify_tables(res: ClassifyResult, *, model_layers: tuple[int, ...]) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(accuracy, confusion) tables.

    accuracy columns: layer, model_layer, accuracy, shuffled_accuracy, chance.
    confusion columns: layer, model_layer, true_dataset, predicted_dataset, count.
    """
    acc = pl.DataFrame(
        {
            "layer": list(res.layers),
            "model_layer": list(model_layers),
            "accuracy": res.accuracy_L,
            "shuffled_accuracy": res.shuffled_accuracy_L,
            "chance": np.full(len(res.layers), res.chance),
        }
    )
    L, D, _ = res.confusion_LDD.shape
    l, a, b = (x.ravel() for x in np.meshgrid(np.arange(L), np.arange(D), np.arange(D), indexing="ij"))
    conf = pl.DataFrame(
        {
            "layer": np.asarray(res.layers)[l],
            "model_layer": np.asarray(model_layers)[l],
            "true_dataset": [res.datasets[i] for i in a],
            "predicted_dataset": [res.datasets[i] for i in b],
            "count": res.confusion_LDD.ravel(),
        }
    )
    return acc, conf
