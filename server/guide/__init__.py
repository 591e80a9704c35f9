"""The manual: the generated reference pages of ``docs/reference/`` (``server.guide.reference``,
``make docs``) and the ``/guide`` pages the service renders from ``docs/`` (``server.guide.pages``).

Neither imports torch: the reference reads the pydantic models, the argparse parsers and the
FastAPI routes, and the pages are Markdown rendered on request.
"""
