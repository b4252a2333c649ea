"""The price version in force for (model, tier): a job pays the version in force when it was accepted."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from inferq.db import Price, utcnow
from inferq.settings import Settings


def current_price(session: Session, settings: Settings, model: str, tier: str) -> Price:
    """The price version in force for (model, tier); version 1 is created from the settings on first use
    (the batch tier gets ``batch_discount``). Does not commit; safe against concurrent first use."""
    now = utcnow()
    stmt = (select(Price).where(Price.model == model, Price.tier == tier, Price.effective_from <= now)
            .order_by(Price.version.desc()).limit(1))
    price = session.scalar(stmt)
    if price is not None:
        return price
    mult = settings.batch_discount if tier == "batch" else 1.0
    fresh = Price(model=model, tier=tier, version=1, effective_from=now,
                  prompt_per_mtok=int(round(settings.price_prompt_per_mtok * mult)),
                  cached_prompt_per_mtok=int(round(settings.price_cached_prompt_per_mtok * mult)),
                  completion_per_mtok=int(round(settings.price_completion_per_mtok * mult)))
    try:
        with session.begin_nested():
            session.add(fresh)
        return fresh
    except IntegrityError:  # another process created version 1 first
        price = session.scalar(select(Price).where(Price.model == model, Price.tier == tier)
                               .order_by(Price.version.desc()).limit(1))
        assert price is not None
        return price
