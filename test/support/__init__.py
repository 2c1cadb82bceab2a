"""Helpers shared by the unit and the end-to-end tests.

Test modules import these as ``support.<module>`` (pytest puts ``test/`` on ``sys.path``, see
``pythonpath`` in pyproject.toml) instead of importing each other or ``conftest`` by name:
two folders each with a ``conftest.py`` make ``import conftest`` mean whichever loaded last.
"""
