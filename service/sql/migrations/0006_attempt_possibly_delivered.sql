-- Whether an attempt's request may have reached the receiver: false only when it failed
-- before any byte could (refused before sending, or while connecting). Support work: a
-- failed attempt with possibly_delivered may still have had its effect.
ALTER TABLE delivery_attempts ADD COLUMN possibly_delivered boolean;
