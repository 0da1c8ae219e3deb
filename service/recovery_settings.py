"""The settings of recovery: rescue (in every publish run) and the consumers' overdue sweep.
Part of ``service.settings.Settings`` (which inherits them, with the ``RELAY_`` prefix);
kept apart so each settings module stays readable.
"""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings


class RecoverySettings(BaseSettings):
    """Recovery fields of ``Settings``; environment variable = ``RELAY_`` + field name."""

    rescue_after_seconds: float = Field(
        default=900.0,
        gt=0,
        description="A queued/retrying row whose message should have arrived this long ago "
        "is published again by rescue (s).",
    )
    rescue_batch_limit: int = Field(
        default=5000,
        ge=1,
        description="Most rows one rescue pass (or one overdue sweep) republishes.",
    )
    overdue_after_seconds: float = Field(
        default=30.0,
        gt=0,
        description="A queued row not claimed this long after its due time (or its "
        "publication, if later) has its message republished by the consumers' overdue "
        "sweep: a message lost from the timer ladder costs this, not the rescue delay (s).",
    )
    overdue_sweep_seconds: float = Field(
        default=5.0,
        ge=0,
        description="How often each consumer runs the overdue sweep (s); 0 turns it off.",
    )
