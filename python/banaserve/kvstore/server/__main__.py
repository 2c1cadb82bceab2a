"""``python -m banaserve.kvstore.server``: one store shard (see ``--help``)."""

from banaserve.kvstore.server.cli import main

if __name__ == "__main__":
    main()
