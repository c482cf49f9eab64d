"""The digests a resume compares before it replays the interrupted run's noise (dp_hf.fingerprints)."""

from __future__ import annotations

import datasets
import torch
from dp_training import bert_classifier, classification_data

from dp_hf.fingerprints import callable_name, content_digest, model_digest


def test_the_content_digest_reads_every_row_and_only_the_content():
    data = classification_data(300)
    assert content_digest(data) == content_digest(classification_data(300))  # built twice: same bytes
    changed = data.map(
        lambda row, i: {"labels": 1 - row["labels"] if i == 157 else row["labels"]}, with_indices=True
    )
    assert content_digest(changed) != content_digest(data)  # one row of 300
    # A select shares the buffers of the whole table (an offset, or an indices mapping): told apart.
    assert content_digest(data.select(range(0, 100))) != content_digest(data.select(range(100, 200)))
    assert content_digest(data.select([5, 3])) != content_digest(data.select([3, 5]))
    assert content_digest(data.shuffle(seed=1)) != content_digest(data.shuffle(seed=2))
    # The format's transform by name (its repr holds a memory address).
    first, second = classification_data(10), classification_data(10)
    first.set_transform(_identity)
    second.set_transform(_identity)
    assert content_digest(first) == content_digest(second) != content_digest(classification_data(10))


def test_tensor_datasets_and_others():
    x = torch.arange(12.0).view(6, 2)
    same = content_digest(torch.utils.data.TensorDataset(x.clone(), torch.zeros(6)))
    assert same == content_digest(torch.utils.data.TensorDataset(x.clone(), torch.zeros(6)))
    x[4, 1] += 1
    assert content_digest(torch.utils.data.TensorDataset(x, torch.zeros(6))) != same
    assert content_digest([1, 2, 3]) is None  # no digest of every row: the sampled one is all there is


def test_the_model_digest_follows_the_config_but_not_what_training_toggles():
    model = bert_classifier()
    before = model_digest(model)
    model.config.use_cache = not model.config.use_cache  # the Trainer's, while training
    model.config.dtype = "float32"  # written by saving
    assert model_digest(model) == before == model_digest(bert_classifier(seed=1))  # weights are not config
    assert model_digest(bert_classifier(hidden_dropout_prob=0.1)) != before
    assert model_digest(torch.nn.Linear(2, 2)) is None


def _identity(batch):
    return batch


def test_callable_names_have_no_address():
    assert callable_name(_identity) == f"{__name__}._identity"
    assert callable_name(datasets.Dataset.from_dict({"a": [1]})) == "datasets.arrow_dataset.Dataset"
    assert callable_name(None) is None
