"""Pure scheduling pipeline of the router: endpoints -> filters -> scorers -> picker -> P/D decider."""

from services.router.scheduling.context import RequestContext
from services.router.scheduling.decider import PDDecider
from services.router.scheduling.endpoint import CacheConfig, Endpoint, EndpointLoad, Role, normalize_url
from services.router.scheduling.picker import MaxScorePicker
from services.router.scheduling.scheduler import RouteDecision, Scheduler, SchedulingConfig
from services.router.scheduling.strategies import ScorerWeights, StrategyName, make_strategy

__all__ = [
    "CacheConfig",
    "Endpoint",
    "EndpointLoad",
    "MaxScorePicker",
    "PDDecider",
    "RequestContext",
    "Role",
    "RouteDecision",
    "Scheduler",
    "SchedulingConfig",
    "ScorerWeights",
    "StrategyName",
    "make_strategy",
    "normalize_url",
]
