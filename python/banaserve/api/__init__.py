"""Checks of client requests and their limits: pure code at the bottom, shared by the gateway
(``cluster/intake``), each instance's guard (``server/request_guard``) and the router."""
