"""Pure-Python scheduling: requests, the paged KV block manager and the continuous-batching scheduler."""

from scheduler.block_manager import BlockManager, PrefixHit
from scheduler.request import FinishReason, Request, RequestStatus, SamplingParams, Tier
from scheduler.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

__all__ = [
    "BlockManager",
    "FinishReason",
    "PrefixHit",
    "Request",
    "RequestStatus",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "Tier",
]
