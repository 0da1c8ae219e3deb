-- A publish, rescue or backfill run that ends without recording its end (SIGKILL, a
-- Job's activeDeadlineSeconds, a lost node) no longer stays 'running' for ever: while a
-- run runs, its session holds an advisory lock on its id, and the next run marks every
-- 'running' run whose lock no session holds 'interrupted'. A run stopped by SIGTERM or
-- SIGINT records 'interrupted' itself, with its counts.
ALTER TABLE publish_runs DROP CONSTRAINT publish_runs_status_check;
ALTER TABLE publish_runs ADD CONSTRAINT publish_runs_status_check
    CHECK (status IN ('running', 'ok', 'incomplete', 'paused', 'failed', 'interrupted'));
