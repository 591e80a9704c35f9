"""The HTTP routes: one module per resource (``/api/...``), ``openai`` for the OpenAI-compatible
``/v1`` API, ``docs`` for ``/docs`` and ``/redoc``, ``guide`` for the manual at ``/guide``;
``server.app`` registers their routers. A route checks its input and calls ``server.services``.
"""
