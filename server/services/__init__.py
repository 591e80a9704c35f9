"""What the routes, the command line and the worker do with the database and the store: one module
per concern (jobs, datasets, checkpoints, keys, sweeps, the Hub...). Their refusals are
``server.services.failures``, which the API turns into HTTP errors (``server.errors``).
"""
