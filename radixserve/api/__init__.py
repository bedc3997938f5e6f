"""The OpenAI-compatible HTTP edge shared by the server and the router: the request schemas
(``protocol``, over ``body``), the error envelope and its handlers (``errors``), the gate every
request passes (``guard``: keys, tenants, body limit) and the HTTP front's settings
(``config``)."""
