"""Dynamic migration (mechanism 4 of DESIGN.md): work moves between prefill and decode as the
load turns.

``--migration role`` (:mod:`banaserve.migration.role_controller`): whole instances change role.
Roles are routing labels, so a move costs no bytes; the controller is pure code over the
router's load records with an injected clock, run by the gateway
(:mod:`banaserve.cluster.role_loop`). ``--migration layer``: each decode instance runs as
two pipeline stages, its later layers on a prefill instance's core
(:func:`banaserve.cluster.topology.lend_decode_layers`), and the boundary moves at run time,
weights and KV of the layers between (:mod:`banaserve.platform.pp_movable`, applied by
:mod:`banaserve.cluster.layer_loop`). Its controller
(:mod:`banaserve.migration.layer_controller`, with :mod:`banaserve.migration.arrival_trend`
for the predictive mode) is pure code over the same load records, in the units of
:mod:`banaserve.migration.work`; :mod:`banaserve.migration.boundary_control` is the record a
split instance's stages share. Attention-level migration is not built yet.
"""

#: The ``--migration`` modes.
MIGRATION_MODES: tuple[str, ...] = ("off", "role", "layer")
