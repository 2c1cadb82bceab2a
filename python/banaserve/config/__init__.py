"""Typed options: the launcher's and the cluster's (``cli``), the store's, the pipeline's and
the supervisor's restart policy. Read by the entry points, the cluster and each instance; they
import only the pure cores (``router``, ``migration``, ``api``) and ``env`` below them."""
