"""Operator tools beside the core: the ``relay`` command line and the handlers that need
only the core, the run report's rendering, the reminders-file loader, the demo and the
demo partner endpoint.

Nothing in the core (``service`` outside this package), ``publisher`` or ``consumer``
imports from here; import-linter holds that line.
"""
