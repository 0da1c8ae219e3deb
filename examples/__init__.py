"""Worked examples of using reminder-relay from an application (not part of the product)."""
