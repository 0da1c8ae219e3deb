"""The settings of rate budgets and destination isolation: the providers' shared budgets,
the urgent lane's reserve, each destination's share of a consumer and its circuit breaker.
Part of ``service.settings.Settings`` (which inherits them, with the ``RELAY_`` prefix);
kept apart so each settings module stays readable.
"""

from __future__ import annotations

import re

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings

_NUMBER = r"\d+(\.\d+)?"
_BUDGET = rf"\s*[\w.-]+={_NUMBER}(/{_NUMBER})?\s*"
_BUDGETS = re.compile(rf"^({_BUDGET}(,{_BUDGET})*)?$")


class BudgetSettings(BaseSettings):
    """Budget and isolation fields of ``Settings``; environment variable = ``RELAY_`` +
    field name."""

    budgets: str = Field(
        default="",
        description="Rate budgets per provider shared by all replicas: "
        "'provider=rate[/burst],...' in messages per second, e.g. 'webhook=50/5,email=10'. "
        "A provider without one is not rate-limited (a throttle answer still pauses it).",
    )
    budget_urgent_reserve: float = Field(
        default=0.2,
        ge=0,
        le=1,
        description="Share of each budget's burst that bulk sends leave for the urgent lane.",
    )
    budget_max_wait_seconds: float = Field(
        default=30.0,
        gt=0,
        description="Longest a claimed send waits for budget before it is deferred (s).",
    )
    destination_max_share: float = Field(
        default=0.25,
        gt=0,
        le=1,
        description="Share of the prefetch one destination may use at once; more waits "
        "for a slot (see destination_wait_seconds), then is deferred.",
    )
    destination_wait_seconds: float = Field(
        default=1.0,
        ge=0,
        description="Longest a send waits for a slot of its destination's share before it is "
        "deferred (s); at most a share's worth of sends wait. 0: defer at once.",
    )
    breaker_failure_threshold: int = Field(
        default=5, ge=1, description="Consecutive failures that open a destination's circuit."
    )
    breaker_cooldown_seconds: float = Field(
        default=30.0, gt=0, description="How long an open circuit defers sends (s)."
    )

    @field_validator("budgets")
    @classmethod
    def _budgets_syntax(cls, value: str) -> str:
        if not _BUDGETS.match(value):
            raise ValueError("expected provider=rate[/burst],... e.g. webhook=50/5,email=10")
        return value
