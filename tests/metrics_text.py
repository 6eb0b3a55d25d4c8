"""Samples from a Prometheus text exposition (a `/metrics` page), parsed with prometheus_client's
parser rather than by hand: quoting, escapes and label order are its business."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


def samples(text: str, name: str, **labels: str) -> list[Sample]:
    """The samples exposed as `name` (the full series name, e.g. with `_total`) whose labels
    include `labels`."""
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples
            if sample.name == name and all(sample.labels.get(key) == value for key, value in labels.items())]
