"""The leader's projectors, by name."""

from __future__ import annotations

from leader.projectors.api_tokens import ApiTokensProjector
from leader.projectors.catalog import CatalogProjector
from leader.projectors.fellows import FellowsProjector
from leader.projectors.loads import LoadsProjector
from leader.projectors.projector import Projector
from leader.projectors.requests import RequestsProjector
from leader.verify.projector import ChecksProjector


def all_projectors() -> list[Projector]:
    return [FellowsProjector(), CatalogProjector(), LoadsProjector(), RequestsProjector(),
            ApiTokensProjector(), ChecksProjector()]
