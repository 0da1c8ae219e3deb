"""The size limits a delivery must fit, defined once: checked when it enters the ledger
(``service.entry``) and again when it is sent (the channel adapters' defaults).

Constants only, no imports: the channel adapters (leaves) read them too.
"""

from __future__ import annotations

# Webhook: the JSON body as sent (compact, UTF-8), i.e. the payload itself.
WEBHOOK_MAX_BODY_BYTES = 256 * 1024

# E-mail: the whole JSON request to the provider ({"from", "to", "subject", "text", "html"}).
EMAIL_MAX_REQUEST_BYTES = 512 * 1024
# The sender (RELAY_EMAIL_SENDER) as a JSON string may take at most this much of it. Entry
# checks a payload with this room left for the sender, so what enters always fits when sent
# whichever sender the consumer has.
EMAIL_MAX_SENDER_BYTES = 1024
# ... and the tag naming the delivery (``"tags": [{"name": "relay_delivery", ...}]``, which
# receipts read) at most this much.
EMAIL_MAX_TAGS_BYTES = 128

# SMS: the message body in UTF-16 code units (never fewer than the provider counts);
# Twilio's limit for one (concatenated) message.
SMS_MAX_BODY_CHARS = 1600

# Any payload as stored (compact JSON, UTF-8): no channel sends more than this.
MAX_PAYLOAD_BYTES = EMAIL_MAX_REQUEST_BYTES

# Nesting of objects and arrays in a payload (the payload object itself is level 1).
MAX_PAYLOAD_DEPTH = 32

# Idempotency keys as sent (Idempotency-Key, webhook-id): Resend caps them at 256.
MAX_IDEMPOTENCY_KEY_CHARS = 256
