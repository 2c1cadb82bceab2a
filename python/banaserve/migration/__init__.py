"""Dynamic migration (mechanism 4 of DESIGN.md): work moves between prefill and decode as the
load turns.

``--migration role`` (:mod:`banaserve.migration.role_controller`): whole instances change role.
Roles are routing labels, so a move costs no bytes; the controller is pure code over the
router's load records with an injected clock, run by the gateway
(:mod:`banaserve.cluster.migration_loop`). Layer-level moves (weights and KV of a block of
layers) come later.
"""

#: The ``--migration`` modes (the command line keeps a copy, checked by a test).
MIGRATION_MODES: tuple[str, ...] = ("off", "role")
