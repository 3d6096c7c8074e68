"""grant-conform: the conformance suite every home must pass (DESIGN §8, docs/conform.md).

A home is conformant iff these clauses pass against it with the core
unmodified. ``stage`` is the protocol a home's harness implements (levers
and declared lacks), ``clauses`` the contract checked, ``runner`` runs them
against one stage (fiberd started per clause, in-process, as the ``fiberd``
command starts it), ``report`` says what was found, ``registry`` finds
stages by home name, ``standalone`` is the standalone home's stage, and
``plugin`` runs the same clauses under pytest (``--conform-home``). This
package imports nothing at import time, so the pytest plugin stays inert
and cheap when not asked for.
"""
