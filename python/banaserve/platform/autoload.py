"""Imported by ``banaserve_platform.pth`` in every Python process; keep it cheap."""

from banaserve.platform.import_hook import install

install()
