-- An on-call can trust the console (issue 28, items 2 and 3).
-- Server-side sessions (a cookie holds a random id; the row is what makes it valid, so a
-- logout or a revoked operator ends it at once), the record of every reveal of redacted
-- data, and the deployment's secret that keys the destination references in URLs.

CREATE TABLE console_sessions (
    id             bigserial PRIMARY KEY,
    -- SHA-256 of the cookie's random id: a read of this table yields no usable cookie.
    id_hash        bytea NOT NULL UNIQUE CHECK (length(id_hash) = 32),
    operator       text NOT NULL CHECK (length(operator) BETWEEN 1 AND 64),
    -- Which entry of the operators file the session was opened with: a session outlives
    -- neither the operator's removal nor a new token for them.
    credential     text NOT NULL,
    csrf           text NOT NULL CHECK (length(csrf) >= 32),
    created_at     timestamptz NOT NULL,
    last_seen_at   timestamptz NOT NULL,
    expires_at     timestamptz NOT NULL,  -- absolute: the idle limit is checked on use
    revoked_at     timestamptz,
    revoked_why    text CHECK (revoked_why IN ('logout', 'operator_gone')),
    CHECK (last_seen_at >= created_at),
    CHECK (expires_at > created_at),
    CHECK ((revoked_at IS NULL) = (revoked_why IS NULL))
);

CREATE INDEX console_sessions_expires_idx ON console_sessions (expires_at);

-- Who saw unredacted recipients or reply bodies, when, on which page.
CREATE TABLE console_reveals (
    id        bigserial PRIMARY KEY,
    operator  text NOT NULL,
    page      text NOT NULL CHECK (length(page) BETWEEN 1 AND 300),
    at        timestamptz NOT NULL
);

CREATE INDEX console_reveals_at_idx ON console_reveals (at);

-- Per-deployment secrets of the console, made once by the first console that starts.
CREATE TABLE console_secrets (
    name        text PRIMARY KEY CHECK (name IN ('destination_ref')),
    secret      bytea NOT NULL CHECK (length(secret) >= 32),
    created_at  timestamptz NOT NULL DEFAULT now()
);
