-- The last check before a request (issue 24, item 4): an operator's cancel or dead-letter
-- of a run reaches rows already claimed, and says which of them were already on the wire.

-- When this attempt passed its last check (its claim, or the guarded UPDATE right before
-- the request after a wait; taken back before any wait): from then on its request may be
-- on the wire. NULL: waiting (budget, slot), or not sending. `relay runs cancel` and
-- `dead-letter` move a claimed row without it at once (its consumer's last check then
-- finds the row moved and sends nothing), and leave a row with it to finish, marked
-- (stop_action_id) so that it is never sent again.
ALTER TABLE deliveries ADD COLUMN last_check_at timestamptz;
ALTER TABLE deliveries ADD CONSTRAINT last_check_only_while_sending
    CHECK (last_check_at IS NULL OR state = 'sending');

-- The run action that asked this row to stop while its request was on the wire: the row
-- never passes another last check, and ends skipped ('cancelled') or dead as the action
-- says (by the action's own second pass, or by the consumer that next claims it).
ALTER TABLE deliveries ADD COLUMN stop_action_id bigint REFERENCES run_actions (id);
ALTER TABLE deliveries ADD CONSTRAINT stop_only_while_open
    CHECK (stop_action_id IS NULL OR state IN ('queued', 'sending', 'retrying'));

-- What a cancel or dead-letter met besides the rows it moved: claimed rows it stopped
-- before their request (counted in rows too), rows on the wire at its commit, and what
-- became of those once the command stopped waiting (state -> rows; NULL: not waited for).
ALTER TABLE run_actions ADD COLUMN claimed_stopped integer NOT NULL DEFAULT 0
    CHECK (claimed_stopped >= 0);
ALTER TABLE run_actions ADD COLUMN on_the_wire integer NOT NULL DEFAULT 0
    CHECK (on_the_wire >= 0);
ALTER TABLE run_actions ADD COLUMN wire_outcomes jsonb
    CHECK (wire_outcomes IS NULL OR jsonb_typeof(wire_outcomes) = 'object');
ALTER TABLE run_actions ADD CONSTRAINT run_actions_claimed_within_rows
    CHECK (claimed_stopped <= rows);
