"""The ledger: the one door to delivery state.

Every named statement of ``sql/queries.sql`` that writes ``deliveries``,
``delivery_attempts``, ``publish_runs`` or their records (``run_actions``, ``replays``)
is run from a module of this package, one typed function per transition over one
guarded statement: its ``WHERE`` is the state machine, and a transition that finds its
row in another state does nothing and says so (an empty result), because "someone else
won" is a normal answer in a system with redelivery and rescue. Other modules may read
through named queries; ``tests/unit/test_ledger_door.py`` holds the line.

This module is the package's vocabulary (``service.ledger.model``, re-exported: the
states, the rows, the connection types); each concern is a module of its own:

* ``admission``: due reminders locked, their owed occurrences inserted, their schedules
  advanced (one transaction per batch)
* ``intake``: rows from outside the schedule: outbox intents, an event's fan-out, a
  subscription's backfill
* ``sending``: claim, give back, write an attempt's outcome, confirm a dead letter
* ``lastcheck``: the last check before a request
* ``publication``: the pending sweep's page, and ``pending -> queued`` once a publish is confirmed
* ``recovery``: rescue and the overdue sweep (which rows' messages are presumed lost, stamped)
* ``publish_runs``: a publish run's record, started and finished with its counts
* ``control``: an operator's transitions: a run's hold, release, cancel, dead-letter (with
  their record in ``run_actions``), a reminder's cancel, backfill's reopening of paused
  skips, a schedule edit's skips
* ``settlement``: receipts settling ``accepted`` rows (``delivered``, ``bounced``)
* ``switches``: a destination's enable settling its held rows
* ``replays``: replay (``dead -> pending``, a new round) and the record of replays and drops
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
    retry_on_conflict,
    send_facts,
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
    "retry_on_conflict",
    "send_facts",
]
