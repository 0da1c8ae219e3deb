"""The ledger: the one door to delivery state.

Every named statement of ``sql/queries.sql`` that writes ``deliveries``,
``delivery_attempts``, ``publish_runs`` or the records kept with them (``run_actions``,
``replays``) is run from a module of this package: one typed function per transition,
over one guarded statement whose ``WHERE`` is the state machine. A transition that finds
its row in another state does nothing and says so (an empty result), because "someone
else won" is a normal answer in a system with redelivery and rescue. Other modules may
read through named blocks; ``tests/unit/test_ledger_door.py`` fails on a write run from
anywhere else.

This module is the package's vocabulary (``service.ledger.model``, re-exported: the
states, the rows a transition reads and writes, the connection types; the helpers the
modules share stay in ``model``). Each concern is a module of its own, which callers
import by name (``from service.ledger import sending``):

* ``admission``: due reminders locked, their owed occurrences inserted, their schedules
  advanced (one transaction per batch)
* ``intake``: rows from outside the schedule: an outbox intent, an event's fan-out, a
  subscription's backfill
* ``publication``: the pending sweep's page; ``pending -> queued`` once a publish is
  confirmed
* ``sending``: the claim, giving a claim back, an attempt's outcome, a confirmed dead letter
* ``lastcheck``: the last check before a request, and taking it back
* ``settlement``: receipts settling ``accepted`` rows (``delivered``, ``bounced``)
* ``recovery``: rescue and the overdue sweep (rows whose messages are presumed lost)
* ``replays``: replay (``dead -> pending``, a new round) and the record of replays and drops
* ``control``: an operator's transitions: a run's hold, release, cancel and dead-letter
  (recorded in ``run_actions``), a reminder's cancel, backfill's reopening of paused
  skips, a schedule edit's skips
* ``switches``: a destination's enable settling its held rows
* ``publish_runs``: a publish run's record, started and finished with its counts

A new statement that writes these tables (a purge of final deliveries and their attempts,
an erasure) is a module of this package too.
"""

from __future__ import annotations

from service.ledger.model import (
    FINAL_STATES,
    OPEN_STATES,
    Attempt,
    Claimed,
    Completion,
    Connection,
    Executor,
    SendFacts,
    State,
    Target,
    Unclaimable,
    operator_dead_error,
    outbox_key,
)

__all__ = [
    "FINAL_STATES",
    "OPEN_STATES",
    "Attempt",
    "Claimed",
    "Completion",
    "Connection",
    "Executor",
    "SendFacts",
    "State",
    "Target",
    "Unclaimable",
    "operator_dead_error",
    "outbox_key",
]
