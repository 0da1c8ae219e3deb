"""Why a reminder is inactive: the Python mirror of ``reminders.inactive_reason``.

A reminder is active (``inactive_reason`` NULL), or inactive for one recorded reason, so
that the inverse of an action undoes only what that action did (migration 0009):

* ``cancelled``: an operator stopped it (``relay reminders cancel``, or a reminders file
  line with ``"active": false``). Nothing brings it back but a file line with
  ``"active": true``; enabling its destination never does.
* ``destination_disabled``: paused when its destination was disabled (an operator, the
  console, a failure streak). ``relay destinations enable`` resumes it.
* ``gone``: paused when its destination answered 410 Gone. Enabling the destination is an
  operator saying it is back, so enable resumes it too.
* ``erased``: its recipient was erased (``relay erase``): a tombstone without destination
  or payload. Nothing revives it: not a reminders file line, not enable, not cancel.

A paused reminder's deliveries are held, not skipped: it is not cancelled.
"""

from __future__ import annotations

import enum


class InactiveReason(enum.StrEnum):
    """The values of the ``reminders.inactive_reason`` CHECK, in its order."""

    CANCELLED = "cancelled"
    DESTINATION_DISABLED = "destination_disabled"
    GONE = "gone"
    ERASED = "erased"
