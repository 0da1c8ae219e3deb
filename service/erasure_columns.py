"""Where a recipient's data can be, column by column, and what ``relay erase`` does there.

Every text and jsonb column of every table is listed once or more (a test compares this
list with a migrated database, so a new column fails it until someone decides here):

* ``delete``: the row is the recipient's (a suppression of the address, the destination
  registered at the URL and what hangs off it, the receipts of the recipient's
  deliveries): it is removed.
* ``redact``: the row stays, without the recipient: the value is cleared or replaced (a
  reminder becomes a tombstone, a delivery keeps its id, state, times and counts).
* ``scrub``: free text or JSON that may quote the address (a payload naming a customer, a
  partner's reply, an operator's reason): in every row, each mention (any stored
  spelling, case, percent- or JSON-escaped form) is replaced by ``[erased]``.
* ``none``: cannot hold the recipient; ``why`` says why (usually: the entry's alphabet
  has no ``@``, ``+`` or ``/``; or it is our own code, count, hash or an operator's name).

The statements that do it are named blocks ``erase_*`` in ``sql/queries.sql``, run by
``service.ledger.erasure``; this module is the list to read and review.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final


class Action(enum.StrEnum):
    DELETE = "delete"
    REDACT = "redact"
    SCRUB = "scrub"
    NONE = "none"


@dataclass(frozen=True)
class Column:
    table: str
    column: str
    action: Action
    why: str


D, R, S, N = Action.DELETE, Action.REDACT, Action.SCRUB, Action.NONE

_ID = "an identifier: the entry's alphabet (letters, digits, '.', '_', ':', '-') has no @, + or /"
_CODE = "one of a fixed set of values (a CHECK or the code's enum)"
_OPERATOR = "an operator's name (--operator, the console's login), not a recipient"
_SCRUB_TEXT = "free text that may quote an address"

COLUMNS: Final[tuple[Column, ...]] = (
    # reminders (0001, 0008, 0009): the recipient's become tombstones
    Column("reminders", "destination", R, "the recipient's: replaced by 'erased'"),
    Column("reminders", "payload", R, "the recipient's: replaced by {}"),
    Column("reminders", "payload", S, "another reminder's message may name the recipient"),
    Column("reminders", "id", N, _ID),
    Column("reminders", "channel", N, _CODE),
    Column("reminders", "schedule_kind", N, _CODE),
    Column("reminders", "cron", N, "a cron expression (checked when loaded)"),
    Column("reminders", "timezone", N, "an IANA zone name"),
    Column("reminders", "missed_policy", N, _CODE),
    Column("reminders", "provider", N, "a budget name: letters, digits, '.', '_', '-'"),
    Column("reminders", "event_type", N, "an event type: letters, digits, '.', '_', '-'"),
    Column("reminders", "inactive_reason", R, "the recipient's: set to 'erased'"),
    # reminder_schedules (0012): kept with the tombstone
    Column("reminder_schedules", "reminder_id", N, _ID),
    Column("reminder_schedules", "schedule_kind", N, _CODE),
    Column("reminder_schedules", "cron", N, "a cron expression"),
    Column("reminder_schedules", "timezone", N, "an IANA zone name"),
    # deliveries (0001 ... 0017): the recipient's keep id, state, times and counts
    Column("deliveries", "destination", R, "the recipient's: NULL, 'erased' for outbox rows"),
    Column("deliveries", "payload", R, "the recipient's: NULL, {} for outbox rows"),
    Column("deliveries", "payload", S, "another delivery's payload (an event's copy) may name it"),
    Column("deliveries", "last_error", R, "the recipient's: NULL (may quote the answer)"),
    Column("deliveries", "last_error", S, _SCRUB_TEXT),
    Column("deliveries", "receipt", R, "the recipient's: NULL"),
    Column("deliveries", "receipt", S, "taken from an answer's headers"),
    Column("deliveries", "skip_reason", R, "the recipient's not yet sent: 'erased'"),
    Column("deliveries", "idempotency_key", N, _ID + " (reminder:, outbox:, event: keys)"),
    Column("deliveries", "reminder_id", N, _ID),
    Column("deliveries", "source", N, _CODE),
    Column("deliveries", "channel", N, _CODE),
    Column("deliveries", "provider", N, "a budget name"),
    Column("deliveries", "event_type", N, "an event type name"),
    # delivery_attempts (0001, 0003, 0006, 0014b): what the request met
    Column(
        "delivery_attempts", "response_excerpt", R, "the recipient's: NULL (a reply may echo it)"
    ),
    Column("delivery_attempts", "response_excerpt", S, "another partner's reply may quote it"),
    Column("delivery_attempts", "error", R, "the recipient's: NULL"),
    Column("delivery_attempts", "error", S, _SCRUB_TEXT),
    Column("delivery_attempts", "outcome", N, _CODE),
    Column("delivery_attempts", "provider_message_id", N, "the provider's id of the message"),
    # receipts (0014b): append-only, so the recipient's are deleted rather than rewritten
    Column("receipts", "reason", D, "the recipient's receipts: the provider's raw text"),
    Column("receipts", "provider_message_id", D, "the recipient's receipts"),
    Column("receipts", "event_key", D, "the recipient's receipts"),
    Column("receipts", "event", D, "the recipient's receipts"),
    Column("receipts", "channel", D, "the recipient's receipts"),
    Column("receipts", "outcome", D, "the recipient's receipts"),
    # reconciliations (0014d): what the provider said before a resend
    Column("reconciliations", "error", R, "the recipient's: NULL (the provider's words)"),
    Column("reconciliations", "provider_status", R, "the recipient's: NULL"),
    Column("reconciliations", "provider_message_id", N, "the provider's id of the message"),
    Column("reconciliations", "answer", N, _CODE),
    Column("reconciliations", "policy", N, _CODE),
    # suppressions (0014c): the address is the row
    Column("suppressions", "address", D, "the recipient's suppressions are deleted"),
    Column("suppressions", "detail", S, "a provider's code or an operator's words"),
    Column("suppressions", "removed_reason", S, "an operator's words"),
    Column("suppressions", "channel", N, _CODE),
    Column("suppressions", "reason", N, _CODE),
    Column("suppressions", "created_by", N, _OPERATOR + " or 'relay receipts'"),
    Column("suppressions", "removed_by", N, _OPERATOR),
    # destinations (0008, 0009, 0017): a webhook URL's registry row and what hangs off it
    Column("destinations", "url", D, "the recipient's destination is deleted"),
    Column("destinations", "disabled_reason", S, "an operator's words"),
    Column("destinations", "state", N, _CODE),
    Column("destination_secrets", "url", D, "the recipient's own signing secrets"),
    Column("destination_secrets", "encrypted", D, "the recipient's own signing secrets"),
    Column("destination_actions", "url", D, "the recipient's disable/enable records"),
    Column("destination_actions", "reason", S, "an operator's words"),
    Column("destination_actions", "effect", N, "counts of what a switch did"),
    Column("destination_actions", "operator", N, _OPERATOR),
    Column("destination_actions", "action", N, _CODE),
    Column("event_subscriptions", "url", D, "the recipient's subscriptions"),
    Column("event_subscriptions", "filter", S, "a filter may list an address as a value"),
    Column("event_subscriptions", "pattern", N, "an event type pattern"),
    Column("event_subscriptions", "provider", N, "a budget name"),
    # events (0017): business events, shared by every subscribed destination
    Column("events", "payload", S, "an event may name the recipient (a customer's e-mail)"),
    Column("events", "key", N, _ID),
    Column("events", "event_type", N, "an event type name"),
    Column("event_types", "description", S, "an operator's words"),
    Column("event_types", "schema", S, "a JSON Schema may quote an example address"),
    Column("event_types", "name", N, "an event type name"),
    # operators' records (0001, 0007, 0010)
    Column("publish_runs", "error", S, "a run's error text"),
    Column("publish_runs", "host", N, "the host that ran the publish run"),
    Column("publish_runs", "kind", N, _CODE),
    Column("publish_runs", "status", N, _CODE),
    Column("run_actions", "reason", S, "an operator's words"),
    Column("run_actions", "wire_outcomes", N, "delivery states -> counts"),
    Column("run_actions", "operator", N, _OPERATOR),
    Column("run_actions", "action", N, _CODE),
    Column("replays", "filters", S, "an operator's filters (--key, --reminder) as typed"),
    Column("replays", "operator", N, _OPERATOR),
    Column("replays", "source", N, _CODE),
    Column("admission", "changed_by", N, _OPERATOR),
    Column("admission_pauses", "paused_by", N, _OPERATOR),
    Column("admission_pauses", "resumed_by", N, _OPERATOR),
    Column("rate_budgets", "provider", N, "a budget name"),
    # the console (0016)
    Column("console_reveals", "page", S, "a page's path and query, as the browser sent it"),
    Column("console_reveals", "operator", N, _OPERATOR),
    Column("console_sessions", "operator", N, _OPERATOR),
    Column("console_sessions", "credential", N, "which operators-file entry (a hash)"),
    Column("console_sessions", "csrf", N, "a random token"),
    Column("console_sessions", "revoked_why", N, _CODE),
    Column("console_secrets", "name", N, _CODE),
    # the erasures' own record (0019): never the recipient
    Column("erasures", "recipient_ref", N, "a keyed hash (HMAC-SHA256) of the recipient"),
    Column("erasures", "reason", N, "refused when it names the recipient"),
    Column("erasures", "operator", N, _OPERATOR + "; refused when it names the recipient"),
    Column("erasures", "counts", N, "table -> what changed -> rows"),
    Column("erasures", "channel", N, _CODE),
    # retention's own records (0018): counts and the policy, never a row's content
    Column("publish_runs", "purged_counts", N, "'channel/state/skip reason' -> rows purged"),
    Column("purge_runs", "policy", N, "the retention periods in days and the pace (rows/s)"),
    Column("purge_runs", "counts", N, "'table/kind' -> rows purged"),
    Column("purge_runs", "status", N, _CODE),
    Column("purge_runs", "host", N, "the host that ran the purge"),
    Column("purge_runs", "error", N, "an exception's class name (the code's, never a message)"),
    Column("purge_totals", "table_name", N, "a table of this schema"),
    Column("purge_totals", "kind", N, _CODE),
    Column("schema_migrations", "version", N, "a migration file's name"),
)
