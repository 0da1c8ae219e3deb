"""Expiring support holds: the transactional outbox in a worked example."""
